"""Policy-gradient surrogate losses (PPO-clip), per token, before aggregation.

Every function here returns a per-token loss with the input's shape; reduce it with
``earl.algorithms.aggregation.aggregate``. Nothing here knows about models, masks or batches.
"""

from __future__ import annotations

import torch
from torch import Tensor


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, per token: ``-min(r A, clip(r, 1-clip_low, 1+clip_high) A)``.

    ``r = exp(logprobs - old_logprobs)``. ``clip_high > clip_low`` is DAPO's clip-higher. With
    ``dual_clip = c > 1`` (Ye et al. 2020), the loss of a negative-advantage token is also capped
    at ``-c A`` so a huge ratio cannot blow it up.

    Args:
        logprobs: current policy log-probs (carry the gradient).
        old_logprobs: log-probs of the policy the ratio is taken against (no gradient).
        advantages: per-token advantages.
        clip_low, clip_high: the clip range ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: the dual-clip constant ``c`` (> 1), or None.

    Returns:
        ``(loss, clipped)``: per-token loss and a bool tensor, True where a clip was active
        (the gradient of that token is zero).
    """
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low={clip_low} and clip_high={clip_high} must be >= 0")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0), got {dual_clip}")
    ratio = torch.exp(logprobs - old_logprobs.detach())
    unclipped = -advantages * ratio
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = -advantages * clipped_ratio
    loss = torch.maximum(unclipped, clipped)
    is_clipped = clipped > unclipped
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        is_clipped = is_clipped | dual
    return loss, is_clipped


def vanilla_pg_loss(logprobs: Tensor, advantages: Tensor) -> Tensor:
    """REINFORCE surrogate ``-A log pi``, per token (on-policy, no ratio, no clip)."""
    return -advantages * logprobs
