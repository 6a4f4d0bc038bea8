"""A bounded trajectory dump: a sampled share of whole groups, failures always, rotated into
gzip segments and capped; `earl inspect` reads the segments and the live file in order."""

from __future__ import annotations

import json
import random
from pathlib import Path

from earl.commands.inspect import _load
from earl.stages.dump import TrajectoryDump, dump_files


def test_a_share_of_whole_groups_is_sampled_and_failures_always(tmp_path: Path) -> None:
    d = TrajectoryDump(tmp_path / "t.jsonl", share=0.25)
    kept = {(s, g) for s in range(100) for g in ("g0", "g1", "g2", "g3") if d.wants(s, g)}
    assert 60 <= len(kept) <= 140  # ~100 of 400 groups
    assert kept == {(s, g) for s in range(100) for g in ("g0", "g1", "g2", "g3")
                    if TrajectoryDump(tmp_path / "u.jsonl", share=0.25).wants(s, g)}
    assert all(d.wants(s, "g0", failed=True) for s in range(100))
    assert all(TrajectoryDump(tmp_path / "v.jsonl").wants(s, "g0") for s in range(100))


def test_rotated_segments_keep_the_dump_under_its_cap_and_read_back_in_order(
        tmp_path: Path) -> None:
    live = tmp_path / "trajectories.jsonl"
    cap = 64 * 1024
    d = TrajectoryDump(live, max_bytes=cap)
    rng = random.Random(0)
    for i in range(2000):  # ~1 MB of poorly compressible lines: many rotations
        d.write([{"sample_id": f"s{i}", "step": i, "pad": rng.randbytes(250).hex()}])
    d.close()
    files = dump_files(live)
    assert files[-1] == live and all(f.suffix == ".gz" for f in files[:-1])
    assert sum(f.stat().st_size for f in files) <= cap
    recs = _load(tmp_path)
    steps = [r["step"] for r in recs]
    assert steps == sorted(steps) and steps[-1] == 1999  # the newest kept, oldest dropped
    assert steps == list(range(steps[0], 2000))  # nothing missing in between
    assert steps[0] > 0


def test_a_dump_without_a_cap_keeps_one_plain_file(tmp_path: Path) -> None:
    live = tmp_path / "trajectories.jsonl"
    d = TrajectoryDump(live)
    d.write([{"sample_id": "a", "step": 1}, {"sample_id": "b", "step": 1}])
    d.close()
    assert dump_files(live) == [live]
    assert [json.loads(x)["sample_id"] for x in live.read_text().splitlines()] == ["a", "b"]
