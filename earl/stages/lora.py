"""LoRA adapters for the policy: `LoraConfig` and the three things a trainer needs from them.

With `rank` > 0 the trainer (`earl.stages.trainer_torch.TorchTrainer`) and the warm start
(`earl.learner.Learner`) train low-rank adapters through `peft` on top of frozen base weights:
the optimizer holds only the adapters, the rollout gets the merged weights (base + scale * B A,
HF names, `merged_weights`), and the reference is the same model with its adapter switched off
(`adapter_disabled`), so no second copy of the model is loaded. The config is a section of the
run's config (`earl.config.RunConfig.lora`) and a field of the trainer's; it loads without torch.

It does not decide what is trained or when weights are pushed (the trainer and the loop do).

Example:
    >>> model = apply_lora(hf_model, LoraConfig(rank=16))
    >>> for name, w in merged_weights(model): ...      # what vLLM loads
    >>> with adapter_disabled(model): ref = model(ids)  # the base policy
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from earl.runtime.errors import need
from earl.runtime.wire import message

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["LoraConfig", "adapter_disabled", "apply_lora", "base_model", "is_lora",
           "merged_weights"]

ADAPTER = "default"


@message  # travels to trainer and warm-start actors inside their configs
@dataclass(kw_only=True, slots=True)
class LoraConfig:
    """Low-rank adapters instead of full fine-tuning.

    Attributes:
        rank: adapter rank r (0 = off: every weight is trained).
        alpha: scale numerator; the update is ``alpha / rank * B @ A``.
        targets: the linear layers that get adapters: "all-linear" (every linear layer but
            the LM head) or comma-separated module names, e.g. "q_proj,v_proj".
        dropout: dropout on the adapters' input (0 keeps trainer and rollout log-probs equal).
    """

    rank: int = 0
    alpha: float = 32.0
    targets: str = "all-linear"
    dropout: float = 0.0

    def __post_init__(self) -> None:
        need(self.rank >= 0, "rank", "must be >= 0 (0 = full fine-tuning, no adapters)")
        need(self.alpha > 0, "alpha", "must be > 0 (the update is alpha / rank * B A)")
        need(bool(self.targets.strip()), "targets",
             'name the layers: "all-linear" or e.g. "q_proj,v_proj"')
        need(0 <= self.dropout < 1, "dropout", "must be in [0, 1)")

    @property
    def on(self) -> bool:
        return self.rank > 0

    def target_modules(self) -> str | list[str]:
        t = self.targets.strip()
        return t if t == "all-linear" else [s.strip() for s in t.split(",") if s.strip()]


def apply_lora(model: nn.Module, config: LoraConfig) -> nn.Module:
    """`model` (an HF causal LM) with fresh adapters (B = 0: it computes what `model` did);
    only the adapters require gradients, and they are fp32 whatever the base's dtype.

    Raises:
        ValueError: `config.targets` names no layer of the model (the message lists some).
    """
    import peft
    import torch

    pcfg = peft.LoraConfig(r=config.rank, lora_alpha=config.alpha,  # type: ignore[arg-type]
                           target_modules=config.target_modules(), lora_dropout=config.dropout,
                           bias="none", task_type="CAUSAL_LM")
    try:
        wrapped = peft.get_peft_model(model, pcfg)  # type: ignore[arg-type]
    except ValueError as exc:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                        if isinstance(m, torch.nn.Linear)})
        raise ValueError(f"config field 'lora.targets': {config.targets!r} matches no layer "
                         f"({exc}); linear layers of this model: {', '.join(names)}") from None
    for p in wrapped.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return wrapped


def is_lora(model: nn.Module) -> bool:
    """Whether `model` carries peft adapters."""
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under the peft wrapper (its layers hold the adapters)."""
    return model.get_base_model() if is_lora(model) else model  # type: ignore[operator,no-any-return]


def merged_weights(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(HF name, weight)`` of the model as one plain checkpoint: every adapted layer's
    weight is ``W + alpha / rank * B @ A`` (a new tensor; the model is unchanged), every other
    parameter as it is. Tied duplicates appear once, under the name that owns them."""
    import torch
    from peft.tuners.lora import LoraLayer

    inner = base_model(model)
    deltas: dict[str, Tensor] = {}
    with torch.no_grad():
        for name, module in inner.named_modules():
            if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
                deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(  # type: ignore[attr-defined]
                    ADAPTER)
        for name, p in inner.named_parameters():
            if ".lora_" in name:
                continue
            w = p.detach()
            delta = deltas.get(name)
            if delta is not None:
                w = w + delta.to(w.dtype)
            yield name.replace(".base_layer.", "."), w


@contextlib.contextmanager
def adapter_disabled(model: nn.Module) -> Iterator[None]:
    """While inside, `model` computes with its base weights alone (the reference policy)."""
    with model.disable_adapter():  # type: ignore[operator]
        yield
