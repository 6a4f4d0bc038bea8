"""KL divergence to a reference policy from sampled tokens: k1/k2/k3 estimators.

The estimators (Schulman, "Approximating KL divergence") take log-probs of the *sampled* tokens
under the current policy and the reference; ``KL(pi || ref)`` is their expectation under pi.
Use them as a loss term (differentiable in ``logprobs``) or as a reward penalty (detached,
subtracted from rewards before computing advantages).
"""

from __future__ import annotations

import torch
from torch import Tensor

from earl.algorithms.loss_config import KL_ESTIMATORS, KLEstimator


def kl_estimate(
    logprobs: Tensor, ref_logprobs: Tensor, kind: KLEstimator = "k3", clamp: float | None = 10.0
) -> Tensor:
    """Per-token KL estimate.

    ``k1 = log pi - log ref`` (unbiased, high variance, can be negative);
    ``k2 = (log pi - log ref)^2 / 2``; ``k3 = ref/pi - log(ref/pi) - 1`` (unbiased, >= 0).

    Args:
        logprobs: ``log pi`` of the sampled tokens.
        ref_logprobs: ``log ref`` of the same tokens.
        kind: ``"k1"``, ``"k2"`` or ``"k3"``.
        clamp: clamp the result to ``[-clamp, clamp]`` (k3 explodes when ref << pi); None: off.
    """
    diff = logprobs - ref_logprobs
    if kind == "k1":
        kl = diff
    elif kind == "k2":
        kl = 0.5 * diff**2
    elif kind == "k3":
        kl = torch.exp(-diff) + diff - 1.0
    else:
        raise ValueError(f"kl estimator {kind!r} unknown; choose one of {KL_ESTIMATORS}")
    return kl if clamp is None else kl.clamp(-clamp, clamp)


def kl_penalty_rewards(
    rewards: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    seq_ids: Tensor,
    *,
    coef: float,
    kind: KLEstimator = "k1",
) -> Tensor:
    """Subtract ``coef * sum_t KL_t`` (over each sample's loss tokens) from its scalar reward.

    Args:
        rewards: ``[N]`` per-sample rewards.
        logprobs, ref_logprobs, mask, seq_ids: ``[T]`` flat per-token tensors.
        coef: penalty weight (``beta``).
        kind: estimator.

    Returns:
        ``[N]`` penalised rewards (no gradient).
    """
    kl = kl_estimate(logprobs.detach(), ref_logprobs, kind) * mask.to(logprobs.dtype)
    per_seq = torch.zeros_like(rewards, dtype=kl.dtype).index_add_(0, seq_ids, kl)
    return rewards - coef * per_seq
