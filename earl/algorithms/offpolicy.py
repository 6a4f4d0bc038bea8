"""Off-policy corrections for asynchronous RL, where rollouts come from an older policy.

Three log-probs can exist per token:
    behaviour (``rollout_logprobs``): what the rollout engine sampled with, possibly stale and
        computed by a different kernel (vLLM) than the trainer's;
    proximal (``old_logprobs``): the trainer's policy right before this update (recomputed);
    current (``logprobs``): the policy being optimised, carrying the gradient.

``decoupled_ppo_loss`` is AReaL's decoupled PPO objective (Fu et al. 2025): clip the ratio against
the proximal policy, and importance-weight each token by ``pi_prox / pi_behav``.
``truncated_is_weights`` is truncated importance sampling (Yao et al. 2025, "Your efficient RL
framework secretly brings you off-policy RL training"): weight each token's loss by
``min(pi_old / pi_rollout, cap)`` to correct the trainer/rollout mismatch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from earl.algorithms.losses import ppo_clip_loss


def truncated_is_weights(old_logprobs: Tensor, rollout_logprobs: Tensor, cap: float = 2.0) -> Tensor:
    """Per-token weights ``min(exp(old - rollout), cap)`` (no gradient).

    Args:
        old_logprobs: trainer log-probs of the policy the loss is computed for.
        rollout_logprobs: the rollout engine's log-probs of the same tokens.
        cap: truncation ``C`` (>= 1).
    """
    if cap < 1.0:
        raise ValueError(f"truncated IS cap must be >= 1 (e.g. 2.0), got {cap}")
    return torch.exp(old_logprobs.detach() - rollout_logprobs).clamp(max=cap)


def decoupled_ppo_loss(
    logprobs: Tensor,
    proximal_logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    behaviour_weight_cap: float | None = 5.0,
) -> tuple[Tensor, Tensor, Tensor]:
    """Decoupled PPO, per token: ``w * PPO-clip(pi / pi_prox)``, ``w = pi_prox / pi_behav``.

    Tokens whose behaviour weight exceeds ``behaviour_weight_cap`` get weight 0 (dropped, as in
    AReaL) rather than clipped: they are too off-policy to trust.

    Args:
        logprobs: current log-probs (gradient).
        proximal_logprobs: trainer log-probs before this update.
        behaviour_logprobs: rollout (sampling) log-probs.
        advantages: per-token advantages.
        clip_low, clip_high: PPO clip range around the proximal policy.
        behaviour_weight_cap: drop tokens with ``w`` above this; None keeps all.

    Returns:
        ``(loss, clipped, weight)`` per token: loss, PPO clip indicator, behaviour weight used.
    """
    loss, clipped = ppo_clip_loss(
        logprobs, proximal_logprobs, advantages, clip_low=clip_low, clip_high=clip_high
    )
    weight = torch.exp(proximal_logprobs.detach() - behaviour_logprobs)
    if behaviour_weight_cap is not None:
        weight = torch.where(weight <= behaviour_weight_cap, weight, torch.zeros_like(weight))
    return loss * weight, clipped, weight
