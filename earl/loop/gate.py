"""The staleness gate: batch `b` may start once the policy version is >= b - max_policy_lag.

`max_policy_lag = 0` is the synchronous baseline (batch b is produced by policy b only); with a
lag of k, rollout runs up to k batches ahead of training, so every token is at most k versions
stale when trained on (plus the batch in flight). The gate knows nothing about actors.
"""

from __future__ import annotations

import asyncio

__all__ = ["StalenessGate"]


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
