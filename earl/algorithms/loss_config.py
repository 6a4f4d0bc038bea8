"""How a micro-batch's loss is formed: `LossConfig`, the RL objective's knobs.

Kept apart from `earl.algorithms.objective` (which needs torch) so that the run's config tree
(`earl.config.AlgorithmConfig` is a `LossConfig`) loads without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from earl.runtime.errors import need

__all__ = ["AGG_MODES", "KL_ESTIMATORS", "OFF_POLICY_MODES", "AggMode", "KLEstimator",
           "LossConfig", "OffPolicy"]

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
OffPolicy = Literal["none", "tis", "decoupled"]
OFF_POLICY_MODES: tuple[str, ...] = ("none", "tis", "decoupled")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """How a micro-batch's loss is formed.

    Attributes:
        clip_low, clip_high: PPO clip range ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: dual-clip constant (> 1) or None (only with ``off_policy`` "none"/"tis").
        agg: loss aggregation, one of ``AGG_MODES``.
        kl_coef: weight of the KL-to-reference *loss* (0 = off; a reward penalty is applied by
            the pipeline with ``kl.kl_penalty_rewards`` instead).
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        entropy_coef: entropy bonus weight (0 = off).
        off_policy: ``"none"``: ratio against ``old_logprobs`` (or the rollout log-probs when no
            recomputed ones are given); ``"tis"``: ratio against the trainer's ``old_logprobs``,
            loss weighted by ``min(pi_old / pi_rollout, is_cap)``; ``"decoupled"``: AReaL's
            decoupled PPO with proximal = ``old_logprobs`` and behaviour = rollout log-probs.
        is_cap: truncation of the TIS weight.
        behaviour_weight_cap: decoupled PPO drops tokens with ``pi_prox / pi_behav`` above it.
        temperature: the policy's sampling temperature: the rollout samples at it, and every
            log-prob (the rollout's, the trainer's, the reference's) is of logits / temperature.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    agg: AggMode = "token-mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    off_policy: OffPolicy = "none"
    is_cap: float = 2.0
    behaviour_weight_cap: float | None = 5.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        need(self.agg in AGG_MODES, "agg", f"{self.agg!r} unknown; choose one of {AGG_MODES}")
        need(self.kl_estimator in KL_ESTIMATORS, "kl_estimator",
             f"{self.kl_estimator!r} unknown; choose one of {KL_ESTIMATORS}")
        need(self.off_policy in OFF_POLICY_MODES, "off_policy",
             f"{self.off_policy!r} unknown; choose one of {OFF_POLICY_MODES}")
        need(self.clip_low > 0 and self.clip_high > 0, "clip_low",
             "clip_low and clip_high must be > 0 (PPO clips the ratio to [1-low, 1+high])")
        need(self.dual_clip is None or self.dual_clip > 1, "dual_clip", "must be > 1 or null")
        need(self.kl_coef >= 0, "kl_coef", "must be >= 0 (0 = no KL term)")
        need(self.entropy_coef >= 0, "entropy_coef", "must be >= 0 (0 = no entropy bonus)")
        need(self.is_cap > 0, "is_cap", "must be > 0")
        need(self.temperature > 0, "temperature", "must be > 0 for exploration")

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.off_policy in ("tis", "decoupled")
