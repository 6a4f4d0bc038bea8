"""Evaluation: greedy episodes of held-out tasks on the producers, scored by the recipe's
metric, run again when a producer died during it (once the supervisor healed it).

Not here: when it runs (`earl.loop.schedule`), `earl eval` (`earl.evaluate`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from earl.loop.supervisor import died_actor

if TYPE_CHECKING:
    from earl.loop.supervisor import Supervisor
    from earl.recipe import Recipe
    from earl.runtime import ActorGroup
    from earl.stages.batch_types import Episode
    from earl.stages.producer import ProducerActor

__all__ = ["ActorEvaluation"]


class ActorEvaluation:
    """Greedy evaluation of held-out tasks on the producers; the recipe's metric scores it.

    Args:
        supervisor: waits for a dead producer to be healed (None: a death fails the eval).
    """

    def __init__(self, producers: ActorGroup[ProducerActor], recipe: Recipe, *, size: int,
                 supervisor: Supervisor | None = None) -> None:
        self.producers, self.recipe, self.size = producers, recipe, size
        self.supervisor = supervisor

    async def evaluate(self, split: str, version: int) -> dict[str, float]:
        while True:
            try:
                return await self._evaluate(split, version)
            except Exception as exc:
                who = died_actor(exc)
                if self.supervisor is None or who is None or who[0] != "producer":
                    raise
                await self.supervisor.wait_healed(*who)

    async def _evaluate(self, split: str, version: int) -> dict[str, float]:
        samples = self.recipe.eval.samples(split, version, self.size)
        n = len(self.producers)
        idx = [list(range(r, len(samples), n)) for r in range(n)]
        parts = await asyncio.gather(*(
            self.producers[r].evaluate.call_one([samples[i] for i in idx[r]],
                                                f"eval-{split}-{version}-{r}")
            for r in range(n) if idx[r]))
        by_index: dict[int, Episode] = {}
        for r, eps in zip([r for r in range(n) if idx[r]], parts, strict=True):
            by_index.update(zip(idx[r], eps, strict=True))
        return self.recipe.metric([by_index[i] for i in range(len(samples))])
