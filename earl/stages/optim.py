"""The trainer's optimizer and learning-rate schedule: `OptimConfig` (AdamW).

A section of the run's config (`earl.config.RunConfig.optim`) and a field of the trainer's
(`earl.stages.trainer_torch.TrainerConfig.optim`), declared once here; it loads without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from earl.runtime.errors import need

__all__ = ["OptimConfig", "lr_scale"]


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW and the learning-rate schedule.

    Attributes:
        lr: learning rate (after warmup).
        betas, adam_eps, weight_decay: AdamW settings.
        warmup_steps: linear warmup from 0 over this many steps.
        grad_clip: max global gradient norm (0 = no clipping).
        lr_anneal_from: once the run's progress (the larger of elapsed / time limit and
            step / steps) passes it, the LR falls linearly to `lr_final` x lr at the end
            (1.0: constant).
        lr_final: the LR at the end of the annealing, as a fraction of `lr`.
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.99)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip: float = 1.0
    lr_anneal_from: float = 1.0
    lr_final: float = 0.1

    def __post_init__(self) -> None:
        self.betas = (float(self.betas[0]), float(self.betas[1]))
        need(self.lr > 0, "lr", f"must be > 0, got {self.lr}")
        need(all(0 <= b < 1 for b in self.betas), "betas", "both must be in [0, 1)")
        need(self.adam_eps > 0, "adam_eps", "must be > 0")
        need(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0 (0 = no warmup)")
        need(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 = no clipping)")
        need(0 <= self.lr_anneal_from <= 1, "lr_anneal_from",
             "must be in [0, 1] (the run's progress where annealing starts; 1 = never)")
        need(0 < self.lr_final <= 1, "lr_final", "must be in (0, 1] (a fraction of lr)")


def lr_scale(o: OptimConfig, progress: float) -> float:
    """The LR multiplier at `progress` in [0, 1] of the run (see `lr_anneal_from`)."""
    if progress <= o.lr_anneal_from or o.lr_anneal_from >= 1:
        return 1.0
    frac = min((progress - o.lr_anneal_from) / (1 - o.lr_anneal_from), 1.0)
    return 1.0 - frac * (1.0 - o.lr_final)
