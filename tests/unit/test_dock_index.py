"""Dock bookkeeping: readiness, groups, leases/acks, capacity, shard loss, restart."""

import numpy as np
import pytest

from earl.runtime.dock_index import DockIndex, LeaseError, SampleInfo, WouldBlock, merge_leases
from earl.runtime.dock_warehouse import Warehouse


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def info(sid, gid="g0", size=1, shard="w0", version=0, length=4, cols=("input_ids", "versions")):
    return SampleInfo(sample_id=sid, group_id=gid, group_size=size, length=length,
                      version=version, shard=shard, columns={c: 8 * length for c in cols})


def make(**kw):
    kw.setdefault("stages", ["ref", "train"])
    kw.setdefault("capacity", 16)
    return DockIndex(**kw)


def test_take_waits_for_columns_then_hands_each_sample_once_per_stage():
    ix = make()
    for i in range(4):
        ix.register(info(f"s{i}", gid=f"g{i}"))
    with pytest.raises(WouldBlock):
        ix.take("train", ["input_ids", "ref_logprobs"], 2)
    a = ix.take("ref", ["input_ids"], 2)
    b = ix.take("ref", ["input_ids"], 2)
    assert {x.sample_id for x in a.samples} == {"s0", "s1"}  # FIFO
    assert {x.sample_id for x in b.samples} == {"s2", "s3"}
    with pytest.raises(WouldBlock):
        ix.take("ref", ["input_ids"], 1)  # all leased by this stage
    for i in range(4):
        ix.add_columns(f"s{i}", "w1", {"ref_logprobs": 16})
    t = ix.take("train", ["input_ids", "ref_logprobs"], 4)  # other stages are independent
    assert t.fetches() == [("w0", ["s0", "s1", "s2", "s3"], ["input_ids"]),
                           ("w1", ["s0", "s1", "s2", "s3"], ["ref_logprobs"])]
    ix.ack(a.lease_id)
    with pytest.raises(LeaseError):
        ix.ack(a.lease_id)  # never acked twice
    res = ix.ack(t.lease_id)
    assert res.evict == {"w0": ["s0", "s1"], "w1": ["s0", "s1"]}  # both stages done
    assert ix.statistics().samples == 2


def test_whole_groups_only():
    ix = make()
    ix.register(info("a0", "A", 2))
    ix.register(info("b0", "B", 2))
    ix.register(info("b1", "B", 2))
    lease = ix.take("train", ["input_ids"], 2)
    assert [x.sample_id for x in lease.samples] == ["b0", "b1"]  # A incomplete
    with pytest.raises(WouldBlock):
        ix.take("train", ["input_ids"], 2)
    ix.register(info("a1", "A", 2))
    with pytest.raises(ValueError, match="n=3 is not a multiple of the group size 2"):
        ix.take("train", ["input_ids"], 3)
    assert len(ix.take("train", ["input_ids"], 2).samples) == 2


def test_expired_or_released_lease_returns_samples_and_late_ack_fails():
    clock = Clock()
    ix = make(clock=clock, lease_timeout_s=10)
    ix.register(info("s0", "A"))
    first = ix.take("train", ["input_ids"], 1)
    clock.t = 11
    again = ix.take("train", ["input_ids"], 1)  # the dead consumer's lease expired
    assert again.samples[0].sample_id == "s0"
    with pytest.raises(LeaseError):
        ix.ack(first.lease_id)  # the late consumer cannot ack what someone else holds
    ix.release(again.lease_id)
    third = ix.take("train", ["input_ids"], 1)
    ix.ack(third.lease_id)
    with pytest.raises(WouldBlock):
        ix.take("train", ["input_ids"], 1)  # acked: never handed out again


def test_capacity_backpressure_and_eviction_frees_room():
    ix = make(stages=["train"], capacity=2)
    ix.register(info("s0", "A"))
    ix.register(info("s1", "B"))
    with pytest.raises(WouldBlock):
        ix.register(info("s2", "C"))
    ix.ack(ix.take("train", ["input_ids"], 1).lease_id)
    ix.register(info("s2", "C"))
    with pytest.raises(ValueError, match="group 'C' already has 1 samples but group_size is 1"):
        ix.register(info("s3", "C"))
    with pytest.raises(ValueError, match="group_size 3 must be in \\[1, capacity=2\\]"):
        ix.register(info("s9", "G", 3))


def test_unknown_columns_and_stages_are_clear_errors():
    ix = make()
    with pytest.raises(ValueError, match="produced by nobody"):
        ix.take("train", ["input_ids", "logits"], 1)
    with pytest.raises(ValueError, match="unknown stage 'critic'"):
        ix.take("critic", ["input_ids"], 1)
    with pytest.raises(ValueError, match="produced by nobody"):
        ix.register(info("s0", cols=("pixels",)))


def test_dead_shard_requeues_whole_groups_for_reproduction_never_drops():
    ix = make()
    ix.register(info("a0", "A", 2, shard="w0"))
    ix.register(info("a1", "A", 2, shard="w1"))
    ix.register(info("b0", "B", 1, shard="w1"))
    ix.register(info("c0", "C", 1, shard="w2"))
    ix.register(info("d0", "D", 1, shard="w0"))
    lease = ix.take("train", ["input_ids"], 2)
    assert {x.group_id for x in lease.samples} == {"A"}
    assert ix.drop_shard("w0") == {}  # D is lost at once; A is leased: its consumer decides
    assert [x.sample_id for x in ix.take_lost()] == ["d0"]
    with pytest.raises(WouldBlock):  # a lost group is handed out no more
        ix.take("train", ["input_ids"], 3, whole_groups=False)
    ix.release(lease.lease_id)  # its fetch failed on the dead shard: now A is lost
    assert ix.take_evictions() == {"w1": ["a1"]}  # the surviving half goes with it
    lost = ix.take_lost()
    assert {(x.sample_id, x.group_id) for x in lost} == {("a0", "A"), ("a1", "A")}
    assert next(x for x in lost if x.sample_id == "a0").missing == ("input_ids", "versions")
    with pytest.raises(LeaseError):
        ix.ack(lease.lease_id)
    rest = ix.take("train", ["input_ids"], 2)
    assert {x.sample_id for x in rest.samples} == {"b0", "c0"}
    st = ix.statistics()
    assert st.samples == 2 and st.lost == 0 and st.leased == 2


def test_a_group_fetched_before_its_shard_died_is_acked_not_played_again():
    """The trainer fetched group A, then A's producer died (another consumer's fetch told the
    index): the trainer's ack consumes A; nothing is lost, nothing is trained twice."""
    ix = make(stages=["train"])
    ix.register(info("a0", "A", 2, shard="w0"))
    ix.register(info("a1", "A", 2, shard="w0"))
    lease = ix.take("train", ["input_ids"], 2)
    ix.drop_shard("w0")
    assert ix.ack(lease.lease_id).evict == {"w0": ["a0", "a1"]}
    assert ix.take_lost() == [] and ix.take_evictions() == {}
    assert ix.statistics().samples == 0


def test_a_retracted_column_shard_is_written_again_by_its_stage_and_nothing_is_lost():
    ix = make()
    for i in range(3):
        ix.register(info(f"s{i}", gid=f"g{i}"))
    ref = ix.take("ref", ["input_ids"], 3)
    for i in range(3):
        ix.add_columns(f"s{i}", "ref0", {"ref_logprobs": 16})
    ix.ack(ref.lease_id)
    held = ix.take("train", ["input_ids", "ref_logprobs"], 1)
    with pytest.raises(ValueError, match=r"lease\(s\) \[2\] in flight"):
        ix.retract_shard("ref0", "ref")  # the trainer still reads from it
    ix.release(held.lease_id)
    with pytest.raises(ValueError, match="registered 3 sample"):
        ix.retract_shard("w0", "ref")  # a producer's data cannot be written again
    assert ix.retract_shard("ref0", "ref") == 3
    with pytest.raises(WouldBlock):  # the columns are gone...
        ix.take("train", ["input_ids", "ref_logprobs"], 1)
    again = ix.take("ref", ["input_ids"], 3)  # ...and the stage scores them again
    assert [x.sample_id for x in again.samples] == ["s0", "s1", "s2"]
    for i in range(3):
        ix.add_columns(f"s{i}", "ref1", {"ref_logprobs": 16})
    ix.ack(again.lease_id)
    t = ix.take("train", ["input_ids", "ref_logprobs"], 3)
    assert {x.columns["ref_logprobs"] for x in t.samples} == {"ref1"}
    assert ix.ack(t.lease_id).evict == {"w0": ["s0", "s1", "s2"], "ref1": ["s0", "s1", "s2"]}
    assert ix.take_lost() == [] and ix.statistics().samples == 0


def test_version_filter_and_stale_eviction():
    ix = make()
    ix.register(info("old", "O", version=1))
    ix.register(info("new", "N", version=5))
    lease = ix.take("train", ["input_ids"], 1, min_version=3)
    assert lease.samples[0].sample_id == "new" and lease.samples[0].version == 5
    assert ix.evict_stale(3) == {"w0": ["old"]}
    assert [x.sample_id for x in ix.take_lost()] == ["old"]


def test_statistics_report_readiness_bytes_and_consumption():
    ix = make()
    ix.register(info("s0", "A", shard="w0", length=4))
    ix.register(info("s1", "B", shard="w1", length=2))
    ix.add_columns("s0", "w2", {"ref_logprobs": 16})
    ix.ack(ix.take("ref", ["input_ids"], 1).lease_id)
    st = ix.statistics()
    assert st.ready == {"input_ids": 2, "versions": 2, "ref_logprobs": 1}
    assert st.bytes_per_shard == {"w0": 64, "w1": 32, "w2": 16}
    assert st.consumed == {"ref": 1, "train": 0}


def test_index_restart_rebuilds_from_warehouses():
    w0, w1 = Warehouse("w0"), Warehouse("w1")
    ix = make()
    for i, w in enumerate([w0, w0, w1]):
        cols = {"input_ids": np.arange(3, dtype=np.int64), "versions": np.zeros(3, np.int32)}
        ix.register(w.put(f"s{i}", cols, group_id=f"g{i}"))
    w1.put("s0", {"ref_logprobs": np.zeros(3, np.float32)})
    ix.add_columns("s0", "w1", {"ref_logprobs": 12})
    res = ix.ack(ix.take("train", ["input_ids"], 1).lease_id)
    for shard, ids in res.acked.items():
        {"w0": w0, "w1": w1}[shard].mark_acked(ids, "train")
    ix.take("ref", ["input_ids"], 2)  # in flight when the index dies
    fresh = make()
    for w in (w0, w1):
        own, extra = w.report()
        fresh.restore(own, extra)
    assert fresh.location("s0") == {"input_ids": "w0", "versions": "w0", "ref_logprobs": "w1"}
    # the in-flight ref lease is forgotten -> available; train's ack survived
    assert len(fresh.take("ref", ["input_ids"], 3, whole_groups=False).samples) == 3
    assert [x.sample_id for x in fresh.take("train", ["input_ids"], 2).samples] == ["s1", "s2"]


def test_leases_from_two_index_shards_merge_into_one():
    """A step's groups spread over index shards: one lease stands for the parts, its samples in
    order, ack and release addressed to every (index rank, lease id)."""
    a = DockIndex(stages=["train"], capacity=8, index_rank=0)
    b = DockIndex(stages=["train"], capacity=8, index_rank=1)
    a.register(info("s0", "g0"))
    b.register(info("s1", "g1"))
    b.register(info("s2", "g2"))
    la, lb = a.take("train", ["input_ids"], 1), b.take("train", ["input_ids"], 1)
    merged = merge_leases([la, lb])
    assert [x.sample_id for x in merged.samples] == ["s0", "s1"]
    assert merged.issuers() == ((0, la.lease_id), (1, lb.lease_id))
    assert merge_leases([la]) is la and la.issuers() == ((0, la.lease_id),)
    with pytest.raises(ValueError, match="at least one"):
        merge_leases([])
    with pytest.raises(ValueError, match="stage or columns"):
        merge_leases([la, b.take("train", ["versions"], 1, whole_groups=False)])


def test_a_dead_column_shard_costs_only_the_columns_its_stage_added():
    """A reference's death: the ref_logprobs it added under its stage are forgotten and scored
    again; the producers' data and groups stay (nothing lost, nothing evicted); a consumer that
    already leased the samples keeps its lease (it acks once, never trains them twice)."""
    ix = make()
    ix.register(info("a0", "A", 2, shard="w0"))
    ix.register(info("a1", "A", 2, shard="w0"))
    ix.register(info("b0", "B", 1, shard="w0"))
    ref = ix.take("ref", ["input_ids"], 3, whole_groups=False, holder="ref0")
    for sid in ("a0", "a1", "b0"):
        ix.add_columns(sid, "ref0", {"ref_logprobs": 16}, stage="ref")
    ix.ack(ref.lease_id)
    held = ix.take("train", ["input_ids", "ref_logprobs"], 1, whole_groups=False)
    assert [x.sample_id for x in held.samples] == ["a0"]
    assert ix.drop_shard("ref0") == {}
    assert ix.take_lost() == [] and ix.statistics().samples == 3
    assert ix.statistics().ready.get("ref_logprobs", 0) == 0
    with pytest.raises(WouldBlock):  # the trainer waits for the new scores
        ix.take("train", ["input_ids", "ref_logprobs"], 2)
    again = ix.take("ref", ["input_ids"], 3, whole_groups=False, holder="ref0")
    assert sorted(x.sample_id for x in again.samples) == ["a0", "a1", "b0"]
    for sid in ("a0", "a1", "b0"):
        ix.add_columns(sid, "ref0", {"ref_logprobs": 16}, stage="ref")
    ix.ack(again.lease_id)
    ix.ack(held.lease_id)  # the step that read a0 before the death still acks it
    rest = ix.take("train", ["input_ids", "ref_logprobs"], 2, whole_groups=False)
    assert sorted(x.sample_id for x in rest.samples) == ["a1", "b0"]


def test_unnamed_added_columns_lose_their_groups_when_the_shard_dies():
    ix = make()
    ix.register(info("a0", "A", 1, shard="w0"))
    with pytest.raises(ValueError, match="unknown stage"):
        ix.add_columns("a0", "w1", {"ref_logprobs": 16}, stage="critic")
    ix.add_columns("a0", "w1", {"ref_logprobs": 16})  # no stage named: cannot be rewritten
    ix.drop_shard("w1")
    assert [x.sample_id for x in ix.take_lost()] == ["a0"]


def test_a_lost_groups_replay_is_admitted_to_a_dock_that_later_batches_filled():
    """The 2-hour soak's end: a producer died, later batches' puts took the room its group
    left, and the re-play of that group (which the trainer waits for) waited for room that
    only the trainer could make. The re-play is admitted past capacity, as many samples as
    were lost; a fresh put still waits."""
    ix = make(stages=["train"], capacity=4)
    for sid, gid, shard in [("a0", "A", "w0"), ("a1", "A", "w0"), ("b0", "B", "w1"),
                            ("b1", "B", "w1")]:
        ix.register(info(sid, gid, 2, shard=shard))
    ix.drop_shard("w0")
    assert {x.group_id for x in ix.take_lost()} == {"A"}
    ix.register(info("c0", "C", 2, shard="w1"))  # a later batch takes A's room
    ix.register(info("c1", "C", 2, shard="w1"))
    with pytest.raises(WouldBlock):
        ix.register(info("d0", "D", 2, shard="w1"))
    ix.register(info("a0x", "A", 2, shard="w2"))  # the re-play
    ix.register(info("a1x", "A", 2, shard="w2"))
    assert ix.statistics().samples == 6
    lease = ix.take("train", ["input_ids"], 6)
    assert {x.group_id for x in lease.samples} == {"A", "B", "C"}
    with pytest.raises(WouldBlock):  # no more than it lost
        ix.register(info("a2x", "A", 3, shard="w2"))
