"""HF Qwen2/Llama <-> megatron-core GPTModel state-dict conversion (tensor parallel size 1).

Pure tensor reshuffling, no megatron import: HF keeps ``q_proj``/``k_proj``/``v_proj`` and
``gate_proj``/``up_proj`` apart; megatron-core (local layer spec) fuses them into
``linear_qkv`` — grouped per key/value head as ``[q of the group's heads, k, v]`` — and
``linear_fc1 = [gate; up]``. Layer norms move from ``input_layernorm``/``post_attention_layernorm``
to ``input_layernorm``/``pre_mlp_layernorm``.

Example:
    >>> mc = hf_to_mcore(hf_model.state_dict(), shape)
    >>> hf = mcore_to_hf(mc, shape)          # same tensors back
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["QwenShape", "hf_to_mcore", "mcore_to_hf"]


@dataclass(kw_only=True, frozen=True, slots=True)
class QwenShape:
    """The shapes the conversion needs, read from an HF config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def from_hf_config(cls, config: object) -> QwenShape:
        heads = int(config.num_attention_heads)  # type: ignore[attr-defined]
        hidden = int(config.hidden_size)  # type: ignore[attr-defined]
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        return cls(
            layers=int(config.num_hidden_layers),  # type: ignore[attr-defined]
            heads=heads,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, s: QwenShape) -> Tensor:
    per = s.heads // s.kv_heads
    rest = q.shape[1:]
    qg = q.reshape(s.kv_heads, per * s.head_dim, *rest)
    kg = k.reshape(s.kv_heads, s.head_dim, *rest)
    vg = v.reshape(s.kv_heads, s.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: Tensor, s: QwenShape) -> tuple[Tensor, Tensor, Tensor]:
    per = s.heads // s.kv_heads
    rest = qkv.shape[1:]
    g = qkv.reshape(s.kv_heads, (per + 2) * s.head_dim, *rest)
    q, k, v = torch.split(g, [per * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def hf_to_mcore(hf: Mapping[str, Tensor], s: QwenShape) -> dict[str, Tensor]:
    """Convert an HF Qwen2/Llama state dict to megatron-core GPTModel (local spec) names."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
           "decoder.final_layernorm.weight": hf["model.norm.weight"]}
    if not s.tied:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(s.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[att + "q_proj.weight"], hf[att + "k_proj.weight"], hf[att + "v_proj.weight"], s)
        if att + "q_proj.bias" in hf:
            out[m + "self_attention.linear_qkv.bias"] = _fuse_qkv(
                hf[att + "q_proj.bias"], hf[att + "k_proj.bias"], hf[att + "v_proj.bias"], s)
        out[m + "self_attention.linear_proj.weight"] = hf[att + "o_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]], dim=0)
        out[m + "mlp.linear_fc2.weight"] = hf[h + "mlp.down_proj.weight"]
    return out


def mcore_to_hf(mc: Mapping[str, Tensor], s: QwenShape) -> dict[str, Tensor]:
    """Convert megatron-core GPTModel (local spec) weights back to HF names.

    Tied embeddings give no ``lm_head.weight`` (as ``save_pretrained`` writes them).
    ``_extra_state`` entries are ignored.
    """
    out = {"model.embed_tokens.weight": mc["embedding.word_embeddings.weight"],
           "model.norm.weight": mc["decoder.final_layernorm.weight"]}
    if not s.tied:
        out["lm_head.weight"] = mc["output_layer.weight"]
    for i in range(s.layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        att = h + "self_attn."
        out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
        q, k, v = _split_qkv(mc[m + "self_attention.linear_qkv.weight"], s)
        out[att + "q_proj.weight"], out[att + "k_proj.weight"], out[att + "v_proj.weight"] = q, k, v
        if m + "self_attention.linear_qkv.bias" in mc:
            q, k, v = _split_qkv(mc[m + "self_attention.linear_qkv.bias"], s)
            out[att + "q_proj.bias"], out[att + "k_proj.bias"], out[att + "v_proj.bias"] = q, k, v
        out[att + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        gate, up = torch.chunk(mc[m + "mlp.linear_fc1.weight"], 2, dim=0)
        out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
        out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    return out
