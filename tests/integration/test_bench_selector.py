"""`bench/selector.py` (slow tier), cut to three short runs on the gauntlet: one static
configuration, the truncating baseline and the selector. Its JSON keys and invariants: each
static run finishes its step budget or is OOM-killed in its device (never counted so for a
cut); the best static run in hindsight neither OOMs nor cuts below the model's positions; the ratios are the selector's
trained tokens/s over theirs; the selector finishes, loses no sample, and its counters and
reconfiguration times come from its own rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl.runtime.slots import SlotPool

# soak: ~280 s, a tenth of the slow tier, for the invariants of a bench run in full whenever
# its figures are measured (docs/testing.md)
pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.vllm, pytest.mark.timeout(1500)]
ROOT = Path(__file__).resolve().parents[2]
STATIC = "static/d2/r1-t1/w4096/mb64k"


def _cgroups() -> bool:
    with SlotPool() as pool:
        return pool.memory_enforcement == "cgroup"


@pytest.mark.skipif(not _cgroups(), reason="needs writable cgroup v1 memory (root)")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the sweep's names assume 2 cores")
def test_bench_selector_short(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "selector.py"), "--json", "--quick",
                        "--steps=4", "--eval=4", f"--only={STATIC}", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=1400, env=env, check=False,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    for key in ("static_runs", "best_static_hindsight", "step0_pick",
                "throughput_ratio_vs_best_static", "throughput_ratio_vs_step0_pick",
                "best_static_same_devices", "throughput_ratio_vs_best_static_same_devices",
                "best_static_matched", "matched_ratio_vs_best_static",
                "matched_ratio_vs_step0_pick",
                "context_growth", "reconfigurations", "trainer_layout_changes",
                "rollout_layout_changes", "device_moves", "reconfig_seconds_median",
                "samples_lost", "oom_selector", "selector_outcome", "selector_cut_rate",
                "selector_cut_rate_below_model", "final_eval", "goals"):
        assert key in res
    statics = res["static_runs"]
    assert set(statics) == {STATIC, res["truncate"]}
    for run in statics.values():
        assert run["outcome"] in ("finished", "oom"), run["error"]
        assert run["steps"] == 4 or run["outcome"] == "oom"
        assert (run["oom_step"] is None) is (run["outcome"] == "finished")
    best = res["best_static_hindsight"]
    if best:
        # cut at most at the model's positions (4,096: this static run's window), never below
        assert statics[best]["outcome"] == "finished"
        assert statics[best]["cut_rate_below_model"] == 0
        ratio = res["selector_run"]["tokens_per_s"] / statics[best]["tokens_per_s"]
        assert res["throughput_ratio_vs_best_static"] == pytest.approx(ratio, abs=1e-3)
    same = res["best_static_same_devices"]  # the static run here has 2 devices, the selector 4
    assert same == "" or statics[same]["devices"] == res["selector_run"]["devices"]
    sel = res["selector_run"]
    assert sel["outcome"] == "finished" and sel["steps"] == 4
    assert res["samples_lost"] == 0 and res["oom_selector"] is False
    # its window is pre-sized at the model's positions: any cut is there, none below
    assert res["selector_cut_rate_below_model"] == 0 <= res["selector_cut_rate"]
    assert len(sel["reconfig_seconds"]) <= res["reconfigurations"]  # one per timed change
    assert set(res["final_eval"]) == {"selector", "truncate"}
    assert res["final_eval"]["selector"]["episodes"] == 4
