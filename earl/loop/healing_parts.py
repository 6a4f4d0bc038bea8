"""The loop's parts, made to survive the death of the actors they call.

Each wrapper implements the same protocol as the part it wraps (`earl.loop.schedule`) and
retries what a restart makes safe to retry, after the `Healer` has rebuilt the restarted
process:

- `HealingProduction`: a producer that dies while playing a batch has its share re-played
  (`ProducerActor.replay`, fresh sample ids); groups the dock reports lost (`take_lost`: a dead
  producer's shard) are played again.
- `HealingTraining`: a step whose fetch hit a dead shard is taken again once the lost groups are
  re-played; a weight push that hit a dead rollout replica is pushed again. A `LedgerDock`
  records which samples each acked lease trained.
- `HealingEvaluation`: an evaluation interrupted by a producer's death is run again.
- `SafeCheckpoints`: a checkpoint that fails (a full disk) is reported and skipped; the previous
  manifest stays in force.

Not here: watching restarts and rewinds (`earl.loop.healing`); the producers' side, a
generation retried when its rollout replica died (`earl.stages.healing_engine`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.loop.healing import Healer, died_actor
from earl.runtime import ActorGroup
from earl.runtime.dock import Dock
from earl.runtime.dock_index import LostSample
from earl.runtime.errors import ActorDied, ActorError
from earl.stages.batch_types import BatchResult, GroupTask, sample_id

if TYPE_CHECKING:
    from earl.loop.checkpoint import CheckpointStore
    from earl.loop.parts import ActorEvaluation, ActorProduction, ActorTraining
    from earl.loop.schedule import LoopState
    from earl.runtime.dock_index import Lease

__all__ = ["HealingEvaluation", "HealingParts", "HealingProduction", "HealingTraining",
           "LedgerDock", "SafeCheckpoints", "heal"]


class LedgerDock(Dock):
    """A `Dock` client that records each acked lease's samples in the healer's ledger."""

    def __init__(self, index: ActorGroup[Any], healer: Healer) -> None:
        super().__init__(index)
        self.healer = healer

    async def ack(self, lease: Lease) -> None:
        await super().ack(lease)
        self.healer.ledger.add_acked(lease.samples)

    async def drop(self, lease: Lease, reason: str) -> None:
        await super().ack(lease)
        self.healer.ledger.add_dropped(
            [LostSample(loc.sample_id, loc.group_id, ()) for loc in lease.samples], reason)


class HealingProduction:
    """`ActorProduction` that re-plays what a producer's death lost."""

    def __init__(self, inner: ActorProduction, healer: Healer, rt: Any, dock: Dock) -> None:
        self.inner, self.healer, self.rt, self.dock = inner, healer, rt, dock
        # the plays of producers' shares still playing ("b<batch>-p<rank>[-<tag>]", their
        # rows' ids less the row): `_share` plays their lost groups again, not `reproduce_lost`
        self.playing: set[str] = set()
        self._tags = itertools.count(1)
        self._pending: dict[str, tuple[int, GroupTask]] = {}  # group id -> (batch, task)

    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        with self.inner.tracer.span("play", actor="producer", step=batch + 1):
            results = await asyncio.gather(*(self._share(r, batch, share, snapshot, need)
                                             for r, share, need in self.inner.deal(batch)))
        return self.inner.merge(batch, results)

    async def _share(self, r: int, batch: int, share: list[GroupTask], snapshot: bool,
                     need: int | None) -> BatchResult:
        """Producer `r`'s share of `batch`, played again whole if it dies playing it (the
        groups of a share still playing are not re-played by `reproduce_lost`)."""
        tag, plays = "", set()
        try:
            while True:
                plays.add(sample_id(batch, 0, tag, r).rsplit("-", 1)[0])
                self.playing |= plays
                producer = self.inner.producers[r]
                try:
                    if not tag:
                        res = await producer.play.call_one(batch, share, snapshot, need)
                    else:
                        res = await producer.replay.call_one(batch, share, tag, snapshot, need)
                except Exception as exc:
                    who = died_actor(exc)
                    if who != ("producer", r) or self.healer.stopping:
                        raise
                    self.healer.note("replay_share", "producer", rank=r, step=batch + 1)
                    await self.healer.wait_rebuilt(self.rt, "producer", r)
                    tag = f"x{next(self._tags)}"
                    continue
                self._record(batch, res, tag, r)
                return res
        finally:
            self.playing -= plays

    async def play_groups(self, batch: int, done: Callable[[BatchResult], None]
                          ) -> BatchResult:
        """`ActorProduction.play_groups`, each group played again (tagged) when its producer
        died while playing it. Only the groups still playing are in `playing`: a group is in
        the dock as soon as it is done, so one lost with a shard is re-played by
        `reproduce_lost` while the rest of its batch plays on."""
        return await self.inner.play_groups(batch, done, play=self._play_group)

    async def _play_group(self, batch: int, g: int, task: GroupTask) -> BatchResult:
        """Group `g`, played again if its producer dies playing it (its rows put before the
        death are not re-played by `reproduce_lost` as well)."""
        r, tag, plays = g % len(self.inner.producers), "", set()
        try:
            while True:
                ids = f"{tag}-g{g}" if tag else f"g{g}"
                plays.add(sample_id(batch, 0, ids, r).rsplit("-", 1)[0])
                self.playing |= plays
                try:
                    res = await self.inner.play_group(batch, g, task, tag)
                except Exception as exc:
                    if died_actor(exc) != ("producer", r) or self.healer.stopping:
                        raise
                    self.healer.note("replay_group", "producer", rank=r, step=batch + 1)
                    await self.healer.wait_rebuilt(self.rt, "producer", r)
                    tag = f"x{next(self._tags)}"
                    continue
                self._record(batch, res, ids, r)
                return res
        finally:
            self.playing -= plays

    def _record(self, batch: int, res: BatchResult, tag: str, rank: int) -> None:
        """The rows `res` put, in the ledger (their ids as the producer made them)."""
        self.healer.ledger.add_produced([sample_id(batch, j, tag, rank)
                                         for j in range(res.samples)], res.row_groups)

    async def states(self, batch: int | None) -> list[dict[str, object]]:
        """Each producer's critic after `batch`; a restarted producer (which lost that
        snapshot) gives its current one."""
        out = []
        for r in range(len(self.inner.producers)):
            p = self.inner.producers[r]
            try:
                out.append(await p.state_dict.call_one(batch))
            except ActorError as exc:
                if not exc.remote_type.endswith("KeyError"):
                    raise
                out.append(await p.state_dict.call_one(None))
        return out

    async def pin_version(self, version: int) -> None:
        await self.inner.pin_version(version)

    async def load_states(self, states: list[dict[str, object]]) -> None:
        await self.inner.load_states(states)

    async def note_version(self, version: int) -> None:
        for r in range(len(self.inner.producers)):
            try:
                await self.inner.producers[r].note_version.call_one(version)
            except ActorDied:  # a restarted producer gets the version in its rebuild
                continue

    async def rebuild(self, rank: int, state: dict[str, object] | None) -> None:
        """A restarted producer: version, critic, its shard's lost groups played again."""
        p, key = self.inner.producers[rank], f"producer[{rank}]"
        self.healer.stage[key] = "note_version"
        await p.note_version.call_one(self.healer.version)
        if state is not None:
            self.healer.stage[key] = "load_state_dict"
            await p.load_state_dict.call_one(state)
        self.healer.stage[key] = "drop_shard"
        await self.dock.index.drop_shard.call(f"producer:{rank}")
        self.healer.stage[key] = "reproduce_lost"
        await self.reproduce_lost(f"shard producer:{rank} died")
        self.healer.stage.pop(key, None)

    async def reproduce_lost(self, reason: str) -> int:
        """Play again every group the dock reports lost (except those of a producer's share
        still playing: `_share` plays it again whole); returns the groups re-played.

        Each call plays the groups it took from the dock and holds no lock while they play:
        a re-play waits for room in the dock, which only the trainer (and so the reference)
        makes, so the reference's rebuild must never wait behind it. A group whose re-play
        failed is played by the next call (the next rebuild or retried step)."""
        lost = await self.dock.take_lost()
        self.healer.ledger.add_dropped(lost, f"{reason} (group re-played)")
        stride, n = self.inner.stride, len(self.inner.producers)
        shares = {x.group_id for x in lost if x.sample_id.rsplit("-", 1)[0] in self.playing}
        for gid in sorted({x.group_id for x in lost} - shares):
            cursor = int(gid[1:])
            batch = cursor // stride
            self._pending[gid] = (batch, self.inner.groups(batch)[cursor % stride])
        mine, self._pending = self._pending, {}
        played = 0

        async def one(gid: str, batch: int, task: GroupTask) -> None:
            nonlocal played
            r, tag = hash(gid) % n, f"x{next(self._tags)}"
            self.healer.stage[f"producer[{r}]"] = f"replay of group {gid} (batch {batch})"
            try:
                res = await self.inner.producers[r].replay.call_one(batch, [task], tag, False)
            except (ActorDied, ActorError) as exc:
                self.healer.log(f"healing: re-playing group {gid} failed ({exc}); later")
                self._pending[gid] = (batch, task)
                return
            self._record(batch, res, tag, r)
            played += 1

        async with asyncio.TaskGroup() as tg:
            for gid, (batch, task) in mine.items():
                tg.create_task(one(gid, batch, task))
        if played:
            self.healer.note("replay_groups", "producer", groups=played)
        return played


class HealingTraining:
    """`ActorTraining` whose step and weight push survive a shard's or a replica's death."""

    def __init__(self, inner: ActorTraining, healer: Healer, rt: Any,
                 production: HealingProduction) -> None:
        self.inner, self.healer, self.rt, self.production = inner, healer, rt, production
        self.actors = inner.actors
        self._push = asyncio.Lock()

    @property
    def seconds(self) -> dict[str, float]:
        return self.inner.seconds

    @property
    def flows(self) -> dict[str, float]:
        return self.inner.flows

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: Sequence[str] | None = None) -> dict[str, float]:
        while True:
            try:
                return await self.inner.train(batch, samples, lr_scale, groups)
            except Exception as exc:
                who = died_actor(exc)
                if who is None or who[0] not in ("producer", "reference") \
                        or self.healer.stopping:
                    raise
                self.healer.note("retry_step", who[0], rank=who[1], step=batch + 1)
                await self.healer.wait_rebuilt(self.rt, *who)
                await self.production.reproduce_lost(f"shard {who[0]}:{who[1]} died in a fetch")

    async def discard(self, groups: Sequence[str], reason: str) -> int:
        return await self.inner.discard(groups, reason)

    async def publish(self, version: int) -> None:
        while True:
            try:
                async with self._push:
                    await self.inner.publish(version)
                    self.healer.version = version
                return
            except Exception as exc:
                who = died_actor(exc)
                if who is None or who[0] != "rollout":
                    raise
                await self.healer.wait_rebuilt(self.rt, *who)

    async def repush(self, rank: int) -> None:
        """A restarted rollout replica: push the current weights at the current version."""
        await self.actors.use_rollout(await self.rt.lookup("rollout"))
        async with self._push:
            await self.inner.publish(self.healer.version)


class HealingEvaluation:
    """`ActorEvaluation` run again when a producer died during it."""

    def __init__(self, inner: ActorEvaluation, healer: Healer, rt: Any) -> None:
        self.inner, self.healer, self.rt = inner, healer, rt

    async def evaluate(self, split: str, version: int) -> dict[str, float]:
        while True:
            try:
                return await self.inner.evaluate(split, version)
            except Exception as exc:
                who = died_actor(exc)
                if who is None or who[0] != "producer":
                    raise
                await self.healer.wait_rebuilt(self.rt, *who)


class SafeCheckpoints:
    """A checkpoint store whose failed saves (e.g. ENOSPC) leave the previous one in force."""

    def __init__(self, inner: CheckpointStore, healer: Healer) -> None:
        self.inner, self.healer = inner, healer
        self.failed: list[tuple[int, str]] = []

    def load(self) -> tuple[LoopState, str, list[dict[str, object]]]:
        return self.inner.load()

    async def save(self, state: LoopState, critic_batch: int | None) -> None:
        try:
            await self.inner.save(state, critic_batch)
        except (OSError, ActorError, ActorDied) as exc:
            who = died_actor(exc)
            if who is not None and who[0] != "producer":
                raise  # the trainer's or the dock's death rewinds the run
            why = str(exc).splitlines()[0][:300]
            self.failed.append((state.step, why))  # the store removed what it had staged
            self.healer.note("checkpoint_failed", "driver", step=state.step, error=why)
            self.healer.log(f"healing: checkpoint at step {state.step} failed ({why}); the "
                            "previous checkpoint stays in force, the run goes on")


def last_producer_state(out: Path, rank: int) -> dict[str, object] | None:
    """Producer `rank`'s critic state in the checkpoint in force (None: no checkpoint yet)."""
    import json

    from earl.loop.checkpoint import MANIFEST

    manifest = out / "checkpoint" / MANIFEST
    if not manifest.is_file():
        return None
    folder = out / "checkpoint" / json.loads(manifest.read_text())["folder"]
    states = json.loads((folder / "producers.json").read_text())["states"]
    return states[rank] if rank < len(states) else None


@dataclass(frozen=True, slots=True)
class HealingParts:
    """The loop's parts of one run attempt, each made to survive its actors' deaths."""

    production: HealingProduction
    training: HealingTraining
    evaluation: HealingEvaluation | None


def heal(production: ActorProduction, training: ActorTraining,
         evaluation: ActorEvaluation | None, *, healer: Healer, rt: Any, out: Path
         ) -> HealingParts:
    """Wrap the parts and register, with `healer`, the rebuild of each restartable group."""
    dock = training.actors.dock
    prod = HealingProduction(production, healer, rt, dock)
    train = HealingTraining(training, healer, rt, prod)

    async def producer(rank: int) -> None:
        await prod.rebuild(rank, last_producer_state(out, rank))

    async def reference(rank: int) -> None:
        # its ref_logprobs are forgotten and scored again by the new process (they were added
        # under the reference's stage); only groups it held unnamed columns of are lost
        key = f"reference[{rank}]"
        healer.stage[key] = "drop_shard"
        await dock.index.drop_shard.call(f"reference:{rank}")
        healer.stage[key] = "reproduce_lost"
        await prod.reproduce_lost(f"shard reference:{rank} died")
        healer.stage.pop(key, None)

    healer.rebuilds.update(rollout=train.repush, producer=producer, reference=reference)
    return HealingParts(production=prod, training=train, evaluation=None if evaluation is None
                        else HealingEvaluation(evaluation, healer, rt))
