"""The full RL objective of one micro-batch: policy loss + KL loss - entropy bonus.

``policy_objective`` is what the trainer calls per micro-batch; it combines the pure pieces
(``losses``, ``offpolicy``, ``kl``, ``aggregation``) as chosen by ``LossConfig``. It does not
compute log-probs (the trainer does) and does not compute advantages (the pipeline does).

All returned terms are aggregated with the same global ``denom``, so summing them over
micro-batches and ranks gives the step's exact means.
"""

from __future__ import annotations

import torch
from torch import Tensor

from earl.algorithms.aggregation import aggregate
from earl.algorithms.kl import kl_estimate
from earl.algorithms.loss_config import LossConfig
from earl.algorithms.losses import ppo_clip_loss
from earl.algorithms.offpolicy import decoupled_ppo_loss, truncated_is_weights


def policy_objective(
    cfg: LossConfig,
    *,
    logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    old_logprobs: Tensor | None = None,
    rollout_logprobs: Tensor | None = None,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    denom: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss of one micro-batch (flat ``[T]`` tensors) and its metrics.

    Args:
        cfg: the loss recipe.
        logprobs: current per-token log-probs (gradient).
        advantages: per-token advantages.
        mask: 1 on tokens that are trained on.
        seq_ids: sample index of each token (for sequence-level aggregation).
        old_logprobs: proximal/old log-probs. None: the current ones, detached — exact when this
            is the first update since the rollout's policy was last recomputed by this trainer.
        rollout_logprobs: behaviour log-probs (required for ``tis``/``decoupled``); NaN on a
            token the behaviour policy did not sample (self-imitation), which counts as
            on-policy.
        ref_logprobs: reference log-probs (required when ``kl_coef > 0``).
        entropy: per-token entropy (required when ``entropy_coef > 0``).
        denom: global aggregation normaliser (``aggregation_denominator`` summed over the step).

    Returns:
        ``(loss, metrics)``; metrics are detached scalars aggregated like the loss
        (``pg_loss``, ``clip_frac``, ``kl``, ``entropy``, ``is_weight``, ``approx_kl_old``).
    """
    if cfg.needs_rollout_logprobs and rollout_logprobs is None:
        raise ValueError(f"loss.off_policy={cfg.off_policy!r} needs rollout_logprobs in the batch")
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError("loss.kl_coef > 0 needs ref_logprobs in the batch")
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("loss.entropy_coef > 0 needs the per-token entropy")

    def agg(x: Tensor) -> Tensor:
        return aggregate(x, mask, cfg.agg, seq_ids=seq_ids, denom=denom)

    metrics: dict[str, Tensor] = {}
    if rollout_logprobs is not None:
        # NaN marks a token the behaviour policy did not sample (a self-imitation target):
        # it is treated as on-policy, ratio 1.
        rollout_logprobs = torch.where(torch.isnan(rollout_logprobs), logprobs.detach(),
                                       rollout_logprobs)
    if old_logprobs is None:
        old_logprobs = (
            rollout_logprobs
            if cfg.off_policy == "none" and rollout_logprobs is not None
            else logprobs.detach()
        )
    if cfg.off_policy == "decoupled":
        assert rollout_logprobs is not None
        pg, clipped, weight = decoupled_ppo_loss(
            logprobs, old_logprobs, rollout_logprobs, advantages,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high,
            behaviour_weight_cap=cfg.behaviour_weight_cap,
        )
        metrics["is_weight"] = agg(weight).detach()
    else:
        pg, clipped = ppo_clip_loss(
            logprobs, old_logprobs, advantages,
            clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
        )
        if cfg.off_policy == "tis":
            assert rollout_logprobs is not None
            weight = truncated_is_weights(old_logprobs, rollout_logprobs, cfg.is_cap)
            pg = pg * weight
            metrics["is_weight"] = agg(weight).detach()
    loss = agg(pg)
    metrics["pg_loss"] = loss.detach()
    metrics["clip_frac"] = agg(clipped.to(logprobs.dtype)).detach()
    metrics["approx_kl_old"] = agg(kl_estimate(logprobs.detach(), old_logprobs, "k3")).detach()
    if ref_logprobs is not None:
        kl = agg(kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator))
        metrics["kl"] = kl.detach()
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    if entropy is not None:
        ent = agg(entropy)
        metrics["entropy"] = ent.detach()
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * ent
    metrics["loss"] = loss.detach()
    return loss, metrics

