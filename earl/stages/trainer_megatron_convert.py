"""HF Qwen2/Llama <-> megatron-core GPTModel state-dict conversion, with tensor-parallel shards.

Pure tensor reshuffling, no megatron import and no communication: HF keeps
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj`` apart; megatron-core (local layer
spec) fuses them into ``linear_qkv`` — grouped per key/value head as ``[q of the group's heads,
k, v]`` — and ``linear_fc1 = [gate; up]``. Layer norms move from
``input_layernorm``/``post_attention_layernorm`` to ``input_layernorm``/``pre_mlp_layernorm``.

Tensor parallel (``tp_size > 1``): each rank holds megatron's shard of every tensor.
Column-parallel ``linear_qkv`` takes whole key/value groups (a contiguous block of the grouped
layout), ``linear_fc1`` is ``[gate shard; up shard]``; row-parallel ``linear_proj`` and
``linear_fc2`` split their input dimension; the word embeddings and ``output_layer`` split the
vocabulary; layer norms are replicated. `check_tp` names what must divide by the TP size (the
vocabulary is not padded: megatron's ``VocabParallelEmbedding`` needs ``vocab % tp == 0``).
Gathering the shards from the ranks is the caller's job (`trainer_megatron_tp`).

Pipeline parallel (``pp_size > 1``): stage ``pp_rank`` holds layers
``[pp_rank * L / pp, (pp_rank + 1) * L / pp)`` renumbered from 0 (megatron's local names), the
word embeddings on the first stage, the final norm and ``output_layer`` on the last. A tied model
keeps a copy of the embeddings as the last stage's ``output_layer`` (the trainer keeps the two
equal by summing their gradients). `gather_pp` merges the stages back; `check_pp` names what
must divide.

Example:
    >>> mc = hf_to_mcore(hf_model.state_dict(), shape)          # TP=1
    >>> hf = mcore_to_hf(mc, shape)                             # same tensors back
    >>> shards = [hf_to_mcore(hf, shape, tp_rank=r, tp_size=2) for r in range(2)]
    >>> hf = mcore_to_hf(shards, shape)                         # gathered from TP shards
    >>> stages = [hf_to_mcore(hf, shape, pp_rank=p, pp_size=2) for p in range(2)]
    >>> hf = mcore_to_hf(gather_pp(stages, shape), shape)      # gathered from PP stages
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["QwenShape", "check_pp", "check_tp", "gather_pp", "gather_tp", "hf_to_mcore",
           "mcore_to_hf", "pp_stage", "shard_tp", "tp_split"]

Split = Literal["rows", "cols", "fc1", "none"]


@dataclass(kw_only=True, frozen=True, slots=True)
class QwenShape:
    """The shapes the conversion needs, read from an HF config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    vocab: int = 0  # 0: unknown (only `check_tp` reads these two)
    ffn: int = 0

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
            vocab=int(getattr(config, "vocab_size", 0) or 0),
            ffn=int(getattr(config, "intermediate_size", 0) or 0),
        )


def check_tp(s: QwenShape, tp: int) -> None:
    """Raise unless the model shards over ``tp`` ranks.

    Raises:
        ValueError: ``TrainerConfig.tp`` does not divide the heads, the key/value heads (each
            rank holds whole KV groups), the MLP width or the vocabulary.
    """
    sizes = {"num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
             "intermediate_size": s.ffn, "vocab_size": s.vocab}
    for name, n in sizes.items():
        if n % tp:
            raise ValueError(f"TrainerConfig.tp={tp} does not divide the model's {name}={n}; "
                             "choose a TP degree that divides it (megatron shards whole "
                             "key/value groups and does not pad the vocabulary here)")


def check_pp(s: QwenShape, pp: int) -> None:
    """Raise unless the model's layers split evenly over ``pp`` pipeline stages.

    Raises:
        ValueError: ``TrainerConfig.pp`` does not divide ``num_hidden_layers``.
    """
    if s.layers % pp:
        raise ValueError(f"TrainerConfig.pp={pp} does not divide the model's "
                         f"num_hidden_layers={s.layers}; choose a PP degree that divides it "
                         "(every stage holds the same number of layers)")


def _layer(name: str) -> tuple[int, str] | None:
    """``(index, rest)`` of a ``decoder.layers.<i>.<rest>`` name, None for any other."""
    if not name.startswith("decoder.layers."):
        return None
    i, rest = name[len("decoder.layers."):].split(".", 1)
    return int(i), rest


def pp_stage(mc: Mapping[str, Tensor], s: QwenShape, pp_rank: int,
             pp_size: int) -> dict[str, Tensor]:
    """Stage ``pp_rank``'s part of a full (PP=1) megatron state dict, layers renumbered from 0
    (see the module doc; a tied model's last stage gets ``output_layer`` = the embeddings)."""
    if pp_size == 1:
        return dict(mc)
    check_pp(s, pp_size)
    per = s.layers // pp_size
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    out = {}
    for name, t in mc.items():
        layer = _layer(name)
        if layer is not None:
            i, rest = layer
            if pp_rank * per <= i < (pp_rank + 1) * per:
                out[f"decoder.layers.{i - pp_rank * per}.{rest}"] = t
        elif (first and name.startswith("embedding.")) or (
                last and name.startswith(("decoder.final_layernorm.", "output_layer."))):
            out[name] = t
    if s.tied and last:
        out["output_layer.weight"] = mc["embedding.word_embeddings.weight"]
    return out


def gather_pp(stages: Sequence[Mapping[str, Tensor]], s: QwenShape) -> dict[str, Tensor]:
    """The full (PP=1) megatron state dict from every stage's (in stage order), layers
    renumbered back; a tied model's ``output_layer`` copy is dropped."""
    if len(stages) == 1:
        return dict(stages[0])
    per = s.layers // len(stages)
    out = {}
    for p, stage in enumerate(stages):
        for name, t in stage.items():
            layer = _layer(name)
            if layer is not None:
                out[f"decoder.layers.{layer[0] + p * per}.{layer[1]}"] = t
            elif not (s.tied and name == "output_layer.weight"):
                out[name] = t
    return out


def tp_split(name: str) -> Split:
    """How megatron shards the tensor ``name`` over TP ranks: ``"rows"`` (dim 0), ``"cols"``
    (dim 1), ``"fc1"`` (``[gate; up]`` each split by rows) or ``"none"`` (replicated)."""
    if name.endswith(("word_embeddings.weight", "output_layer.weight")) or ".linear_qkv." in name:
        return "rows"
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return "cols"
    if name.endswith("linear_fc1.weight"):
        return "fc1"
    return "none"


def shard_tp(mc: Mapping[str, Tensor], tp_rank: int, tp_size: int) -> dict[str, Tensor]:
    """Rank ``tp_rank``'s shard of every tensor of a full (TP=1) megatron state dict."""
    if tp_size == 1:
        return dict(mc)
    out = {}
    for name, t in mc.items():
        split = tp_split(name)
        if split == "rows":
            t = t.chunk(tp_size, dim=0)[tp_rank]
        elif split == "cols":
            t = t.chunk(tp_size, dim=1)[tp_rank]
        elif split == "fc1":
            gate, up = t.chunk(2, dim=0)
            t = torch.cat([gate.chunk(tp_size)[tp_rank], up.chunk(tp_size)[tp_rank]])
        out[name] = t.contiguous()
    return out


def gather_tp(shards: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """The full (TP=1) megatron state dict from every TP rank's shard, in rank order."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name in shards[0]:
        parts = [sh[name] for sh in shards]
        split = tp_split(name)
        if split == "rows":
            out[name] = torch.cat(parts, dim=0)
        elif split == "cols":
            out[name] = torch.cat(parts, dim=1)
        elif split == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            out[name] = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
        else:
            out[name] = parts[0]
    return out


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


def hf_to_mcore(hf: Mapping[str, Tensor], s: QwenShape, *, tp_rank: int = 0,
                tp_size: int = 1, pp_rank: int = 0, pp_size: int = 1) -> dict[str, Tensor]:
    """Convert an HF Qwen2/Llama state dict to megatron-core GPTModel (local spec) names.

    Args:
        hf: the full HF state dict.
        s: the model's shapes.
        tp_rank: this rank's index in its tensor-parallel group.
        tp_size: the tensor-parallel degree (1: the full tensors).
        pp_rank: this rank's pipeline stage.
        pp_size: the pipeline-parallel degree (1: every layer).

    Returns:
        Rank ``tp_rank``'s shard of every megatron tensor of stage ``pp_rank`` (module doc).

    Raises:
        ValueError: ``tp_size`` does not divide the model's shapes (`check_tp`), or
            ``pp_size`` its layers (`check_pp`).
    """
    if tp_size > 1:
        check_tp(s, tp_size)
    if pp_size > 1:
        check_pp(s, pp_size)
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
    return shard_tp(pp_stage(out, s, pp_rank, pp_size), tp_rank, tp_size)


def mcore_to_hf(mc: Mapping[str, Tensor] | Sequence[Mapping[str, Tensor]],
                s: QwenShape) -> dict[str, Tensor]:
    """Convert megatron-core GPTModel (local spec) weights back to HF names.

    Args:
        mc: a full (TP=1, PP=1) megatron state dict, or the list of every TP rank's shard in
            rank order (gathered with `gather_tp`); merge PP stages first (`gather_pp`).
        s: the model's shapes.

    Tied embeddings give no ``lm_head.weight`` (as ``save_pretrained`` writes them).
    ``_extra_state`` entries are ignored.
    """
    if not isinstance(mc, Mapping):
        mc = gather_tp(mc)
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
