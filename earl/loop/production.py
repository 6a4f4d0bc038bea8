"""Production: a batch's groups dealt to the producer actors, played, and played again when a
producer's death lost them.

A batch plays `groups_per_batch + over_sample` groups and trains the first `groups_per_batch`
to finish (each producer keeps its share; see `RunConfig.over_sample_groups`). Group `g` of
batch `b` has cursor `b * stride + g` (`stride` = the groups played per batch); its members
play task `cursor` (shared) or `cursor * group_size + i` (one task each), so a resumed run
replays exactly the tasks of the batches it had not trained.

A producer that dies while playing its share (or, with partial rollouts, a group) has it
played again under a fresh tag once the supervisor healed it; groups the dock reports lost
(`Dock.take_lost`: a dead producer's or reference's shard) are played again by
`reproduce_lost`. Every row put is written to the sample ledger (`earl.loop.ledger`).

Not here: restarts and their limits (`earl.loop.supervisor`), the producers themselves
(`earl.stages.producer`).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from earl.loop.supervisor import died_actor
from earl.observe import Tracer
from earl.runtime.errors import ActorDied, ActorError
from earl.stages.batch_types import BatchResult, GroupTask, sample_id

if TYPE_CHECKING:
    from earl.loop.supervisor import Supervisor
    from earl.recipe import TaskSource
    from earl.runtime import ActorGroup
    from earl.runtime.dock import Dock
    from earl.stages.producer import ProducerActor

__all__ = ["ActorProduction"]


class ActorProduction:
    """Deals, plays and re-plays a run's groups on its producers (see the module docstring)."""

    def __init__(self, producers: ActorGroup[ProducerActor], tasks: TaskSource, *,
                 groups_per_batch: int, group_size: int, shared: bool, over_sample: int = 0,
                 supervisor: Supervisor, dock: Dock, tracer: Tracer | None = None) -> None:
        self.producers, self.tasks = producers, tasks
        self.groups_per_batch, self.group_size, self.shared = groups_per_batch, group_size, shared
        self.over_sample = over_sample
        self.supervisor, self.dock = supervisor, dock
        self.tracer = tracer or Tracer(False)
        # the plays of producers' shares still playing ("b<batch>-p<rank>[-<tag>]", their
        # rows' ids less the row): `_share` plays their lost groups again, not `reproduce_lost`
        self.playing: set[str] = set()
        self._tags = itertools.count(1)
        self._pending: dict[str, tuple[int, GroupTask]] = {}  # group id -> (batch, task)

    # ---- dealing -------------------------------------------------------------------------
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

    # ---- playing -------------------------------------------------------------------------
    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        with self.tracer.span("play", actor="producer", step=batch + 1):
            results = await asyncio.gather(*(self._share(r, batch, share, snapshot, need)
                                             for r, share, need in self.deal(batch)))
        return self.merge(batch, results)

    async def _share(self, r: int, batch: int, share: list[GroupTask], snapshot: bool,
                     need: int | None) -> BatchResult:
        """Producer `r`'s share of `batch`, played again whole if it dies playing it (the
        groups of a share still playing are not re-played by `reproduce_lost`)."""
        p = self.producers[r]
        return await self._played(r, batch, lambda tag: tag, "replay_share", lambda tag: (
            p.replay.call_one(batch, share, tag, snapshot, need) if tag
            else p.play.call_one(batch, share, snapshot, need)))

    async def _played(self, r: int, batch: int, ids: Callable[[str], str], event: str,
                      call: Callable[[str], Awaitable[BatchResult]]) -> BatchResult:
        """`call(tag)` on producer `r`, called again under a fresh tag when `r` died during it
        (once the supervisor healed it). Its plays (`ids(tag)`: the rows' ids less the row)
        are in `playing` while it runs; the rows it put go to the ledger."""
        tag, plays = "", set()
        try:
            while True:
                plays.add(sample_id(batch, 0, ids(tag), r).rsplit("-", 1)[0])
                self.playing |= plays
                try:
                    res = await call(tag)
                except Exception as exc:
                    if died_actor(exc) != ("producer", r) or self.supervisor.stopping:
                        raise
                    self.supervisor.note(event, "producer", rank=r, step=batch + 1)
                    await self.supervisor.wait_healed("producer", r)
                    tag = f"x{next(self._tags)}"
                    continue
                self._record(batch, res, ids(tag), r)
                return res
        finally:
            self.playing -= plays

    async def play_groups(self, batch: int, done: Callable[[BatchResult], None]) -> BatchResult:
        """Partial rollouts: play batch `batch`'s groups, each on its own (group g on producer
        g mod n), each in the dock as soon as it is done; `done` gets each group's result as it
        comes. Returns them all merged."""

        async def one(g: int, task: GroupTask) -> BatchResult:
            res = await self._play_group(batch, g, task)
            done(res)
            return res

        with self.tracer.span("play", actor="producer", step=batch + 1):
            results = await asyncio.gather(*(one(g, t) for g, t in
                                             enumerate(self.groups(batch))))
        return self.merge(batch, results)

    async def _play_group(self, batch: int, g: int, task: GroupTask) -> BatchResult:
        """Group `g`, played again if its producer dies playing it. Only the groups still
        playing are in `playing`: a group is in the dock as soon as it is done, so one lost
        with a shard is re-played by `reproduce_lost` while the rest of its batch plays on."""
        r = g % len(self.producers)
        return await self._played(
            r, batch, lambda tag: f"{tag}-g{g}" if tag else f"g{g}", "replay_group",
            lambda tag: self.producers[r].play_group.call_one(batch, task, g, tag))

    def _record(self, batch: int, res: BatchResult, tag: str, rank: int) -> None:
        """The rows `res` put, in the ledger (their ids as the producer made them)."""
        self.supervisor.ledger.add_produced([sample_id(batch, j, tag, rank)
                                             for j in range(res.samples)], res.row_groups)

    # ---- the producers' state ------------------------------------------------------------
    async def note_version(self, version: int) -> None:
        for r in range(len(self.producers)):
            try:
                await self.producers[r].note_version.call_one(version)
            except ActorDied:  # a restarted producer gets the version in its rebuild
                continue

    async def pin_version(self, version: int) -> None:
        """The rollout now serves `version` on purpose (an earlier step's weights)."""
        await self.producers.pin_version.call(version)

    async def save_states(self, folder: str, batch: int | None) -> None:
        """Each producer writes its critic after `batch` (None: now; a restarted producer,
        which lost that snapshot: its current one) to `folder/<rank>.json`."""
        await asyncio.gather(*(self.producers[r].save_state.call_one(f"{folder}/{r}.json", batch)
                               for r in range(len(self.producers))))

    async def load_states(self, folder: str) -> None:
        """Each producer loads its critic from `folder/<rank>.json` where there is one (a run
        resumed with more producers than it saved starts the others afresh)."""
        await asyncio.gather(*(self.producers[r].load_state.call_one(f"{folder}/{r}.json")
                               for r in range(len(self.producers))
                               if Path(folder, f"{r}.json").is_file()))

    # ---- healing -------------------------------------------------------------------------
    async def rebuild(self, rank: int, state: str | None) -> None:
        """A restarted producer: version, critic (from the file `state`, its part of the
        checkpoint in force; None: none yet), its shard's lost groups played again."""
        p, sup, who = self.producers[rank], self.supervisor, f"producer[{rank}]"
        with sup.step(who, "note_version"):
            await p.note_version.call_one(sup.version)
        if state is not None:
            with sup.step(who, "load_state"):
                await p.load_state.call_one(state)
        await self.drop_shard(f"producer:{rank}", who)

    async def drop_shard(self, shard: str, who: str) -> None:
        """A restarted process' dock shard (`shard`, "producer:0") is gone: the dock forgets
        it, and the groups it lost are played again."""
        with self.supervisor.step(who, "drop_shard"):
            await self.dock.index.drop_shard.call(shard)
        with self.supervisor.step(who, "reproduce_lost"):
            await self.reproduce_lost(f"shard {shard} died")

    async def reproduce_lost(self, reason: str) -> int:
        """Play again every group the dock reports lost (except those of a producer's share
        still playing: `_share` plays it again whole); returns the groups re-played.

        Each call plays the groups it took from the dock and holds no lock while they play:
        a re-play waits for room in the dock, which only the trainer (and so the reference)
        makes, so the reference's rebuild must never wait behind it. A group whose re-play
        failed is played by the next call (the next rebuild or retried step)."""
        lost = await self.dock.take_lost()
        self.supervisor.ledger.add_dropped(lost, f"{reason} (group re-played)")
        stride, n = self.stride, len(self.producers)
        shares = {x.group_id for x in lost if x.sample_id.rsplit("-", 1)[0] in self.playing}
        for gid in sorted({x.group_id for x in lost} - shares):
            cursor = int(gid[1:])
            batch = cursor // stride
            self._pending[gid] = (batch, self.groups(batch)[cursor % stride])
        mine, self._pending = self._pending, {}
        played = 0

        async def one(gid: str, batch: int, task: GroupTask) -> None:
            nonlocal played
            r, tag = hash(gid) % n, f"x{next(self._tags)}"
            with self.supervisor.step(f"producer[{r}]", f"replay of group {gid} (batch {batch})"):
                try:
                    res = await self.producers[r].replay.call_one(batch, [task], tag, False)
                except (ActorDied, ActorError) as exc:
                    self.supervisor.log(f"healing: re-playing group {gid} failed ({exc}); later")
                    self._pending[gid] = (batch, task)
                    return
            self._record(batch, res, tag, r)
            played += 1

        async with asyncio.TaskGroup() as tg:
            for gid, (batch, task) in mine.items():
                tg.create_task(one(gid, batch, task))
        if played:
            self.supervisor.note("replay_groups", "producer", groups=played)
        return played
