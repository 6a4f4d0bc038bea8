"""Layout-aware dispatch: plan which warehouse slices go to which DP replica, then execute it
decentralized -- each replica's leader fetches its slice once, straight from the warehouses,
and replicates it inside its TP/CP/PP group. No process ever holds the whole batch.

`plan_step` is pure (lease + layout + micro-batch rule -> `DispatchPlan`). `gather_replica`
runs on a replica leader: it asks each warehouse (via a caller-supplied `request` coroutine,
normally an RPC to the warehouse's actor) to send its slice to the leader's receiver, and
collects the frames. `forward` / `receive_replica` move the slice to the other ranks of the
replica over any transport (on one host, shm hands every peer the same read-only pages).

Not here: deciding which samples are ready (dock_index.py), the wire of RPCs (runtime actors).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from earl.runtime.dock_index import Lease
from earl.runtime.dock_warehouse import frame_tag, unpack_batch
from earl.runtime.layout import Layout, MicroBatchRule, assign_micro_batches
from earl.runtime.transport.base import Frame, Receiver, Sender, pack_arrays

Batch = dict[str, dict[str, np.ndarray]]  # sample_id -> column -> array


@dataclass(frozen=True, slots=True)
class FetchOp:
    """Fetch `columns` of `sample_ids` from warehouse `shard`."""

    shard: str
    sample_ids: tuple[str, ...]
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReplicaPlan:
    dp: int
    leader: int
    ranks: tuple[int, ...]
    sample_ids: tuple[str, ...]
    micro_batches: tuple[tuple[str, ...], ...]
    fetches: tuple[FetchOp, ...]
    tokens: int


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    step: int
    issuers: tuple[tuple[int, int], ...]  # (index rank, lease id) of the lease (or its parts)
    layout: Layout
    columns: tuple[str, ...]
    replicas: tuple[ReplicaPlan, ...]

    def for_rank(self, rank: int) -> ReplicaPlan:
        return self.replicas[self.layout.coord(rank).dp]

    def is_leader(self, rank: int) -> bool:
        return self.for_rank(rank).leader == rank


def plan_step(lease: Lease, layout: Layout, rule: MicroBatchRule, *, step: int = 0) -> DispatchPlan:
    """Split a lease across DP replicas and micro-batches, and list each replica's fetches.

    Raises:
        ValueError: the lease does not divide across `layout` under `rule` (see layout.py).
    """
    locs = lease.samples
    lengths = [loc.length for loc in locs]
    per_dp = assign_micro_batches(lengths, layout, rule)
    replicas = []
    for d, mbs in enumerate(per_dp):
        idx = [i for mb in mbs for i in mb]
        by_shards: dict[tuple[tuple[str, str], ...], list[str]] = {}
        for i in idx:
            placement = tuple((c, locs[i].columns[c]) for c in lease.columns)
            by_shards.setdefault(placement, []).append(locs[i].sample_id)
        fetches = []
        for placement, ids in by_shards.items():
            for shard in sorted({s for _, s in placement}):
                cols = tuple(c for c, s in placement if s == shard)
                fetches.append(FetchOp(shard=shard, sample_ids=tuple(ids), columns=cols))
        replicas.append(
            ReplicaPlan(
                dp=d,
                leader=layout.leader(d),
                ranks=tuple(layout.replica(d)),
                sample_ids=tuple(locs[i].sample_id for i in idx),
                micro_batches=tuple(tuple(locs[i].sample_id for i in mb) for mb in mbs),
                fetches=tuple(_merge(fetches)),
                tokens=sum(lengths[i] for i in idx),
            )
        )
    return DispatchPlan(step=step, issuers=lease.issuers(), layout=layout,
                        columns=lease.columns, replicas=tuple(replicas))


def _merge(ops: list[FetchOp]) -> list[FetchOp]:
    """One request per (shard, columns): fewer, larger transfers."""
    merged: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for op in ops:
        merged.setdefault((op.shard, op.columns), []).extend(op.sample_ids)
    return [FetchOp(shard=s, sample_ids=tuple(ids), columns=c) for (s, c), ids in merged.items()]


async def gather(
    fetches: Sequence[FetchOp],
    receiver: Receiver,
    request: Callable[[FetchOp, str], Coroutine[object, object, None]],
    *,
    timeout_s: float = 120.0,
    tag: str = "",
) -> tuple[Batch, list[Frame]]:
    """Have every warehouse in `fetches` send its slice to `receiver`; collect the frames.

    Requests and receives run concurrently (a transport whose send waits for the reader cannot
    deadlock). Args:
        request: ``await request(op, address)`` makes warehouse ``op.shard`` send the slice to
            `address` (an RPC); it raises if the warehouse is dead.
        tag: the fetch's name, which `request` has the warehouses put in their frames
            (`Warehouse.pack`): frames with another tag are released unread. A fetch that
            failed may leave frames in `receiver` (a live warehouse's answer that came after
            another's death); counted as this fetch's, they would stand in for its own.
    Returns:
        (batch, frames); the batch views the frames' memory -- release the frames when done.
    Raises:
        The first error of a `request` (e.g. ActorDied), or TimeoutError; the caller then
        releases the lease so the samples go back to the dock.
    """
    frames: list[Frame] = []

    async def receive() -> None:  # short polls, so cancellation is prompt
        deadline = time.monotonic() + timeout_s
        while len(frames) < len(fetches):
            try:
                frame = await asyncio.to_thread(receiver.recv, 0.2)
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
                continue
            if tag and frame_tag(frame) != tag:
                frame.release()  # an earlier fetch's
                continue
            frames.append(frame)

    try:
        async with asyncio.TaskGroup() as tg:
            for op in fetches:
                tg.create_task(request(op, receiver.address))
            tg.create_task(receive())
    except BaseExceptionGroup as eg:
        for f in frames:
            f.release()
        raise eg.exceptions[0] from eg
    batch: Batch = {}
    for f in frames:
        for sid, cols in unpack_batch(f).items():
            batch.setdefault(sid, {}).update(cols)
    return batch, frames


async def gather_replica(
    replica: ReplicaPlan,
    receiver: Receiver,
    request: Callable[[FetchOp, str], Coroutine[object, object, None]],
    *,
    timeout_s: float = 120.0,
    tag: str = "",
) -> tuple[Batch, list[Frame]]:
    """On a replica leader: `gather` the replica's slice (see `gather` for errors and `tag`)."""
    batch, frames = await gather(replica.fetches, receiver, request, timeout_s=timeout_s,
                                 tag=tag)
    missing = set(replica.sample_ids) - batch.keys()
    if missing:
        for f in frames:
            f.release()
        raise RuntimeError(f"warehouses did not send samples {sorted(missing)[:5]}")
    return batch, frames


def replicate(batch: Batch, peers: Sequence[Sender]) -> None:
    """On the leader: send a (re-assembled) batch to every other rank of its replica (1 frame)."""
    ids = list(batch)
    arrays = {f"{i}/{c}": a for i, sid in enumerate(ids) for c, a in batch[sid].items()}
    header, bufs = pack_arrays(arrays, {"ids": ids})
    for peer in peers:
        peer.send(header, bufs)


def forward(frames: Sequence[Frame], peers: Sequence[Sender]) -> None:
    """On the leader: pass the gathered frames on to every other rank of its replica.

    Senders that can forward (shm) hand the same read-only pages to every peer -- no copy;
    others re-send the frame's buffers. Peers receive ``len(frames)`` frames.
    """
    for peer in peers:
        fwd = getattr(peer, "forward", None)
        for f in frames:
            if fwd is not None:
                fwd(f)
            else:
                peer.send(f.header, f.buffers)


def receive_replica(
    receiver: Receiver, n_frames: int = 1, *, timeout_s: float = 120.0
) -> tuple[Batch, list[Frame]]:
    """On a non-leader rank: the batch its leader sent (views; release the frames after use)."""
    frames = [receiver.recv(timeout_s) for _ in range(n_frames)]
    batch: Batch = {}
    for f in frames:
        for sid, cols in unpack_batch(f).items():
            batch.setdefault(sid, {}).update(cols)
    return batch, frames


def concat_micro_batch(
    batch: Mapping[str, Mapping[str, np.ndarray]], sample_ids: Sequence[str], column: str
) -> tuple[np.ndarray, np.ndarray]:
    """Pack one column of a micro-batch into one sequence plus cumulative lengths (cu_seqlens)."""
    parts = [np.atleast_1d(batch[sid][column]) for sid in sample_ids]
    cu = np.zeros(len(parts) + 1, np.int32)
    np.cumsum([len(p) for p in parts], out=cu[1:])
    return (np.concatenate(parts) if parts else np.empty(0)), cu


async def gather_many(
    parts: Mapping[str, tuple[Sequence[FetchOp], Receiver]],
    request: Callable[[FetchOp, str], Coroutine[object, object, None]],
    *,
    timeout_s: float = 120.0,
    tag: str = "",
) -> tuple[Batch, list[Frame], dict[str, int]]:
    """`gather` over several receivers at once (a consumer's one per transport kind: its
    warehouses sit on several hosts), keyed by name: one batch, every frame, and the bytes each
    key's receiver got. The first failure wins; the frames the others got are released."""
    out: dict[str, tuple[Batch, list[Frame]]] = {}

    async def one(key: str, ops: Sequence[FetchOp], receiver: Receiver) -> None:
        out[key] = await gather(ops, receiver, request, timeout_s=timeout_s, tag=tag)

    try:
        async with asyncio.TaskGroup() as tg:
            for key, (ops, receiver) in parts.items():
                tg.create_task(one(key, ops, receiver))
    except BaseExceptionGroup as eg:
        for _, done in out.values():
            for f in done:
                f.release()
        raise eg.exceptions[0] from eg
    batch: Batch = {}
    frames: list[Frame] = []
    for part, got in out.values():
        for sid, cols in part.items():
            batch.setdefault(sid, {}).update(cols)
        frames += got
    return batch, frames, {key: sum(f.nbytes for f in got) for key, (_, got) in out.items()}


__all__ = [
    "Batch",
    "DispatchPlan",
    "FetchOp",
    "ReplicaPlan",
    "concat_micro_batch",
    "forward",
    "gather",
    "gather_many",
    "gather_replica",
    "plan_step",
    "receive_replica",
    "replicate",
]
