"""`TrainBatch`: the trainer's input — dock columns of N samples, concatenated into flat tensors.

One optimizer step consumes one `TrainBatch` (per data-parallel rank). Every per-token column is
``[T]`` with ``T = sum(lengths)``; sample ``i`` owns ``[cu[i], cu[i+1])``. This is the dock's
layout ("input_ids", "loss_mask", "advantages", "rollout_logprobs", "ref_logprobs", "versions"),
so building it is a concatenation, and it crosses the wire as a typed message of a few big
buffers. It is not a micro-batch: the trainer cuts it by token budget (`earl.packing`).

Example:
    >>> b = TrainBatch.from_samples([
    ...     {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "advantages": [0.0, 1.0, 1.0]},
    ...     {"input_ids": [5, 8], "loss_mask": [0, 1], "advantages": [0.0, -1.0]},
    ... ])
    >>> b.num_samples, b.num_tokens
    (2, 5)
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from earl.algorithms.aggregation import aggregation_denominator
from earl.algorithms.loss_config import AggMode
from earl.packing import Packed, pack
from earl.runtime.wire import message

__all__ = ["MicroBatch", "TrainBatch", "bound_staleness"]

_OPTIONAL = ("rollout_logprobs", "ref_logprobs", "old_logprobs")
_DTYPES = {
    "input_ids": torch.int64, "loss_mask": torch.float32, "advantages": torch.float32,
    "rollout_logprobs": torch.float32, "ref_logprobs": torch.float32,
    "old_logprobs": torch.float32,
}
ColumnValue = Tensor | np.ndarray | Sequence[float] | Sequence[int]


def bound_staleness(samples: Sequence[Mapping[str, ColumnValue]], floor: int
                    ) -> tuple[list[dict[str, ColumnValue]], int, int]:
    """The samples with every loss token sampled before policy version `floor` masked out (kept
    as context: the staleness bound of a partial rollout's episode that spanned many updates),
    the loss tokens masked, and the oldest version left in the loss (-1: none left).

    Each sample needs its ``versions`` column (the version that sampled each token)."""
    out: list[dict[str, ColumnValue]] = []
    masked, oldest = 0, -1
    for s in samples:
        if "versions" not in s:
            raise ValueError("bound_staleness needs each sample's 'versions' column; fetch it")
        mask = np.asarray(s["loss_mask"]).reshape(-1) != 0
        versions = np.asarray(s["versions"]).reshape(-1)
        kept = mask & (versions >= floor)
        masked += int(mask.sum() - kept.sum())
        if kept.any():
            low = int(versions[kept].min())
            oldest = low if oldest < 0 else min(oldest, low)
        out.append({**s, "loss_mask": kept.astype(np.float32)})
    return out, masked, oldest


@message
@dataclass(kw_only=True, slots=True)
class TrainBatch:
    """N samples' columns, flat.

    Attributes:
        input_ids: ``[T]`` int64 tokens.
        loss_mask: ``[T]`` 1 on tokens to train on (generated tokens), else 0.
        advantages: ``[T]`` per-token advantages (0 where the mask is 0 is fine).
        lengths: ``[N]`` int64 tokens per sample.
        rollout_logprobs: ``[T]`` sampling (behaviour) log-probs, or None.
        ref_logprobs: ``[T]`` reference log-probs, or None.
        old_logprobs: ``[T]`` proximal log-probs recomputed by the trainer, or None.
    """

    input_ids: Tensor
    loss_mask: Tensor
    advantages: Tensor
    lengths: Tensor
    rollout_logprobs: Tensor | None = None
    ref_logprobs: Tensor | None = None
    old_logprobs: Tensor | None = None

    def __post_init__(self) -> None:
        self.lengths = torch.as_tensor(self.lengths, dtype=torch.int64)
        for name, dtype in _DTYPES.items():
            value = getattr(self, name)
            if value is None:
                continue
            value = torch.as_tensor(value).to(dtype)
            if value.dim() != 1:
                raise ValueError(f"TrainBatch.{name} must be 1-D [T], got {tuple(value.shape)}")
            setattr(self, name, value)
        total = int(self.lengths.sum())
        if self.lengths.numel() == 0 or bool((self.lengths <= 0).any()):
            raise ValueError("TrainBatch.lengths must hold at least one sample, each length > 0")
        for name in _DTYPES:
            value = getattr(self, name)
            if value is not None and value.numel() != total:
                raise ValueError(
                    f"TrainBatch.{name} has {value.numel()} entries; the lengths sum to {total}"
                )

    @classmethod
    def from_samples(cls, samples: Sequence[Mapping[str, ColumnValue]]) -> TrainBatch:
        """Concatenate per-sample columns (dock column names; optional ones all or none)."""
        if not samples:
            raise ValueError("TrainBatch.from_samples needs at least one sample")
        cols: dict[str, Tensor | None] = {}
        for name, dtype in _DTYPES.items():
            have = [name in s for s in samples]
            if name not in _OPTIONAL and not all(have):
                bad = next(s for s in samples if name not in s)
                raise ValueError(f"every sample needs the column {name!r}; {have.count(False)} "
                                 f"of {len(samples)} have only {sorted(bad)}")
            if any(have) and not all(have):
                raise ValueError(f"column {name!r} is in some samples but not all")
            cols[name] = (
                torch.cat([_tensor(s[name]).to(dtype).reshape(-1) for s in samples])
                if all(have) else None
            )
        lengths = torch.tensor([len(np.asarray(s["input_ids"]).reshape(-1)) for s in samples])
        return cls(lengths=lengths, **cols)  # type: ignore[arg-type]

    @property
    def num_samples(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def cu_seqlens(self) -> Tensor:
        cu = torch.zeros(self.num_samples + 1, dtype=torch.int64)
        cu[1:] = torch.cumsum(self.lengths, 0)
        return cu

    def select(self, indices: Sequence[int]) -> MicroBatch:
        """The samples ``indices`` packed into one row, with their columns."""
        cu = self.cu_seqlens.tolist()
        spans = [(cu[i], cu[i + 1]) for i in indices]

        def take(t: Tensor | None) -> Tensor | None:
            return None if t is None else torch.cat([t[s:e] for s, e in spans])

        packed = pack([self.input_ids[s:e] for s, e in spans])
        return MicroBatch(
            packed=packed,
            loss_mask=take(self.loss_mask),  # type: ignore[arg-type]
            advantages=take(self.advantages),  # type: ignore[arg-type]
            rollout_logprobs=take(self.rollout_logprobs),
            ref_logprobs=take(self.ref_logprobs),
            old_logprobs=take(self.old_logprobs),
        )

    def split(self, parts: int) -> list[TrainBatch]:
        """Cut into ``parts`` batches of consecutive samples (sizes differ by at most one)."""
        if not 0 < parts <= self.num_samples:
            raise ValueError(f"cannot split {self.num_samples} samples into {parts} parts")
        bounds = np.linspace(0, self.num_samples, parts + 1).round().astype(int)
        cu = self.cu_seqlens.tolist()
        out = []
        for a, b in itertools.pairwise(bounds):
            s, e = cu[a], cu[b]

            def cut(t: Tensor | None, s: int = s, e: int = e) -> Tensor | None:
                return None if t is None else t[s:e]

            out.append(TrainBatch(
                input_ids=self.input_ids[s:e], loss_mask=self.loss_mask[s:e],
                advantages=self.advantages[s:e], lengths=self.lengths[a:b],
                rollout_logprobs=cut(self.rollout_logprobs), ref_logprobs=cut(self.ref_logprobs),
                old_logprobs=cut(self.old_logprobs),
            ))
        return out


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """One packed forward's worth of samples (see `TrainBatch.select`)."""

    packed: Packed
    loss_mask: Tensor
    advantages: Tensor
    rollout_logprobs: Tensor | None
    ref_logprobs: Tensor | None
    old_logprobs: Tensor | None


def _tensor(x: ColumnValue) -> Tensor:
    """A tensor viewing `x`; read-only arrays (views of received frames) are fine here because
    `from_samples` concatenates, i.e. copies, before anything could write."""
    a = np.asarray(x)
    if a.flags.writeable:
        return torch.as_tensor(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(a)


def step_totals(batch: TrainBatch, plan: Sequence[MicroBatch | None], agg: AggMode,
                dp_group: object = None) -> Tensor:
    """A step's totals over the data-parallel ranks (float64): the loss's global denominator
    (`aggregation_denominator` of every micro-batch in `plan`), tokens, trained tokens,
    samples. Every DP rank must call it (an all-reduce over `dp_group`)."""
    from earl.stages import trainer_dist as tdist

    local = torch.zeros(4, dtype=torch.float64)
    for sub in plan:
        if sub is not None:
            local[0] += aggregation_denominator(sub.loss_mask, agg, sub.packed.seq_ids)
    local[1] = batch.num_tokens
    local[2] = float(batch.loss_mask.sum())
    local[3] = batch.num_samples
    return tdist.all_reduce(local.clone(), group=dp_group)  # type: ignore[arg-type]
