"""The id-run codec of the judged run's records (`earl.stages.id_runs`)."""

from __future__ import annotations

import json
import random

from earl.stages.id_runs import pack, unpack


def test_a_batch_of_ids_and_its_group_ids_pack_into_a_few_runs() -> None:
    ids = [f"b000007-p0-{i:04d}" for i in range(64)]
    groups = [f"g{8 + i // 8}" for i in range(64)]
    assert pack(ids) == [["b000007-p0-", 4, 0, 64, 1]]
    assert len(pack(groups)) == 8  # g8 x8 ... g15 x8: one repeat run each
    assert list(unpack(pack(ids))) == ids and list(unpack(pack(groups))) == groups
    assert len(json.dumps(pack(ids))) * 20 < len(json.dumps(ids))


def test_any_list_of_ids_comes_back_the_same() -> None:
    rng = random.Random(0)
    pool = ["a", "x-9", "x-09", "x-10", "g9", "g10", "g010", "b1-p0-0001", "7", "", "y-"]
    for _ in range(500):
        ids = [rng.choice(pool) for _ in range(rng.randint(0, 12))]
        ids += [f"b{rng.randint(0, 3)}-{i:0{rng.randint(1, 4)}d}" for i in range(rng.randint(0, 5))]
        if rng.random() < 0.3:
            rng.shuffle(ids)
        assert list(unpack(pack(ids))) == ids, ids


def test_records_written_before_the_codec_read_as_they_are() -> None:
    assert list(unpack(["b0-p0-0000", "b0-p0-0001"])) == ["b0-p0-0000", "b0-p0-0001"]
