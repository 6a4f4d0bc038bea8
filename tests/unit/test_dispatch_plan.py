"""Per-step dispatch plans: DP split, micro-batches, fetch lists, bad layouts."""

import pytest

from earl.runtime.dispatch import plan_step
from earl.runtime.dock_index import DockIndex, SampleInfo
from earl.runtime.layout import FixedCount, Layout, TokenBudget


def lease_of(n, *, shards=("p0", "p1"), lengths=None, ref_shard="r0"):
    ix = DockIndex(stages=["train"], capacity=1024)
    for i in range(n):
        length = lengths[i] if lengths else 10 + i
        ix.register(SampleInfo(sample_id=f"s{i}", group_id=f"g{i // 2}", group_size=2,
                               length=length, version=0, shard=shards[i % len(shards)],
                               columns={"input_ids": 8 * length, "versions": 4 * length}))
        ix.add_columns(f"s{i}", ref_shard, {"ref_logprobs": 4 * length})
    return ix.take("train", ["input_ids", "ref_logprobs"], n)


def test_plan_splits_across_dp_and_fetches_each_slice_from_its_shards_once():
    lease = lease_of(8)
    plan = plan_step(lease, Layout(dp=2, tp=2), FixedCount(micro_batch_size=2), step=7)
    assert plan.step == 7 and plan.issuers == lease.issuers() == ((0, lease.lease_id),)
    assert [r.leader for r in plan.replicas] == [0, 2]
    assert plan.for_rank(3).dp == 1 and plan.is_leader(2) and not plan.is_leader(3)
    ids = [set(r.sample_ids) for r in plan.replicas]
    assert ids[0].isdisjoint(ids[1]) and ids[0] | ids[1] == {f"s{i}" for i in range(8)}
    for rep in plan.replicas:
        assert len(rep.micro_batches) == 2 and all(len(mb) == 2 for mb in rep.micro_batches)
        # every (sample, column) is fetched exactly once, from the shard that holds it
        got = sorted((sid, c, op.shard) for op in rep.fetches for sid in op.sample_ids
                     for c in op.columns)
        want = sorted(
            (sid, c, (("p0", "p1")[int(sid[1:]) % 2] if c == "input_ids" else "r0"))
            for sid in rep.sample_ids for c in ("input_ids", "ref_logprobs")
        )
        assert got == want
        assert len(rep.fetches) == 3  # p0, p1 and r0: one request per shard
    assert sum(r.tokens for r in plan.replicas) == sum(10 + i for i in range(8))


def test_plan_with_token_budget_balances_tokens():
    lengths = [1000, 900, 100, 100, 100, 100, 50, 50]
    plan = plan_step(lease_of(8, lengths=lengths), Layout(dp=2), TokenBudget(max_tokens=1000))
    toks = [r.tokens for r in plan.replicas]
    assert abs(toks[0] - toks[1]) <= 100
    assert len({len(r.micro_batches) for r in plan.replicas}) == 1


def test_plan_rejects_layout_that_does_not_divide_batch():
    with pytest.raises(ValueError, match="does not divide into dp=4 x micro_batch_size=1"):
        plan_step(lease_of(6), Layout(dp=4, tp=2), FixedCount(micro_batch_size=1))
