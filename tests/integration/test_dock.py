"""The transfer dock on real actors: fetch straight from producer shards, backpressure,
a warehouse dying mid-fetch, and an index restart."""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import pytest

from earl.runtime import Actor, RestartPolicy, Runtime, context, endpoint
from earl.runtime.dispatch import DispatchPlan, plan_step
from earl.runtime.dock import Dock, DockFetchError, IndexActor, WarehouseActor, WarehouseHost
from earl.runtime.dock_index import LeaseError, index_rank_of
from earl.runtime.layout import FixedCount, Layout

COLS = ["input_ids", "loss_mask", "versions"]


class Producer(WarehouseHost, Actor):
    def __init__(self, index: str) -> None:
        self.index = index

    async def _dock(self) -> Dock:
        return Dock(await context().lookup(self.index), warehouse=self.warehouse)

    @endpoint
    async def produce(self, groups: int, group_size: int, wait: bool = True) -> list[str]:
        dock, ids = await self._dock(), []
        for g in range(groups):
            for k in range(group_size):
                sid = f"{self.rank}-{g}-{k}"
                n = 5 + k
                await dock.put(sid, {
                    "input_ids": np.full(n, 100 * self.rank + g, np.int64),
                    "loss_mask": np.ones(n, np.int8),
                    "versions": np.full(n, 3, np.int32),
                }, group_id=f"{self.rank}-{g}", group_size=group_size, wait=wait)
                ids.append(sid)
        return ids

    @endpoint
    async def add_ref(self, sample_ids: list[str]) -> None:
        """Act as the reference stage: add ref_logprobs in this shard."""
        dock = await self._dock()
        for sid in sample_ids:
            n = 5 + int(sid.rsplit("-", 1)[1])
            await dock.add_columns(sid, {"ref_logprobs": np.full(n, -1.0, np.float32)},
                                   group_id=sid.rsplit("-", 1)[0])

    @endpoint
    async def lead(self, plan: DispatchPlan, rank: int) -> list[str]:
        """Act as a consumer replica leader: fetch this rank's slice of the plan."""
        dock = Dock(await context().lookup(self.index))
        batch, frames = await dock.fetch_replica(plan, rank)
        for f in frames:
            f.release()
        dock.close()
        return sorted(batch)

    @endpoint
    async def pid(self) -> int:
        return os.getpid()


@pytest.fixture
async def rt():
    async with Runtime() as rt:
        yield rt


async def _setup(rt, index="dock", capacity=64, stages=("train",), lease_timeout_s=600.0,
                 index_shards=1):
    ix = await rt.spawn(index, IndexActor, stages=list(stages), capacity=capacity,
                        lease_timeout_s=lease_timeout_s, n=index_shards)
    prod = await rt.spawn("prod", Producer, index, n=2, restart=RestartPolicy(max_restarts=0))
    return ix, prod, Dock(ix)


@pytest.mark.timeout(90)
async def test_fetch_straight_from_shards_then_ack_evicts(rt):
    _ix, prod, dock = await _setup(rt, stages=("ref", "train"))
    await prod.produce.call(2, 2)
    lease = await dock.take("train", COLS, 8, timeout_s=10)
    assert {loc.columns["input_ids"] for loc in lease.samples} == {"prod:0", "prod:1"}
    batch, frames = await dock.fetch(lease)
    assert set(batch) == {loc.sample_id for loc in lease.samples}
    for sid, cols in batch.items():
        rank, g, k = map(int, sid.split("-"))
        assert cols["input_ids"].tolist() == [100 * rank + g] * (5 + k)
        assert cols["versions"].dtype == np.int32
    for f in frames:
        f.release()
    await dock.ack(lease)
    st = await dock.statistics()
    assert st.samples == 8 and st.consumed == {"ref": 0, "train": 8}  # "ref" still to come
    with pytest.raises(ValueError, match="produced by nobody"):
        await dock.take("ref", ["input_ids", "logits"], 2, timeout_s=1)
    with pytest.raises(TimeoutError):  # nobody wrote ref_logprobs yet
        await dock.take("ref", ["input_ids", "ref_logprobs"], 2, timeout_s=0.3)
    await prod[0].add_ref.call_one(sorted(batch))  # shard 0 computes ref for all 8
    lease = await dock.take("ref", ["input_ids", "ref_logprobs"], 8, timeout_s=10)
    assert {loc.columns["ref_logprobs"] for loc in lease.samples} == {"prod:0"}
    batch, frames = await dock.fetch(lease)  # columns of one sample from two shards
    assert all(c["ref_logprobs"][0] == -1.0 and len(c["ref_logprobs"]) == len(c["input_ids"])
               for c in batch.values())
    for f in frames:
        f.release()
    await dock.ack(lease)
    assert (await dock.statistics()).samples == 0
    shard_stats = await prod.dock_statistics.call()
    assert [s.nbytes for s in shard_stats] == [0, 0]  # evicted in the producers
    dock.close()


@pytest.mark.timeout(90)
async def test_backpressure_put_nowait_and_waiting_put(rt):
    _ix, prod, dock = await _setup(rt, capacity=2)
    await prod[0].produce.call_one(1, 2)
    with pytest.raises(Exception, match="WouldBlock"):
        await prod[1].produce.call_one(1, 1, False)  # put_nowait path
    waiting = asyncio.ensure_future(prod[1].produce.call_one(1, 2))
    for _ in range(100):
        if (await dock.statistics()).waiting_producers:
            break
        await asyncio.sleep(0.05)
    assert (await dock.statistics()).waiting_producers == 1 and not waiting.done()
    await dock.ack(await dock.take("train", ["input_ids"], 2, timeout_s=5))
    assert await asyncio.wait_for(waiting, 20) == ["1-0-0", "1-0-1"]
    dock.close()


@pytest.mark.timeout(90)
async def test_warehouse_dying_mid_fetch_requeues_and_reports_lost(rt):
    _ix, prod, dock = await _setup(rt)
    await prod.produce.call(1, 2)
    lease = await dock.take("train", COLS, 4, timeout_s=10)
    os.kill(await prod[1].pid.call_one(), signal.SIGKILL)
    with pytest.raises(DockFetchError, match="prod:1") as info:
        await dock.fetch(lease)
    dead = info.value.died  # the shard's actor, as data
    assert (info.value.shard, dead.group, dead.rank) == ("prod:1", "prod", 1)
    lost = await dock.take_lost()
    assert sorted(x.sample_id for x in lost) == ["1-0-0", "1-0-1"]  # for re-production
    again = await dock.take("train", COLS, 2, timeout_s=5)  # the live shard's group is back
    assert sorted(x.sample_id for x in again.samples) == ["0-0-0", "0-0-1"]
    batch, frames = await dock.fetch(again)
    assert len(batch) == 2
    for f in frames:
        f.release()
    await dock.ack(again)
    with pytest.raises(TimeoutError):
        await dock.take("train", COLS, 2, timeout_s=0.5)  # nothing handed out twice
    dock.close()


@pytest.mark.timeout(90)
async def test_index_restart_rebuilds_from_shards(rt):
    ix, prod, dock = await _setup(rt)
    await prod.produce.call(1, 2)
    await dock.ack(await dock.take("train", COLS, 2, timeout_s=5))
    await dock.take("train", COLS, 2, timeout_s=5)  # in flight when the index dies
    await rt.stop(ix)
    ix2 = await rt.spawn("dock", IndexActor, stages=["train"], capacity=64)
    assert await ix2.restore.call_one(["prod:0", "prod:1"]) == 2
    dock2 = Dock(ix2)
    lease = await dock2.take("train", COLS, 2, timeout_s=5)
    assert len(lease.samples) == 2
    with pytest.raises(TimeoutError):
        await dock2.take("train", COLS, 2, timeout_s=0.5)
    dock2.close()


@pytest.mark.timeout(90)
async def test_dispatch_plan_fetches_each_replica_slice_from_the_shards(rt):
    _ix, prod, dock = await _setup(rt)
    await prod.produce.call(2, 2)  # 8 samples on 2 shards
    lease = await dock.take("train", COLS, 8, timeout_s=10)
    plan = plan_step(lease, Layout(dp=2, tp=2), FixedCount(micro_batch_size=2))
    with pytest.raises(ValueError, match="rank 1 is not a replica leader"):
        await dock.fetch_replica(plan, 1)
    # a consumer actor gets the plan over RPC and fetches its replica's slice itself
    assert await prod[1].lead.call_one(plan, 2) == sorted(plan.for_rank(2).sample_ids)
    got = []
    for rep in plan.replicas:
        batch, frames = await dock.fetch_replica(plan, rep.leader)
        assert sorted(batch) == sorted(rep.sample_ids)  # this replica's slice only
        got += list(batch)
        for f in frames:
            f.release()
    assert sorted(got) == sorted(x.sample_id for x in lease.samples)
    await dock.ack(lease)
    dock.close()


@pytest.mark.timeout(90)
async def test_consumer_that_never_acks_loses_its_lease(rt):
    _ix, prod, dock = await _setup(rt, lease_timeout_s=1.0)
    await prod[0].produce.call_one(1, 2)
    dead = await dock.take("train", COLS, 2, timeout_s=5)  # this consumer "dies" holding it
    again = await dock.take("train", COLS, 2, timeout_s=10)  # handed out again after expiry
    assert [x.sample_id for x in again.samples] == [x.sample_id for x in dead.samples]
    with pytest.raises(LeaseError):
        await dock.ack(dead)  # the late ack cannot double-consume
    await dock.ack(again)
    assert (await dock.statistics()).samples == 0
    dock.close()


@pytest.mark.timeout(90)
async def test_sharded_index_routes_groups_and_merges_statistics(rt):
    ix, prod, dock = await _setup(rt, index_shards=2)
    await prod.produce.call(3, 2)  # 6 groups of 2 over 2 index shards
    groups = [f"{r}-{g}" for r in range(2) for g in range(3)]
    per_shard = [sum(index_rank_of(g, 2) == k for g in groups) for k in range(2)]
    assert [s.samples for s in await ix.statistics.call()] == [2 * n for n in per_shard]
    assert (await dock.statistics()).samples == 12
    seen = []
    for _ in range(6):
        lease = await dock.take("train", COLS, 2, timeout_s=10)
        assert {index_rank_of(x.group_id, 2) for x in lease.samples} == {lease.index_rank}
        batch, frames = await dock.fetch(lease)
        for f in frames:
            f.release()
        await dock.ack(lease)
        seen += list(batch)
    assert len(set(seen)) == 12 and (await dock.statistics()).samples == 0
    dock.close()


@pytest.mark.timeout(90)
async def test_a_step_spread_over_index_shards_is_one_merged_lease(rt):
    """A step's groups live on the shards their ids map to: the lease is merged from each
    shard's ready groups, fetched through a dispatch plan, and acked on every shard; a take that
    cannot be filled gives back the parts it held."""
    _ix, prod, dock = await _setup(rt, index_shards=2)
    await prod.produce.call(3, 2)
    with pytest.raises(TimeoutError, match="12 of 14"):
        await dock.take("train", COLS, 14, timeout_s=1.0)
    lease = await dock.take("train", COLS, 12, timeout_s=10)  # the parts were given back
    assert len(lease.samples) == 12 and len(lease.issuers()) == 2
    assert {r for r, _ in lease.issuers()} == {0, 1}
    plan = plan_step(lease, Layout(dp=2), FixedCount(micro_batch_size=2))
    got = await prod[0].lead.call_one(plan, 0) + await prod[1].lead.call_one(plan, 1)
    assert sorted(got) == sorted(x.sample_id for x in lease.samples)
    await dock.ack(lease)
    assert (await dock.statistics()).samples == 0
    dock.close()


@pytest.mark.timeout(90)
async def test_standalone_warehouse_actor_for_non_actor_producers(rt):
    ix = await rt.spawn("dock", IndexActor, stages=["train"], capacity=8)
    store = await rt.spawn("store", WarehouseActor, "dock")
    cols = {"input_ids": np.arange(4, dtype=np.int64), "versions": np.full(4, 7, np.int32)}
    await store.put.call_one("x0", cols, "gx", 1)  # columns travel as out-of-band RPC frames
    dock = Dock(ix)
    lease = await dock.take("train", ["input_ids"], 1, min_version=7, timeout_s=5)
    assert lease.samples[0].version == 7 and lease.samples[0].columns == {"input_ids": "store:0"}
    batch, frames = await dock.fetch(lease)
    assert batch["x0"]["input_ids"].tolist() == [0, 1, 2, 3]
    for f in frames:
        f.release()
    dock.close()
