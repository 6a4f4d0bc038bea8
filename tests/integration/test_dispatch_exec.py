"""Executing a dispatch plan: replica leaders gather from warehouses over shm, replicate to
their TP peers; the union over replicas is the lease, each sample exactly once per replica."""

from __future__ import annotations

import numpy as np
import pytest

from earl.runtime.dispatch import (
    concat_micro_batch,
    forward,
    gather_replica,
    plan_step,
    receive_replica,
    replicate,
)
from earl.runtime.dock_index import DockIndex
from earl.runtime.dock_warehouse import Warehouse
from earl.runtime.layout import Layout, TokenBudget
from earl.runtime.transport import connect, get_transport


@pytest.mark.timeout(60)
async def test_plan_gather_replicate_over_shm():
    shm = get_transport("shm")
    shards = {f"w{k}": Warehouse(f"w{k}") for k in range(2)}
    ix = DockIndex(stages=["train"], capacity=64)
    for i in range(12):
        n = 3 + i
        info = shards[f"w{i % 2}"].put(f"s{i}", {
            "input_ids": np.full(n, i, np.int64), "versions": np.zeros(n, np.int32),
            "loss_mask": np.ones(n, np.int8)}, group_id=f"g{i // 4}", group_size=4)
        ix.register(info)
    lease = ix.take("train", ["input_ids", "loss_mask"], 12)
    layout = Layout(dp=2, tp=2)
    plan = plan_step(lease, layout, TokenBudget(max_tokens=40))
    receivers = [shm.listen() for _ in range(layout.world_size)]
    senders: dict[str, object] = {}

    async def request(op, address):  # what a warehouse's dock_send endpoint does
        sender = senders.setdefault(address, connect(address))
        sender.send(*shards[op.shard].pack(list(op.sample_ids), list(op.columns)))

    seen = []
    try:
        for rep in plan.replicas:
            batch, frames = await gather_replica(rep, receivers[rep.leader], request)
            peers = [r for r in rep.ranks if r != rep.leader]
            peer_senders = [connect(receivers[p].address) for p in peers]
            forward(frames, peer_senders)  # zero-copy: same pages, read-only
            replicate(batch, peer_senders)  # a re-packed copy, one frame
            for p in peers:
                fwd, fwd_frames = receive_replica(receivers[p], len(frames), timeout_s=10)
                copy, copy_frames = receive_replica(receivers[p], timeout_s=10)
                assert fwd.keys() == copy.keys() == batch.keys()
                for sid in batch:
                    np.testing.assert_array_equal(fwd[sid]["input_ids"], batch[sid]["input_ids"])
                    np.testing.assert_array_equal(copy[sid]["loss_mask"], batch[sid]["loss_mask"])
                for f in fwd_frames + copy_frames:
                    f.release()
            for mb in rep.micro_batches:
                ids, cu = concat_micro_batch(batch, mb, "input_ids")
                assert cu[-1] == len(ids) <= 40
                assert [int(ids[a]) for a in cu[:-1]] == [int(s[1:]) for s in mb]
            seen += list(batch)
            for f in frames:
                f.release()
            for s in peer_senders:
                assert s.wait_released(10)  # peers' releases reach the producers' pools
                s.close()
        for s in senders.values():  # every producer segment came back: nothing leaks
            assert s.wait_released(10) and s.statistics().in_flight == 0
        assert sorted(seen) == sorted(loc.sample_id for loc in lease.samples)
    finally:
        for s in senders.values():
            s.close()
        for r in receivers:
            r.close()
