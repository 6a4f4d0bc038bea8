"""A consumer's parallel layout (DP x TP x PP x CP) and its micro-batch rule, as pure data.

Rank order follows Megatron's default ``tp-cp-dp-pp``: TP varies fastest, then CP, then DP,
then PP. Every rank of one DP replica (its TP x CP x PP ranks) consumes the same samples; CP ranks
then keep their own zig-zag share of each sequence (`cp_shard`).

Micro-batch rules:
- `FixedCount(micro_batch_size)`: every DP rank gets the same number of samples, cut into
  micro-batches of that many samples; lengths are balanced across DP ranks.
- `TokenBudget(max_tokens)`: samples are packed into micro-batches of at most `max_tokens`
  tokens (sequence packing), token sums balanced across DP ranks, and every DP rank gets the
  same number of micro-batches (pipeline schedules and gradient all-reduce need lock-step);
  a DP rank with fewer samples than that count gets empty micro-batches.

Not here: where samples live or how they move (runtime/dispatch.py).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class RankCoord:
    dp: int
    tp: int
    pp: int
    cp: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Consumer parallelism. ``Layout(dp=2, tp=2)`` is 4 ranks in 2 DP replicas."""

    dp: int
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"layout.{name} must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def coord(self, rank: int) -> RankCoord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside layout of {self.world_size} ranks")
        tp, rest = rank % self.tp, rank // self.tp
        cp, rest = rest % self.cp, rest // self.cp
        dp, pp = rest % self.dp, rest // self.dp
        return RankCoord(dp=dp, tp=tp, pp=pp, cp=cp)

    def rank(self, c: RankCoord) -> int:
        return ((c.pp * self.dp + c.dp) * self.cp + c.cp) * self.tp + c.tp

    def replica(self, dp: int) -> list[int]:
        """All ranks of DP replica `dp` (they consume identical samples); first is the leader."""
        return sorted(
            self.rank(RankCoord(dp=dp, tp=t, pp=p, cp=c))
            for p in range(self.pp)
            for c in range(self.cp)
            for t in range(self.tp)
        )

    def leader(self, dp: int) -> int:
        """The rank that fetches replica `dp`'s data once and replicates it to the others."""
        return self.replica(dp)[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class FixedCount:
    micro_batch_size: int

    def __post_init__(self) -> None:
        if self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenBudget:
    max_tokens: int

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


MicroBatchRule = FixedCount | TokenBudget


def assign_micro_batches(
    lengths: Sequence[int], layout: Layout, rule: MicroBatchRule
) -> list[list[list[int]]]:
    """Split sample indices into ``[dp][micro_batch] -> indices``.

    Raises:
        ValueError: the batch does not divide across the layout under `rule`, or a sample is
            longer than the token budget.
    """
    n, dp = len(lengths), layout.dp
    if n < dp:
        raise ValueError(f"batch of {n} samples cannot feed layout.dp={dp}; take >= {dp} samples")
    if isinstance(rule, FixedCount):
        per_dp = rule.micro_batch_size * dp
        if n % per_dp:
            raise ValueError(
                f"batch of {n} samples does not divide into dp={dp} x micro_batch_size="
                f"{rule.micro_batch_size}; take a multiple of {per_dp} samples or change the rule"
            )
        shards = balance(lengths, dp, equal_counts=True)
        mbs = rule.micro_batch_size
        out = []
        for shard in shards:  # balance micro-batches too, so pipeline stages see even work
            k = len(shard) // mbs
            parts = balance([lengths[i] for i in shard], k, equal_counts=True)
            out.append([sorted(shard[j] for j in part) for part in parts])
        return out
    too_long = [i for i, n_tok in enumerate(lengths) if n_tok > rule.max_tokens]
    if too_long:
        raise ValueError(
            f"sample {too_long[0]} has {lengths[too_long[0]]} tokens > token budget "
            f"{rule.max_tokens}; raise rule.max_tokens or truncate"
        )
    shards = balance(lengths, dp, equal_counts=False)
    k = max(len(pack(lengths, s, rule.max_tokens)) for s in shards)
    while True:  # same micro-batch count on every DP rank, each within budget
        out = []
        for shard in shards:
            parts = balance([lengths[i] for i in shard], k, equal_counts=False)
            out.append([sorted(shard[j] for j in part) for part in parts])
        if all(sum(lengths[i] for i in mb) <= rule.max_tokens for sh in out for mb in sh):
            return out
        k += 1


def balance(lengths: Sequence[int], k: int, *, equal_counts: bool) -> list[list[int]]:
    """Partition indices into `k` parts with near-equal token sums (greedy LPT).

    With ``equal_counts`` every part gets exactly ``len(lengths) // k`` items (requires
    divisibility). Returns parts as lists of indices into `lengths`.
    """
    n = len(lengths)
    cap = n // k if equal_counts else n
    if equal_counts and n % k:
        raise ValueError(f"{n} items do not split into {k} equal parts")
    order = sorted(range(n), key=lambda i: -lengths[i])
    heap = [(0, j) for j in range(k)]
    parts: list[list[int]] = [[] for _ in range(k)]
    for i in order:
        load, j = heapq.heappop(heap)
        parts[j].append(i)
        if len(parts[j]) < cap:
            heapq.heappush(heap, (load + lengths[i], j))
    return parts


def pack(lengths: Sequence[int], idx: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit-decreasing packing of `idx` into bins of at most `max_tokens` tokens."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(idx, key=lambda i: -lengths[i]):
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return bins


def cp_shard(x: np.ndarray, cp_rank: int, cp: int) -> np.ndarray:
    """Context-parallel zig-zag share of a sequence: chunks r and 2*cp-1-r of 2*cp chunks.

    Balances causal-attention work across CP ranks (Megatron's load-balanced CP split).
    """
    if len(x) % (2 * cp):
        raise ValueError(f"sequence length {len(x)} must be padded to a multiple of 2*cp={2 * cp}")
    chunks = np.split(x, 2 * cp)
    return np.concatenate([chunks[cp_rank], chunks[2 * cp - 1 - cp_rank]])
