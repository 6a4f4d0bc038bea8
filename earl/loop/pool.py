"""Partial rollouts' pool: the groups that finished playing and wait for a training step.

With `RunConfig.partial_rollouts`, each group of a batch reports on its own as it finishes
(`Production.play_groups`); the schedule takes done groups for the next step, whatever batch
started them, so no step waits for one slow group. The pool keeps them with what the schedule
needs to choose and to drop: the oldest token's version (the staleness bound) and the row count
(what the trainer leases). It knows no actors.

Which done group goes first: the one whose oldest token is oldest (ties: the first done). When
the rollout outruns the trainer, done groups queue here; taken first-done-first, a long episode
that finished near the staleness bound would wait behind fresh short ones and go stale in the
queue, so the bound would drop the long tasks (and the trained episodes would be shorter than
the task's). Oldest first, the groups nearest the bound train first, and what the bound drops
is mostly what was over it when done.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from earl.stages.batch_types import BatchResult

__all__ = ["DoneGroup", "GroupPool", "straggler_wait"]


@dataclass(frozen=True, slots=True)
class DoneGroup:
    """One finished group: its `result` (its episodes' metadata, its rows in the dock as
    `samples`), and when it finished."""

    result: BatchResult
    done_at: float  # perf_counter seconds

    @property
    def group_id(self) -> str:
        return self.result.episodes[0].group_id

    @property
    def first_version(self) -> int:
        """The version of the group's oldest generated token (-1: it generated none)."""
        return min((e.first_version for e in self.result.episodes if e.first_version >= 0),
                   default=-1)

    @property
    def scored_alike(self) -> bool:
        """Every episode failed alike or scored the same reward: group-relative advantages
        are all zero."""
        return len({(e.failed, e.reward) for e in self.result.episodes}) == 1

    @property
    def last_version(self) -> int:
        """The version of the group's newest generated token (-1: it generated none)."""
        return max((e.last_version for e in self.result.episodes), default=-1)


class GroupPool:
    """Finished groups not yet trained, the oldest first (by their oldest token's version;
    a group that generated no token first of all, then the first done)."""

    def __init__(self) -> None:
        self._done: collections.deque[DoneGroup] = collections.deque()
        self._changed = asyncio.Event()

    def add(self, result: BatchResult) -> None:
        """A group finished (its rows are in the dock); `result` holds that group alone."""
        if result.episodes:
            self._done.append(DoneGroup(result, time.perf_counter()))
            self._changed.set()

    def size(self) -> int:
        return len(self._done)

    async def wait_take(self) -> DoneGroup:
        """The oldest group, once there is one."""
        await self.wait_added()
        oldest = min(range(len(self._done)), key=lambda i: self._done[i].first_version)
        g = self._done[oldest]
        del self._done[oldest]
        return g

    async def wait_added(self) -> None:
        """Until a group is waiting."""
        while not self._done:
            self._changed.clear()
            await self._changed.wait()

    def take_all(self) -> list[DoneGroup]:
        out, self._done = list(self._done), collections.deque()
        return out


def straggler_wait(res: BatchResult, began: float, waited_from: float) -> float:
    """A whole batch's step (`partial_rollouts` off): how long the trainer, waiting since
    `waited_from`, waited after the first of the batch's groups was done (each group's end
    estimated as the batch's start `began` plus its longest episode)."""
    now = time.perf_counter()
    ends: dict[str, float] = {}
    for e in res.episodes:
        end = began + float(e.info.get("episode_s", 0.0))
        ends[e.group_id] = max(ends.get(e.group_id, end), end)
    if not ends:
        return 0.0
    return max(now - max(min(ends.values()), waited_from), 0.0)
