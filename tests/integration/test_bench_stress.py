"""bench/stress.py --quick: its JSON schema and invariants (slow tier)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "stress.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_stress_quick() -> None:
    out = subprocess.run([sys.executable, str(BENCH), "--quick", "--json"], check=True,
                         capture_output=True, text=True, timeout=280).stdout
    res = json.loads(out)
    assert res["bench"] == "stress" and res["quick"] is True
    scale = res["scale"]
    assert "sessions_lost" not in scale
    # the simulated model plays (sometimes illegal) moves: games are lost, sessions never fail
    assert scale["sessions"] == 2000
    assert scale["sessions_completed"] == 2000 and scale["sessions_failed"] == 0
    assert scale["turns"] >= 2000  # at least one move per game
    assert scale["turns_per_s"] * scale["wall_s"] == pytest.approx(scale["turns"], rel=0.01)
    # the runtime's CPU per turn cannot be below bare asyncio's timer wake-up per turn
    assert scale["overhead_us_per_turn"] > res["floor_asyncio_us_per_turn"] > 0
    ex = res["executor"]
    el, st = ex["elastic"], ex["static"]
    assert el["sessions_completed"] == st["sessions_completed"] == 128
    assert el["workers_peak"] <= 8 and st["workers_peak"] <= 16
    assert ex["act_mean_speedup"] == pytest.approx(st["act_mean_ms"] / el["act_mean_ms"],
                                                   rel=0.01)
    assert res["targets"] == {
        "sessions_10000_all_completed": False,  # --quick runs 2,000
        "overhead_us_per_turn_le_100": scale["overhead_us_per_turn"] <= 100,
        "act_2x_better": ex["act_mean_speedup"] >= 2,
        "workers_50pct_fewer": ex["worker_reduction"] >= 0.5}
