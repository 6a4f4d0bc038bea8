"""bench/stress.py --quick prints one JSON object with the targets it checks (slow)."""

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
    assert res["scale"]["sessions_lost"] == 0 and res["scale"]["sessions_completed"] == 2000
    assert res["floor_asyncio_us_per_turn"] > 0
    assert set(res["executor"]) >= {"elastic", "static", "act_mean_speedup", "worker_reduction"}
    assert set(res["targets"]) == {"sessions_10000_none_lost", "overhead_us_per_turn_le_100",
                                   "act_2x_better", "workers_50pct_fewer"}
