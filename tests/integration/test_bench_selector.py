"""`bench/selector.py --json --quick` (slow tier): its JSON keys and invariants: some static
configuration runs out of memory (the kernel's OOM killer in its cgroup slot) or must truncate,
the selector does neither and loses no sample (its first plan applied when the rollout is
spawned); started lean, it grows the window live, its reconfigurations counted and timed by
phase; the throughput ratio is the selector's tokens/s over the best clean static run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl.runtime.slots import SlotPool

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]


def _cgroups() -> bool:
    with SlotPool() as pool:
        return pool.memory_enforcement == "cgroup"


@pytest.mark.skipif(not _cgroups(), reason="needs writable cgroup v1 memory (root)")
def test_bench_selector_quick(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "selector.py"), "--json", "--quick",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=1400,
                       env=env, check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("oom_static", "oom_selector", "throughput_ratio_vs_best_static",
                "reconfigurations", "reconfig_seconds", "samples_lost", "final_quality"):
        assert key in res
    runs = res["runs"]
    assert set(runs) == {"static_small", "static_fast", "static_safe", "selector",
                         "selector_lean", "truncate"}
    assert runs["truncate"]["context_cut_rate"] > 0  # the learning comparison's baseline cuts
    assert res["oom_static"] is True
    assert any(r["oom"] or r["context_cut_rate"] > 0 for k, r in runs.items() if k != "selector")
    sel = runs["selector"]
    assert res["oom_selector"] is False and sel["exit_code"] == 0
    assert sel["steps_done"] == res["steps"]
    assert res["samples_lost"] == 0
    # the first plan was applied when the rollout was spawned: nothing to re-create
    assert res["reconfigurations"] == sel["reconfigurations"] == 0
    assert sel["final_window"] > res["window"]
    # started lean, the window was outgrown (the first batch's games were cut: the warm
    # policy's games are long from the start) and grown live, timed by phase, nothing lost
    lean, lean_run = res["lean"], runs["selector_lean"]
    assert lean_run["exit_code"] == 0 and lean_run["steps_done"] == res["steps"]
    assert lean["oom"] is (lean_run["context_cut_rate"] > 0) and lean["samples_lost"] == 0
    assert lean["reconfigurations"] == lean_run["reconfigurations"] >= 1
    assert lean["reconfig_seconds"]["total_s"] > 0
    assert lean_run["final_window"] > res["window"]
    best = res["best_static"]
    assert best and not runs[best]["oom"] and runs[best]["context_cut_rate"] == 0
    ratio = sel["tokens_per_s"] / runs[best]["tokens_per_s"]
    assert res["throughput_ratio_vs_best_static"] == pytest.approx(ratio, abs=1e-3)
    assert set(res["final_quality"]) == set(runs)
