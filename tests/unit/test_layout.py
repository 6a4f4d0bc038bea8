"""Layouts, micro-batch rules, length balancing and CP sharding."""

import numpy as np
import pytest

from earl.runtime.layout import (
    FixedCount,
    Layout,
    RankCoord,
    TokenBudget,
    assign_micro_batches,
    balance,
    cp_shard,
    pack,
)


def test_rank_order_is_tp_cp_dp_pp_and_round_trips():
    lay = Layout(dp=2, tp=2, pp=2, cp=2)
    assert lay.world_size == 16
    assert lay.coord(0) == RankCoord(dp=0, tp=0, pp=0, cp=0)
    assert lay.coord(1) == RankCoord(dp=0, tp=1, pp=0, cp=0)
    assert lay.coord(2) == RankCoord(dp=0, tp=0, pp=0, cp=1)
    assert lay.coord(4) == RankCoord(dp=1, tp=0, pp=0, cp=0)
    assert lay.coord(8) == RankCoord(dp=0, tp=0, pp=1, cp=0)
    assert all(lay.rank(lay.coord(r)) == r for r in range(16))
    # a replica spans every TP/CP/PP rank of one DP index, and replicas partition the world
    reps = [lay.replica(d) for d in range(2)]
    assert reps[0] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert sorted(reps[0] + reps[1]) == list(range(16))
    assert lay.leader(1) == 4


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "cp"])
def test_bad_layout_names_the_field(field):
    kw = {"dp": 1, field: 0}
    with pytest.raises(ValueError, match=f"layout.{field}"):
        Layout(**kw)


def test_fixed_count_equal_counts_and_balanced_tokens():
    rng = np.random.default_rng(0)
    lengths = rng.integers(10, 1000, size=64).tolist()
    out = assign_micro_batches(lengths, Layout(dp=4, tp=2), FixedCount(micro_batch_size=4))
    assert len(out) == 4
    flat = sorted(i for dp in out for mb in dp for i in mb)
    assert flat == list(range(64))
    for dp in out:
        assert len(dp) == 4 and all(len(mb) == 4 for mb in dp)
    sums = [sum(lengths[i] for mb in dp for i in mb) for dp in out]
    naive = [sum(lengths[i * 16 : (i + 1) * 16]) for i in range(4)]
    assert max(sums) - min(sums) <= max(lengths)  # LPT bound
    assert max(sums) - min(sums) <= max(naive) - min(naive)


def test_fixed_count_rejects_batches_that_do_not_divide():
    with pytest.raises(ValueError, match="does not divide.*multiple of 8"):
        assign_micro_batches([5] * 10, Layout(dp=2), FixedCount(micro_batch_size=4))
    with pytest.raises(ValueError, match="cannot feed layout.dp=4"):
        assign_micro_batches([5] * 3, Layout(dp=4), TokenBudget(max_tokens=100))


def test_token_budget_packs_within_budget_with_equal_micro_batch_counts():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 512, size=50).tolist()
    out = assign_micro_batches(lengths, Layout(dp=3), TokenBudget(max_tokens=1024))
    counts = {len(dp) for dp in out}
    assert len(counts) == 1
    assert sorted(i for dp in out for mb in dp for i in mb) == list(range(50))
    assert all(sum(lengths[i] for i in mb) <= 1024 for dp in out for mb in dp)
    # packing is tight-ish: not more micro-batches than 2x the lower bound per rank
    per_rank = max(sum(lengths[i] for mb in dp for i in mb) for dp in out)
    assert counts.pop() <= 2 * -(-per_rank // 1024) + 1


def test_token_budget_rejects_sample_longer_than_budget():
    with pytest.raises(ValueError, match="sample 1 has 300 tokens > token budget 256"):
        assign_micro_batches([10, 300], Layout(dp=1), TokenBudget(max_tokens=256))


def test_balance_and_pack_helpers():
    parts = balance([9, 8, 7, 1, 1, 1], 2, equal_counts=True)
    assert sorted(len(p) for p in parts) == [3, 3]
    sums = sorted(sum([9, 8, 7, 1, 1, 1][i] for i in p) for p in parts)
    assert sums == [11, 16]  # the optimum for these counts
    bins = pack([6, 5, 4, 3, 2], range(5), 10)
    assert sorted(sorted(b) for b in bins) == [[0, 2], [1, 3, 4]]


def test_cp_shard_zigzag_covers_sequence_once():
    x = np.arange(16)
    shards = [cp_shard(x, r, 2) for r in range(2)]
    assert shards[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert sorted(np.concatenate(shards).tolist()) == list(range(16))
    with pytest.raises(ValueError, match="multiple of 2\\*cp=4"):
        cp_shard(np.arange(10), 0, 2)
