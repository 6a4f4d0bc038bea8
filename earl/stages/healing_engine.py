"""`HealingEngine`: a producer's rollout client that rides out a rollout replica's restart.

It wraps the producer's `RolloutClient` (`earl.stages.rollout`): a generation is retried when
its replica died, and refused (then retried) when a restarted replica still serves older
weights than the producer was told. It lives with the producer (`earl.stages.producer`), which
is its only user; the driver's side of healing (re-playing lost groups, retrying a step or a
weight push) is `earl.loop.healing_parts`.

Not here: restarting the replica (its supervisor) or pushing it the current weights (the loop).
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from earl.runtime.errors import ActorDied

if TYPE_CHECKING:
    from earl.runtime.types import Generation, SamplingParams

__all__ = ["HealingEngine"]


class HealingEngine:
    """Wraps a producer's `RolloutClient`: a generation is retried when its replica died, and
    refused when a restarted replica serves older weights than the producer was told."""

    def __init__(self, client: Any, *, wait_s: float = 300.0) -> None:
        self._client, self._wait_s = client, wait_s
        self.retries = 0
        self._pinned: int | None = None

    def pin(self, version: int) -> None:
        """Accept tokens from `version` on (the rollout was set back to it on purpose)."""
        self._pinned = version

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        deadline = time.monotonic() + self._wait_s
        delay = 0.05
        while True:
            floor = self._client.policy_version if self._pinned is None else self._pinned
            try:
                gen: Generation = await self._client.generate(prompt_ids, params,
                                                              session_id=session_id)
                if not gen.versions or min(gen.versions) >= floor:
                    return gen
            except ActorDied:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise ActorDied("rollout", f"no replica served version {floor} within "
                                           f"{self._wait_s:g} s", cause="unavailable",
                                call="generate")
            self.retries += 1
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)
