"""`bench/peers.py --json --quick` (slow tier): EARL and TRL's GRPOTrainer side by side on the
multi-turn agentic task. Checks the JSON schema and the invariants that tie the figures
together: both sides ran several steps under the same budget (each process at least `budget_s`
old at the stop), played episodes of the same turn distribution, the ratios are the quotients
of the reported rates against TRL's fastest configuration, tokens/s is trajectories/s times a
generated length within `max_tokens` per turn, the eval's full-score share cannot exceed its
mean reward, and the whole-tree memory sampling saw the processes; the same for EARL with
over-sampled groups, whose ratios are taken against the same TRL runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# soak: ~11.5 min (six 100 s runs plus start-ups), a third of the slow tier: not in CI
# (docs/testing.md); run it with `pytest -m soak` when bench/peers.py or its workload changes
pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.vllm, pytest.mark.timeout(1900)]
ROOT = Path(__file__).resolve().parents[2]
KEYS = {"trajectories_per_s", "tokens_per_s", "seconds_to_threshold", "final_eval",
        "peak_rss_mb"}


def test_bench_peers_quick() -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--json", "--quick"],
                       capture_output=True, text=True, timeout=1800, env=env, check=False,
                       cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    earl, trl, over = res["earl"], res["trl_best"], res["earl_over_sampled"]
    max_tokens, batch = res["recipe"]["max_tokens"], res["recipe"]["batch_size"]
    for side in (earl, trl, over):
        # TRL's gen_len_mean is the mean of its per-step means (`completions/mean_length`) and
        # its turns_mean a mean over all episodes: weighted differently, so the bound
        # gen_len <= max_tokens * turns holds per step, not exactly across steps
        slack = 1.05 if side is trl else 1.0
        assert KEYS <= set(side)
        assert len(side["runs"]) == res["rounds"] == 1
        run = side["runs"][0]
        assert run["steps"] >= 3
        assert run["wall_s"] >= res["budget_s"]  # trained until the shared budget, then stopped
        assert 1.0 <= run["turns_mean"] <= 12  # bench/_agentic_workload.py's MAX_TURNS
        assert run["turns_mean"] <= run["gen_len_mean"] <= max_tokens * run["turns_mean"] * slack
        assert run["tokens_per_s"] == pytest.approx(
            run["trajectories_per_s"] * run["gen_len_mean"], rel=0.01)
        # end-to-end counts every step over the whole process wall time
        assert run["trajectories_per_s_end_to_end"] == pytest.approx(
            run["steps"] * batch / run["wall_s"], rel=0.02)
        ev = side["final_eval"]
        assert set(ev) == {"reward", "accuracy"} and ev["accuracy"] <= ev["reward"] + 1e-9
        hit = side["seconds_to_threshold"]
        assert hit is None or hit <= run["wall_s"]
        assert side["peak_rss_mb"] > 150  # a Python process with torch loaded, at least
        assert side["turns_per_s"] == pytest.approx(
            run["trajectories_per_s"] * run["turns_mean"], rel=0.01)
    assert earl["runs"][0]["stopped"] == over["runs"][0]["stopped"] == "time_limit"
    assert res["task"] == "agentic"
    # the same task on both sides: mean turns per trajectory agree (~150 groups each)
    assert earl["turns_mean"] == pytest.approx(trl["turns_mean"], rel=0.35)
    # TRL is compared in its fastest configuration of those measured: GRPOTrainer in both
    # multi-turn paces (each episode at its own pace, and turn by turn), on-policy and EARL's
    # staleness bound (AsyncGRPOTrainer is off in --quick)
    tried = {(r["config"]["trainer"], r["config"]["pace"], r["config"]["steps_per_generation"],
              r["config"]["max_staleness"]) for r in res["trl_runs"]}
    lag = res["earl_max_policy_lag"]
    assert tried == {("GRPOTrainer", p, g, g - 1)
                     for p in ("episode", "turn") for g in (1, lag + 1)}
    assert all(r["seconds"] == res["budget_s"] for r in res["trl_runs"])
    assert trl["trajectories_per_s"] == max(r["trajectories_per_s"] for r in res["trl_runs"])
    run = trl["runs"][0]
    assert {k: run[k] for k in ("trainer", "pace", "threads", "steps_per_generation",
                                "queue_maxsize", "gradient_checkpointing", "generation")} == \
        {k: v for k, v in trl["config"].items() if k != "max_staleness"}
    assert res["ratio_trajectories_per_s"] == pytest.approx(
        earl["trajectories_per_s"] / trl["trajectories_per_s"], rel=0.02)
    assert res["ratio_trajectories_per_cpu_s"] == pytest.approx(
        earl["trajectories_per_cpu_s"] / trl["trajectories_per_cpu_s"], rel=0.02)
    assert res["eval"] == {"earl": earl["final_eval"], "trl_best": trl["final_eval"]}
    assert res["ratio_tokens_per_s"] == pytest.approx(
        earl["tokens_per_s"] / trl["tokens_per_s"], rel=0.02)
    assert res["quality_delta"] == pytest.approx(
        earl["final_eval"]["reward"] - trl["final_eval"]["reward"], abs=2e-3)
    assert res["ratio_turns_per_s"] == pytest.approx(
        earl["turns_per_s"] / trl["turns_per_s"], rel=0.02)
    # EARL over-sampled: the same TRL runs are its baseline, its ratios are its own rates'
    assert over["over_sample_groups"] == 2
    for key in ("trajectories_per_s", "turns_per_s", "tokens_per_s"):
        assert over[f"ratio_{key}"] == pytest.approx(over[key] / trl[key], rel=0.02)
    assert over["quality_delta"] == pytest.approx(
        over["final_eval"]["reward"] - trl["final_eval"]["reward"], abs=2e-3)
