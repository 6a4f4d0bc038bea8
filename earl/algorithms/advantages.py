"""Advantage estimation: GRPO group baselines and per-turn (per-move) credit assignment.

Pure tensor functions, no model and no I/O. Sequence-level values (one per sample) and turn-level
values (one per assistant turn) are mapped onto tokens here; which tokens are trained on is the
loss mask's business, not this module's.

Example:
    >>> r = torch.tensor([1.0, 0.0, 1.0, 1.0])          # 2 groups of 2
    >>> grpo_advantages(r, group_size=2, normalize_std=False)
    tensor([0.5000, -0.5000, 0.0000, 0.0000])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def grpo_advantages(
    rewards: Tensor,
    *,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, optionally divided by the group's std.

    Groups are either consecutive blocks of ``group_size`` samples or given by ``group_ids``
    (any integer label per sample). The std is the unbiased sample std (as in GRPO); a group whose
    rewards are all equal gets advantage 0 for every sample.

    Args:
        rewards: ``[N]`` float rewards, one per sample.
        group_size: samples per group, consecutive. Exactly one of this and ``group_ids``.
        group_ids: ``[N]`` integer group label per sample.
        normalize_std: divide by the group's std (Dr. GRPO turns this off).
        eps: added to the std.

    Returns:
        ``[N]`` advantages.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if (group_size is None) == (group_ids is None):
        raise ValueError("pass exactly one of group_size= or group_ids=")
    if group_size is not None:
        if group_size <= 0 or rewards.numel() % group_size:
            raise ValueError(
                f"group_size={group_size} must be positive and divide the number of rewards "
                f"({rewards.numel()})"
            )
        group_ids = torch.arange(rewards.numel(), device=rewards.device) // group_size
    assert group_ids is not None
    _, inv, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    return _normalize_by_segment(rewards.float(), inv, counts, normalize_std, eps)


def _normalize_by_segment(
    x: Tensor, inv: Tensor, counts: Tensor, normalize_std: bool, eps: float
) -> Tensor:
    n = counts.numel()
    sums = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inv, x)
    mean = sums / counts
    centered = x - mean[inv]
    if not normalize_std:
        return centered
    sq = torch.zeros(n, dtype=x.dtype, device=x.device).index_add_(0, inv, centered**2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return centered / (std[inv] + eps)


def broadcast_to_tokens(values: Tensor, lengths: Tensor | Sequence[int]) -> Tensor:
    """Repeat one value per sample over that sample's tokens (packed, flat layout).

    Args:
        values: ``[N]`` per-sample values (e.g. GRPO advantages).
        lengths: ``[N]`` token counts of the samples.

    Returns:
        ``[sum(lengths)]`` per-token values; multiply by the loss mask to train only on
        generated tokens.
    """
    lengths = torch.as_tensor(lengths, dtype=torch.long, device=values.device)
    if lengths.shape != values.shape:
        raise ValueError(f"values {tuple(values.shape)} and lengths {tuple(lengths.shape)} differ")
    return torch.repeat_interleave(values, lengths)


def discounted_returns(rewards: Tensor, gamma: float = 1.0, mask: Tensor | None = None) -> Tensor:
    """Discounted return of each turn: ``G_k = r_k + gamma * G_{k+1}``, per row.

    Args:
        rewards: ``[K]`` or ``[B, K]`` per-turn rewards (right-padded rows for ``[B, K]``).
        gamma: discount per turn, in ``[0, 1]``.
        mask: same shape, 1 for real turns, 0 for padding (padding contributes nothing).

    Returns:
        Returns of the same shape (0 at padded turns).
    """
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma must be in [0, 1], got {gamma}")
    r = rewards.float() if mask is None else rewards.float() * mask
    out = torch.empty_like(r)
    running = torch.zeros_like(r[..., 0])
    for k in range(r.shape[-1] - 1, -1, -1):
        running = r[..., k] + gamma * running
        out[..., k] = running
    return out if mask is None else out * mask


def turn_token_values(
    turn_values: Tensor, turn_spans: Sequence[tuple[int, int]], length: int
) -> Tensor:
    """Map one value per assistant turn onto that turn's tokens ``[start, end)``; 0 elsewhere.

    Args:
        turn_values: ``[K]`` value (return or advantage) of each turn.
        turn_spans: ``K`` half-open token spans, as in ``Trajectory.turn_spans``.
        length: the sample's token count.

    Returns:
        ``[length]`` per-token values.
    """
    if turn_values.numel() != len(turn_spans):
        raise ValueError(
            f"{turn_values.numel()} turn values for {len(turn_spans)} turn_spans; they must match"
        )
    out = torch.zeros(length, dtype=torch.float32, device=turn_values.device)
    for v, (start, end) in zip(turn_values.tolist(), turn_spans, strict=True):
        if not 0 <= start <= end <= length:
            raise ValueError(f"turn span ({start}, {end}) outside a sample of length {length}")
        out[start:end] = v
    return out


def per_turn_advantages(
    turn_rewards: Sequence[Sequence[float]],
    group_ids: Sequence[int] | Tensor,
    *,
    gamma: float = 1.0,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> list[Tensor]:
    """Per-move credit: discounted return per turn, normalised against the group's turns.

    Each sample's turns get ``G_k = r_k + gamma * G_{k+1}``; then every turn's return is centred
    (and optionally scaled) by the mean/std of all turn returns in the same group, so a move is
    credited relative to the moves the same prompt's other rollouts made.

    Args:
        turn_rewards: per sample, its per-turn rewards (may differ in length; may be empty).
        group_ids: per sample, its group label.
        gamma: discount per turn.
        normalize_std: divide by the group's std of turn returns.
        eps: added to the std.

    Returns:
        Per sample a ``[K_i]`` tensor of turn advantages; feed each to ``turn_token_values``.
    """
    if len(turn_rewards) != len(group_ids):
        raise ValueError(f"{len(turn_rewards)} turn_rewards for {len(group_ids)} group_ids")
    returns = [discounted_returns(torch.tensor(list(r), dtype=torch.float32), gamma)
               for r in turn_rewards]
    flat = torch.cat(returns) if returns else torch.zeros(0)
    counts = [int(r.numel()) for r in returns]
    gids = torch.repeat_interleave(torch.as_tensor(group_ids, dtype=torch.long),
                                   torch.tensor(counts, dtype=torch.long))
    if flat.numel() == 0:
        return [torch.zeros(0) for _ in returns]
    _, inv, gcounts = torch.unique(gids, return_inverse=True, return_counts=True)
    adv = _normalize_by_segment(flat, inv, gcounts, normalize_std, eps)
    return list(torch.split(adv, counts))
