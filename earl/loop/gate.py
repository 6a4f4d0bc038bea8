"""The staleness gate: batch `b` may start once the policy version is >= b - max_policy_lag.

`max_policy_lag = 0` is the synchronous baseline (batch b is produced by policy b only); with a
lag of k, rollout runs up to k batches ahead of training, so every token is at most k versions
stale when trained on (plus the batch in flight). With partial rollouts (`GroupGate`) steps no
longer follow batches, so the gate counts groups out instead. The gates know nothing about
actors.
"""

from __future__ import annotations

import asyncio

__all__ = ["GroupGate", "StalenessGate"]


class StalenessGate:
    """Tracks the policy version and lets producers wait for their batch's turn."""

    def __init__(self, max_policy_lag: int, version: int = 0) -> None:  # lag >= 0: RunConfig
        self.max_policy_lag = max_policy_lag
        self.version = version
        self._changed = asyncio.Condition()
        self._closed = False

    def may_start(self, batch: int) -> bool:
        """Whether batch `batch` may be produced with the current policy version."""
        return self._closed or self.version >= batch - self.max_policy_lag

    async def wait_may_start(self, batch: int) -> bool:
        """Wait until `batch` may start; returns False when the gate was closed instead."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.may_start(batch))
        return not self._closed

    async def advance(self, version: int) -> None:
        """The trainer published `version` (versions only grow)."""
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        async with self._changed:
            self.version = version
            self._changed.notify_all()

    async def close(self) -> None:
        """Release every waiter (the run is stopping)."""
        async with self._changed:
            self._closed = True
            self._changed.notify_all()


class GroupGate:
    """Partial rollouts' gate: a batch of groups may start while fewer than `limit` groups are
    out (started, and neither trained nor dropped). A group dropped as stale frees its place
    as a trained one does, so drops never shrink the rollout's concurrency; the staleness bound
    itself is the schedule's drop rule."""

    def __init__(self, limit: int) -> None:
        self.limit, self.out = limit, 0
        self._changed = asyncio.Condition()
        self._closed = False

    async def wait_may_start(self, groups: int) -> bool:
        """Wait until `groups` more may start, and count them out; False once closed."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._closed or self.out + groups <= max(self.limit, groups))
            if self._closed:
                return False
            self.out += groups
            return True

    async def done(self, groups: int) -> None:
        """`groups` were trained or dropped."""
        async with self._changed:
            self.out -= groups
            self._changed.notify_all()

    async def close(self) -> None:
        async with self._changed:
            self._closed = True
            self._changed.notify_all()
