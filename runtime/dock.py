"""The transfer dock on the actor runtime: index actor, warehouse endpoints, and the client.

- `IndexActor` wraps `DockIndex` (metadata only) and adds the waiting: `register` awaits room
  (backpressure), `take` awaits ready samples, leases expire on their own.
- `WarehouseHost` is a mixin that makes any producer actor a warehouse shard: the samples it
  puts stay in its process (in a shared-memory arena) and are sent straight to consumers over a
  transport on request; a same-host consumer maps them in place.
  `WarehouseActor` is a stand-alone shard for producers that are not actors.
- `Dock` is the client every process uses: `put`/`put_nowait` (producers), `take`, `fetch`,
  `ack`, `release` (consumers), `statistics`.

RPCs carry only metadata; column data goes warehouse -> consumer over runtime/transport, by
locality: a consumer asks each warehouse its host once (`dock_host`) and has it send to its
receiver of the kind `transport.route` picks (shm on one host, ucx or zmq across hosts).
A warehouse that dies mid-fetch makes `fetch` raise `DockFetchError` after telling the index,
which re-queues the lease's surviving samples and reports the lost groups via `take_lost`; the
error names the shard and its actor's failure as data (`shard`, `died`).

Not here: the bookkeeping rules (dock_index.py) and storage (dock_warehouse.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from earl.runtime import Actor, ActorDied, ActorError, ActorGroup, context, endpoint, wire
from earl.runtime.dispatch import Batch, DispatchPlan, FetchOp, ReplicaPlan, gather_many
from earl.runtime.dock_index import (
    CONTRACT_COLUMNS,
    DockIndex,
    DockStatistics,
    Lease,
    Location,
    LostSample,
    SampleInfo,
    WouldBlock,
    index_rank_of,
    merge_leases,
)
from earl.runtime.dock_take import index_errors, take_merged
from earl.runtime.dock_warehouse import Warehouse, WarehouseStatistics
from earl.runtime.errors import CausedByDeath, actor_label
from earl.runtime.layout import Layout
from earl.runtime.locality import host_id
from earl.runtime.transport import Receiver
from earl.runtime.transport.base import Frame
from earl.runtime.transport.route import Inbox, open_sender
from earl.runtime.transport.senders import SenderCache
from earl.runtime.transport.shm_arena import ShmArena

for _cls in (SampleInfo, Location, Lease, LostSample, DockStatistics, WarehouseStatistics,
             Layout, FetchOp, ReplicaPlan, DispatchPlan):  # plans travel to consumer ranks
    wire.message(_cls)


class DockFetchError(CausedByDeath):
    """A warehouse failed during `fetch`; the lease was released (samples re-queued or lost).

    Attributes:
        shard: the warehouse, "<group>:<rank>" of the actor holding it.
        lease_id: the lease that was released.
        died: that actor's failure, which the dock treats as its death: the `ActorDied` of the
            call when it died, else one with cause "failed" (it raised, or could not be found).
    """

    def __init__(self, shard: str, lease_id: int, died: ActorDied, detail: str) -> None:
        self.shard, self.lease_id, self.died, self.detail = shard, lease_id, died, detail
        super().__init__(f"warehouse {shard} failed during fetch (lease {lease_id} released): "
                         f"{detail}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.shard, self.lease_id, self.died, self.detail))

    @classmethod
    def of(cls, shard: str, lease_id: int, cause: BaseException) -> DockFetchError:
        """The error for warehouse `shard` failing with `cause` during a fetch of `lease_id`."""
        group, rank = _shard_actor(shard)
        if isinstance(cause, ActorDied) and (cause.group, cause.rank) == (group, rank):
            return cls(shard, lease_id, cause, str(cause))
        died = ActorDied(actor_label(group, rank), f"its warehouse failed during a fetch: "
                         f"{type(cause).__name__}: {cause}", group=group, rank=rank,
                         cause="failed", call="dock_send")
        return cls(shard, lease_id, died, str(cause))


class _ShardFailed(Exception):
    def __init__(self, shard: str, cause: BaseException) -> None:
        super().__init__(shard)
        self.shard, self.cause = shard, cause


@wire.message
@dataclass(kw_only=True, slots=True)
class ShardReport:
    shard: str
    own: list[tuple[SampleInfo, list[str]]]
    extra: list[tuple[str, str, dict[str, int]]]


class IndexActor(Actor):
    """The dock's metadata index as an actor (see `DockIndex` for the arguments).

    Spawn it with ``n > 1`` to shard the index by group: each rank owns the groups that
    `index_rank_of` maps to it, with ``capacity`` samples each; `Dock` routes the calls.
    """

    def __init__(self, *, stages: list[str], capacity: int,
                 columns: list[str] | None = None, lease_timeout_s: float = 600.0) -> None:
        self.ix = DockIndex(stages=stages, capacity=capacity,
                            columns=columns or CONTRACT_COLUMNS, lease_timeout_s=lease_timeout_s,
                            index_rank=self.rank)
        self.changed = asyncio.Condition()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _evict(self, evict: dict[str, list[str]]) -> None:
        """Have each live shard drop the columns of `evict` (shard -> sample ids)."""
        for shard, ids in evict.items():
            with contextlib.suppress(ActorDied, KeyError):
                await (await _shard(shard)).dock_evict.call_one(ids)

    @endpoint
    async def register(self, info: SampleInfo, wait: bool = True,
                       timeout_s: float | None = None) -> None:
        """Record a new sample; with `wait`, await room (backpressure), else raise WouldBlock."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        async with self.changed:
            while True:
                try:
                    self.ix.register(info)
                    break
                except WouldBlock:
                    if not wait:
                        raise
                    await self._wait(deadline, "producers")
            self.changed.notify_all()

    async def _wait(self, deadline: float | None, who: str) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("dock wait timed out")
        attr = f"waiting_{who}"
        setattr(self.ix, attr, getattr(self.ix, attr) + 1)
        try:  # wake at least every second so lease expiry is noticed; asyncio.timeout, not
            # wait_for, which in 3.11 can swallow a cancellation that meets a notify
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left or 1.0, 1.0)):
                    await self.changed.wait()
        finally:
            setattr(self.ix, attr, getattr(self.ix, attr) - 1)

    @endpoint
    async def add_columns(self, sample_id: str, shard: str, columns: dict[str, int],
                          stage: str = "") -> None:
        self.ix.add_columns(sample_id, shard, columns, stage)
        await self._notify()

    @endpoint
    async def take(self, stage: str, columns: list[str], n: int, whole_groups: bool = True,
                   min_version: int | None = None, wait: bool = True,
                   timeout_s: float | None = None, at_least: int | None = None,
                   group_ids: list[str] | None = None, holder: str = "") -> Lease:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        async with self.changed:
            while True:
                try:
                    lease = self.ix.take(stage, columns, n, whole_groups=whole_groups,
                                         min_version=min_version, at_least=at_least,
                                         group_ids=group_ids, holder=holder)
                    break
                except WouldBlock:
                    if not wait:
                        raise
                    await self._wait(deadline, "consumers")
        await self._evict(self.ix.take_evictions())  # groups lost as expired leases ended
        return lease

    @endpoint
    async def ack(self, lease_id: int) -> None:
        res = self.ix.ack(lease_id)
        for shard, ids in res.acked.items():  # before returning: survives an index restart
            with contextlib.suppress(ActorDied, KeyError):
                await (await _shard(shard)).dock_mark_acked.call_one(ids, res.stage)
        await self._evict(res.evict)
        await self._evict(self.ix.take_evictions())  # groups lost as a shard died
        await self._notify()

    @endpoint
    async def release(self, lease_id: int, dead_shard: str | None = None) -> None:
        """Give a lease back; `dead_shard` also reports that shard's data as lost."""
        with contextlib.suppress(KeyError):
            self.ix.release(lease_id)
        if dead_shard is not None:
            await self.drop_shard(dead_shard)
        await self._evict(self.ix.take_evictions())
        await self._notify()

    @endpoint
    async def drop_shard(self, shard: str) -> None:
        """A warehouse died: its groups go to `take_lost`, their other columns are evicted;
        columns a named stage added there are written again (`DockIndex.drop_shard`)."""
        await self._evict(self.ix.drop_shard(shard))
        await self._evict(self.ix.take_evictions())
        await self._notify()

    @endpoint
    async def retract_shard(self, shard: str, stage: str) -> int:
        """A leaving shard of `stage`'s added columns: `stage` writes them again elsewhere."""
        n = self.ix.retract_shard(shard, stage)
        await self._notify()
        return n

    @endpoint
    async def take_lost(self) -> list[LostSample]:
        return self.ix.take_lost()

    @endpoint
    async def statistics(self) -> DockStatistics:
        return self.ix.statistics()

    @endpoint
    async def resident(self, stage: str) -> list[str]:
        return self.ix.resident(stage)

    @endpoint
    async def restore(self, shards: list[str]) -> int:
        """Rebuild after a restart from the live shards' reports; returns samples restored."""
        for shard in shards:
            rep: ShardReport = await (await _shard(shard)).dock_report.call_one()
            own = [(info, acked) for info, acked in rep.own
                   if index_rank_of(info.group_id, self.world_size) == self.rank]
            self.ix.restore(own, rep.extra)
        await self._notify()
        return self.ix.statistics().samples


def shard_name(group: str, rank: int) -> str:
    """The warehouse shard that actor `group[rank]` hosts (see `WarehouseHost`)."""
    return f"{group}:{rank}"


def _shard_actor(shard: str) -> tuple[str, int]:
    """The actor (group, rank) holding warehouse `shard` ("<group>:<rank>", see WarehouseHost)."""
    group, _, rank = shard.rpartition(":")
    return group, int(rank or 0)


async def _shard(shard: str) -> ActorGroup:  # type: ignore[type-arg]
    group, rank = _shard_actor(shard)
    return (await context().lookup(group))[rank]


class WarehouseHost:
    """Mixin: makes an actor a warehouse shard named ``"<group>:<rank>"``."""

    _warehouse: Warehouse
    _senders: SenderCache

    @property
    def warehouse(self) -> Warehouse:
        if not hasattr(self, "_warehouse"):
            # experience in shared memory: a same-host fetch sends its place, not its bytes
            self._warehouse = Warehouse(shard_name(self.name, self.rank),  # type: ignore[attr-defined]
                                        arena=ShmArena())
            self._senders = SenderCache(open_sender)  # a dead consumer's closes in time
        return self._warehouse

    @endpoint
    async def dock_send(self, sample_ids: list[str], columns: list[str], address: str,
                        tag: str = "") -> int:
        """Send the columns to a consumer's receiver, in a frame tagged with the consumer's
        fetch (`dispatch.gather`); returns bytes sent."""
        header, bufs = self.warehouse.pack(sample_ids, columns, tag)
        sender, lock = self._senders.lease(address)

        def send() -> None:
            with lock:  # senders are single-threaded; concurrent fetches take turns
                sender.send(header, bufs)

        await asyncio.to_thread(send)
        return sum(b.nbytes for b in bufs)

    @endpoint
    async def dock_host(self) -> str:
        """This shard's `host_id()`: consumers pick the transport they fetch over by it."""
        return host_id()

    @endpoint
    async def dock_mark_acked(self, sample_ids: list[str], stage: str) -> None:
        self.warehouse.mark_acked(sample_ids, stage)

    @endpoint
    async def dock_evict(self, sample_ids: list[str]) -> None:
        self.warehouse.evict(sample_ids)

    @endpoint
    async def dock_report(self) -> ShardReport:
        own, extra = self.warehouse.report()
        return ShardReport(shard=self.warehouse.name, own=own, extra=extra)

    @endpoint
    async def dock_statistics(self) -> WarehouseStatistics:
        return self.warehouse.statistics()


class WarehouseActor(WarehouseHost, Actor):
    """A stand-alone shard; `put` stores columns sent over RPC (for non-actor producers)."""

    def __init__(self, index: str = "dock") -> None:
        self.index_name = index

    @endpoint
    async def put(self, sample_id: str, columns: dict[str, np.ndarray], group_id: str,
                  group_size: int = 1, wait: bool = True) -> None:
        dock = Dock(await context().lookup(self.index_name), warehouse=self.warehouse)
        await dock.put(sample_id, columns, group_id=group_id, group_size=group_size, wait=wait)


class Dock:
    """Client of the dock, usable from any process with a runtime.

    Args:
        index: the IndexActor group (one rank, or several sharding the index by group).
        warehouse: this process' shard (producers); None for pure consumers.
        transport: force how fetched columns reach this process ("shm", "ucx", "zmq"); empty:
            by each warehouse's host (`transport.route`).
    """

    def __init__(self, index: ActorGroup, *, warehouse: Warehouse | None = None,  # type: ignore[type-arg]
                 transport: str = "") -> None:
        self.index, self.warehouse = index, warehouse
        self.inbox = Inbox(transport or None)
        self._hosts: dict[str, str] = {}  # shard -> its host id (asked once)
        self._fetched: dict[str, int] = {}  # transport kind -> bytes received
        self._rr = itertools.count()
        self._fetches = itertools.count(1)  # tags this client's fetches (`dispatch.gather`)

    async def put(self, sample_id: str, columns: Mapping[str, np.ndarray], *, group_id: str,
                  group_size: int = 1, wait: bool = True, timeout_s: float | None = None) -> None:
        """Store a new sample in this process' shard and register it; awaits room when full."""
        if self.warehouse is None:
            raise ValueError("this Dock has no warehouse: pass warehouse= (producers only)")
        info = self.warehouse.put(sample_id, columns, group_id=group_id, group_size=group_size)
        assert isinstance(info, SampleInfo)
        try:
            await index_errors(self._owner(group_id).register.call_one(info, wait, timeout_s))
        except BaseException:
            self.warehouse.evict([sample_id])
            raise

    async def put_nowait(self, sample_id: str, columns: Mapping[str, np.ndarray], *,
                         group_id: str, group_size: int = 1) -> None:
        """Like `put` but raises WouldBlock at once when the dock is full."""
        await self.put(sample_id, columns, group_id=group_id, group_size=group_size, wait=False)

    async def add_columns(self, sample_id: str, columns: Mapping[str, np.ndarray], *,
                          group_id: str, stage: str = "") -> None:
        """A later stage adds columns (e.g. ref_logprobs) to a sample, in this shard. Name the
        `stage` so this shard's death costs only these columns, which the stage writes again
        (unnamed: the sample's group is lost and played again)."""
        if self.warehouse is None:
            raise ValueError("this Dock has no warehouse: pass warehouse= to add columns")
        sizes = self.warehouse.put(sample_id, columns)
        assert isinstance(sizes, dict)
        await self._owner(group_id).add_columns.call_one(sample_id, self.warehouse.name, sizes,
                                                         stage)

    @property
    def _holder(self) -> str:
        """This process' shard, named on its leases: its death releases them."""
        return self.warehouse.name if self.warehouse is not None else ""

    def _owner(self, group_id: str) -> ActorGroup:  # type: ignore[type-arg]
        return self.index[index_rank_of(group_id, len(self.index))]

    async def take(self, stage: str, columns: Sequence[str], n: int, *, whole_groups: bool = True,
                   min_version: int | None = None, timeout_s: float | None = None,
                   at_least: int | None = None, group_ids: Sequence[str] | None = None
                   ) -> Lease:
        """Lease `n` samples with `columns` ready that `stage` has not consumed (awaits); with
        `at_least`, whatever is ready from `at_least` up to `n`; with `group_ids`, only from
        those groups.

        With a sharded index each shard holds the groups its ids map to, so a step's samples
        are spread over the shards: the lease is merged from what each has ready (whole groups
        from each), tried in turn without waiting, then waited on in short slices; the parts
        taken are held meanwhile and given back if the take fails or times out.
        """
        if len(self.index) == 1 or group_ids is not None:
            return await self._take_named(stage, columns, n, whole_groups, min_version,
                                          timeout_s, at_least, group_ids)
        parts: list[Lease] = []
        try:
            return await take_merged(self.index, next(self._rr), parts, stage, list(columns),
                                     n, whole_groups=whole_groups, min_version=min_version,
                                     timeout_s=timeout_s, at_least=at_least,
                                     holder=self._holder)
        except BaseException:
            for part in parts:
                with contextlib.suppress(Exception):
                    await self.release(part)
            raise

    async def _take_named(self, stage: str, columns: Sequence[str], n: int,
                          whole_groups: bool, min_version: int | None, timeout_s: float | None,
                          at_least: int | None, group_ids: Sequence[str] | None) -> Lease:
        """`take` from one index rank, or of named groups from the ranks that own them."""
        if group_ids is None:
            return await index_errors(self.index.take.call_one(
                stage, list(columns), n, whole_groups, min_version, True, timeout_s,
                at_least=at_least, holder=self._holder))
        owners: dict[int, list[str]] = {}
        for gid in group_ids:
            owners.setdefault(index_rank_of(gid, len(self.index)), []).append(gid)
        parts: list[Lease] = []
        try:
            for rank, gids in owners.items():
                parts.append(await index_errors(self.index[rank].take.call_one(
                    stage, list(columns), n, whole_groups, min_version, True, timeout_s,
                    at_least=at_least, group_ids=gids, holder=self._holder)))
        except BaseException:
            for part in parts:
                with contextlib.suppress(Exception):
                    await self.release(part)
            raise
        return merge_leases(parts)

    def receiver(self, peer_host: str | None = None) -> Receiver:
        """Where a producer on `peer_host` (a `host_id()`; None: this host) sends to us."""
        return self.inbox.for_peer(host_id() if peer_host is None else peer_host)

    def fetched_bytes(self) -> dict[str, int]:
        """Bytes `fetch` received so far, per transport kind (what carried the experience)."""
        return dict(self._fetched)

    async def fetch(self, lease: Lease, *, timeout_s: float = 120.0) -> tuple[Batch, list[Frame]]:
        """Fetch a lease's columns straight from the warehouses holding them.

        Returns (batch, frames): arrays view the frames' memory; release frames when done.
        Raises:
            DockFetchError: a warehouse died; the lease was released and the index told.
        """
        ops = [FetchOp(shard=s, sample_ids=tuple(ids), columns=tuple(cols))
               for s, ids, cols in lease.fetches()]
        return await self._gather(lease.issuers(), ops, timeout_s)

    async def fetch_replica(self, plan: DispatchPlan, rank: int, *,
                            timeout_s: float = 120.0) -> tuple[Batch, list[Frame]]:
        """On a replica leader: fetch this rank's DP slice of a dispatch plan (see `fetch`)."""
        if not plan.is_leader(rank):
            raise ValueError(f"rank {rank} is not a replica leader; it receives via "
                             f"dispatch.receive_replica from rank {plan.for_rank(rank).leader}")
        return await self._gather(plan.issuers, plan.for_rank(rank).fetches, timeout_s)

    async def _gather(self, issuers: Sequence[tuple[int, int]], ops: Sequence[FetchOp],
                      timeout_s: float) -> tuple[Batch, list[Frame]]:
        tag = f"{next(self._fetches)}.{secrets.token_hex(4)}"

        async def request(op: FetchOp, address: str) -> None:
            try:
                shard = await _shard(op.shard)
                await shard.dock_send.call_one(list(op.sample_ids), list(op.columns), address,
                                               tag)
            except (ActorDied, ActorError, KeyError, ConnectionError) as e:
                raise _ShardFailed(op.shard, e) from e

        try:
            by_kind: dict[str, list[FetchOp]] = {}
            for op in ops:
                by_kind.setdefault(self.inbox.kind_for(await self._host_of(op.shard)),
                                   []).append(op)
            batch, frames, got = await gather_many(
                {kind: (part, self.inbox.receiver(kind)) for kind, part in by_kind.items()},
                request, timeout_s=timeout_s, tag=tag)
        except _ShardFailed as failed:
            self._hosts.pop(failed.shard, None)  # a restarted shard may be elsewhere
            for index_rank, lease_id in issuers:
                await self.index[index_rank].release.call_one(lease_id, failed.shard)
            if len(self.index) > 1:  # every index shard may hold groups from the dead warehouse
                await self.index.drop_shard.call(failed.shard)
            raise DockFetchError.of(failed.shard, issuers[0][1] if issuers else -1,
                                    failed.cause) from failed.cause
        for kind, n in got.items():
            self._fetched[kind] = self._fetched.get(kind, 0) + n
        return batch, frames

    async def _host_of(self, shard: str) -> str:
        if shard not in self._hosts:
            try:
                self._hosts[shard] = await (await _shard(shard)).dock_host.call_one()
            except (ActorDied, ActorError, KeyError, ConnectionError) as e:
                raise _ShardFailed(shard, e) from e
        return self._hosts[shard]

    async def ack(self, lease: Lease) -> None:
        """Mark the lease consumed; raises LeaseError if it expired or was already acked."""
        for index_rank, lease_id in lease.issuers():
            await index_errors(self.index[index_rank].ack.call_one(lease_id))

    async def drop(self, lease: Lease, reason: str) -> None:
        """Consume `lease`'s samples without using them (`reason` is for a caller's records:
        a sample over the staleness bound); the index evicts them as it does on `ack`."""
        await self.ack(lease)

    async def release(self, lease: Lease) -> None:
        for index_rank, lease_id in lease.issuers():
            await self.index[index_rank].release.call_one(lease_id)

    async def take_lost(self) -> list[LostSample]:
        return [x for part in await self.index.take_lost.call() for x in part]

    async def retract_shard(self, shard: str, stage: str) -> int:
        """Every index rank forgets the columns `stage` added on `shard`, and `stage` may take
        those samples again (`DockIndex.retract_shard`); returns the samples retracted."""
        return sum(await self.index.retract_shard.call(shard, stage))

    async def resident(self, stage: str) -> list[str]:
        """Ids of the samples in the dock that `stage` has not acked, over the index shards."""
        return [sid for part in await self.index.resident.call(stage) for sid in part]

    async def statistics(self) -> DockStatistics:
        """Totals over the index shards."""
        parts: list[DockStatistics] = await self.index.statistics.call()
        if len(parts) == 1:
            return parts[0]
        return DockStatistics(
            samples=sum(p.samples for p in parts),
            capacity=sum(p.capacity for p in parts),
            ready=_sum_dicts(p.ready for p in parts),
            bytes_per_shard=_sum_dicts(p.bytes_per_shard for p in parts),
            leased=sum(p.leased for p in parts),
            consumed=_sum_dicts(p.consumed for p in parts),
            lost=sum(p.lost for p in parts),
            waiting_producers=sum(p.waiting_producers for p in parts),
            waiting_consumers=sum(p.waiting_consumers for p in parts),
        )

    def close(self) -> None:
        self.inbox.close()


def _sum_dicts(ds: Iterable[dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in ds:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out
