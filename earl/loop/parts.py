"""The schedule's parts over actor groups: production by producer actors, training by the
trainer ranks, evaluation by the producers with greedy decoding.

Each class implements one protocol of `earl.loop.schedule` and does one thing; the driver
only moves metadata through them (task samples out, `Episode` records and metrics back).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence

from earl.loop.actors import Actors
from earl.observe import Tracer
from earl.recipe import Metric, Recipe, TaskSource
from earl.runtime import ActorGroup
from earl.stages.batch_types import BatchResult, Episode, GroupTask
from earl.stages.producer import ProducerActor
from earl.stages.weights import PushTransport

__all__ = ["ActorEvaluation", "ActorProduction", "ActorTraining"]


class ActorProduction:
    """Deals a batch's groups to the producer actors (round robin) and merges their results.

    A batch plays `groups_per_batch + over_sample` groups and trains the first
    `groups_per_batch` to finish (each producer keeps its share of them; see
    `RunConfig.over_sample_groups`). Group `g` of batch `b` has cursor `b * stride + g`
    (`stride` = the groups played per batch); its members play task `cursor` (shared) or
    `cursor * group_size + i` (one task each), so a resumed run replays exactly the tasks of
    the batches it had not trained."""

    def __init__(self, producers: ActorGroup[ProducerActor], tasks: TaskSource, *,
                 groups_per_batch: int, group_size: int, shared: bool, over_sample: int = 0,
                 tracer: Tracer | None = None) -> None:
        self.producers, self.tasks = producers, tasks
        self.groups_per_batch, self.group_size, self.shared = groups_per_batch, group_size, shared
        self.over_sample = over_sample
        self.tracer = tracer or Tracer(False)

    @property
    def stride(self) -> int:
        """Groups played per batch (and task cursors it uses)."""
        return self.groups_per_batch + self.over_sample

    def groups(self, batch: int) -> list[GroupTask]:
        out = []
        for g in range(self.stride):
            cursor = batch * self.stride + g
            if self.shared:
                samples = [self.tasks.sample(cursor)] * self.group_size
            else:
                samples = [self.tasks.sample(cursor * self.group_size + i)
                           for i in range(self.group_size)]
            out.append(GroupTask(group_id=f"g{cursor}", samples=samples))
        return out

    def deal(self, batch: int) -> list[tuple[int, list[GroupTask], int | None]]:
        """(producer rank, its share of the batch's groups, how many of them it keeps: None =
        all) for every producer that keeps at least one group."""
        groups, n = self.groups(batch), len(self.producers)
        out: list[tuple[int, list[GroupTask], int | None]] = []
        for r in range(n):
            share = groups[r::n]
            keep = len(range(r, self.groups_per_batch, n))
            if keep:
                out.append((r, share, None if keep == len(share) else keep))
        return out

    @staticmethod
    def merge(batch: int, results: Sequence[BatchResult]) -> BatchResult:
        return BatchResult(batch=batch, episodes=[e for r in results for e in r.episodes],
                           samples=sum(r.samples for r in results),
                           seconds=max(r.seconds for r in results),
                           cut=[g for r in results for g in r.cut],
                           row_groups=[g for r in results for g in r.row_groups])

    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        with self.tracer.span("play", actor="producer", step=batch + 1):
            results = await asyncio.gather(*(
                self.producers[r].play.call_one(batch, share, snapshot, need)
                for r, share, need in self.deal(batch)))
        return self.merge(batch, results)

    async def play_groups(self, batch: int, done: Callable[[BatchResult], None], *,
                          play: Callable[[int, int, GroupTask], Awaitable[BatchResult]]
                          | None = None) -> BatchResult:
        """Partial rollouts: play batch `batch`'s groups, each on its own (group g on producer
        g mod n), each in the dock as soon as it is done; `done` gets each group's result as it
        comes. `play(batch, g, task)` plays one group (default: one call to its producer).
        Returns them all merged."""
        play = play or self.play_group

        async def one(g: int, task: GroupTask) -> BatchResult:
            res = await play(batch, g, task)
            done(res)
            return res

        with self.tracer.span("play", actor="producer", step=batch + 1):
            results = await asyncio.gather(*(one(g, t) for g, t in
                                             enumerate(self.groups(batch))))
        return self.merge(batch, results)

    async def play_group(self, batch: int, g: int, task: GroupTask, tag: str = ""
                         ) -> BatchResult:
        """Group `g` of batch `batch` on its producer (`tag`: a re-play after a fault)."""
        return await self.producers[g % len(self.producers)].play_group.call_one(
            batch, task, g, tag)

    async def note_version(self, version: int) -> None:
        await self.producers.note_version.call(version)

    async def pin_version(self, version: int) -> None:
        """The rollout now serves `version` on purpose (an earlier step's weights)."""
        await self.producers.pin_version.call(version)

    async def states(self, batch: int | None) -> list[dict[str, object]]:
        return list(await self.producers.state_dict.call(batch))

    async def load_states(self, states: Sequence[dict[str, object]]) -> None:
        await asyncio.gather(*(self.producers[r].load_state_dict.call_one(s)
                               for r, s in enumerate(states) if r < len(self.producers)))


class ActorTraining:
    """One optimizer step per batch on the dock's samples, then the weight push.

    The driver leases the batch (metadata), the dispatcher plans it for the trainer's layout
    (`earl.stages.trainer_feed`), and each DP replica's leader fetches its slice straight
    from the producers' and the reference's shards. The groups are read from `actors` at each
    call (the selector may have re-created them). `flows` holds the bytes each transport
    carried in the last step (``transport/experience_bytes/<kind>``: warehouses -> trainer
    leaders; ``transport/weights_bytes/<kind>``: trainer -> rollout replicas)."""

    def __init__(self, actors: Actors, columns: list[str], tracer: Tracer | None = None, *,
                 weights_transport: PushTransport = "auto") -> None:
        self.actors, self.columns = actors, columns
        self.weights_transport = weights_transport  # placement.weights_transport
        self.tracer = tracer or Tracer(False)
        self.seconds = {"train_s": 0.0, "sync_s": 0.0}  # of the last step, for the metrics
        self.flows: dict[str, float] = {}

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: Sequence[str] | None = None) -> dict[str, float]:
        from earl.stages.trainer_feed import train_from_dock

        t0 = time.perf_counter()
        a = self.actors
        with self.tracer.span("train_step", actor="trainer", step=batch + 1):
            metrics = await train_from_dock(a.trainer, a.dock, samples, self.columns,
                                            lr_scale=lr_scale,
                                            micro_batch_tokens=a.micro_batch_tokens,
                                            group_ids=groups)
        self.seconds["train_s"] = time.perf_counter() - t0
        self.flows = {k: v for k, v in metrics.items() if k.startswith("transport/")}
        return {k: v for k, v in metrics.items() if not k.startswith("transport/")}

    async def discard(self, groups: Sequence[str], reason: str) -> int:
        """Drop `groups` from the dock untrained, for `reason`; returns the rows dropped."""
        from earl.stages.trainer_feed import discard_from_dock

        return await discard_from_dock(self.actors.dock, groups, reason)

    async def publish(self, version: int) -> None:
        t0 = time.perf_counter()
        with self.tracer.span("push_weights", actor="trainer", version=version):
            synced = await self.actors.trainer.push_weights.call(
                self.actors.rollout, version, self.weights_transport)
        self.seconds["sync_s"] = time.perf_counter() - t0
        self.flows.update({k: v for k, v in synced[0].items() if k.startswith("transport/")})


class ActorEvaluation:
    """Greedy evaluation of held-out tasks on the producers; the recipe's metric scores it."""

    def __init__(self, producers: ActorGroup[ProducerActor], recipe: Recipe, *, size: int,
                 items: Sequence[object] = (), metric: Metric | None = None) -> None:
        self.producers, self.recipe, self.size = producers, recipe, size
        self.items = list(items)
        self.metric = metric or recipe.metric
        self.last: list[Episode] = []

    def samples(self, split: str, version: int) -> list[object]:
        if self.items:
            return self.items
        return self.recipe.eval.samples(split, version, self.size)

    async def evaluate(self, split: str, version: int) -> dict[str, float]:
        samples = self.samples(split, version)
        n = len(self.producers)
        idx = [list(range(r, len(samples), n)) for r in range(n)]
        parts = await asyncio.gather(*(
            self.producers[r].evaluate.call_one([samples[i] for i in idx[r]],
                                                f"eval-{split}-{version}-{r}")
            for r in range(n) if idx[r]))
        by_index: dict[int, Episode] = {}
        for r, eps in zip([r for r in range(n) if idx[r]], parts, strict=True):
            by_index.update(zip(idx[r], eps, strict=True))
        self.last = [by_index[i] for i in range(len(samples))]
        return self.metric(self.last)
