"""Loss aggregation: reduce a per-token loss to a scalar, token-level or sequence-level.

Works on the packed (flat) layout the trainer uses — ``[T]`` tokens plus ``seq_ids`` ``[T]``
saying which sample each token belongs to — or on padded ``[B, L]`` rows (each row one sample).

Gradient accumulation over micro-batches and data-parallel ranks is exact when every micro-batch
divides by the *global* normaliser (all loss tokens, or all samples, of the optimizer step) rather
than its own: pass it as ``denom`` and sum the micro-batch losses. ``aggregation_denominator``
computes the local part of that normaliser.

Modes:
    ``token-mean``: sum over all loss tokens / number of loss tokens (DAPO, verl's default).
    ``seq-mean-token-sum``: per sample sum of token losses, mean over samples.
    ``seq-mean-token-mean``: per sample mean of token losses, mean over samples (original GRPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from earl.algorithms.loss_config import AGG_MODES, AggMode


def _check(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss aggregation mode {mode!r} unknown; choose one of {AGG_MODES}")


def _flat(values: Tensor, mask: Tensor, seq_ids: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} differ")
    if values.dim() == 2 and seq_ids is None:
        rows = torch.arange(values.shape[0], device=values.device)
        seq_ids = rows[:, None].expand_as(values)
        return values.reshape(-1), mask.reshape(-1), seq_ids.reshape(-1)
    if values.dim() != 1 or seq_ids is None or seq_ids.shape != values.shape:
        raise ValueError("pass flat [T] values with seq_ids [T], or padded [B, L] values")
    return values, mask, seq_ids


def aggregation_denominator(
    mask: Tensor, mode: AggMode, seq_ids: Tensor | None = None
) -> float:
    """The local normaliser of ``mode``: loss-token count, or number of samples with loss tokens.

    Sum it over micro-batches and ranks (``all_reduce``) to get the global ``denom``.
    """
    _check(mode)
    m = mask.float()
    if mode == "token-mean":
        return float(m.sum())
    _, m, sid = _flat(m, m, seq_ids)
    per_seq = torch.zeros(int(sid.max()) + 1 if sid.numel() else 0).index_add_(0, sid, m)
    return float((per_seq > 0).sum())


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: AggMode = "token-mean",
    *,
    seq_ids: Tensor | None = None,
    denom: float | None = None,
) -> Tensor:
    """Reduce per-token ``values`` over tokens where ``mask`` is nonzero.

    Args:
        values: ``[T]`` (with ``seq_ids``) or ``[B, L]`` per-token values.
        mask: same shape; 1 where the token counts (generated tokens), 0 elsewhere.
        mode: one of ``AGG_MODES`` (see module docstring).
        seq_ids: ``[T]`` sample index of each token, for the flat layout.
        denom: global normaliser (see ``aggregation_denominator``); default: this batch's own.

    Returns:
        A scalar tensor. Empty masks give 0 (not NaN).
    """
    _check(mode)
    v, m, sid = _flat(values, mask.to(values.dtype), seq_ids)
    if denom is None:
        denom = aggregation_denominator(m, mode, sid)
    denom = max(denom, 1.0)
    vm = v * m
    if mode in ("token-mean", "seq-mean-token-sum"):
        return vm.sum() / denom
    n = int(sid.max()) + 1 if sid.numel() else 0
    seq_sum = torch.zeros(n, dtype=v.dtype, device=v.device).index_add(0, sid, vm)
    seq_cnt = torch.zeros(n, dtype=v.dtype, device=v.device).index_add(0, sid, m)
    return (seq_sum / seq_cnt.clamp(min=1)).sum() / denom
