"""A live re-layout in `earl train` (slow tier): a device moves from the rollout to the trainer
mid-run and the trainer's layout changes from one rank to two data-parallel ranks.

The run has `placement.devices=3` (cgroup slots of equal memory and CPU share); a policy
plugged in by `selector.policy_factory` (`relayout_policy.py`) keeps 2 rollout replicas on
devices 0-1 and the trainer on device 2 for the first steps, then gives device 1 to the
trainer (DP 2, recomputing activations). Asserted: the move happened once, mid-run, by
re-creating both groups (the trainer resharded from its checkpoint); no sample was lost (every
played episode trained, the dock lost none); policy versions only grow; and after the move the
dispatcher planned each step for 2 data-parallel replicas, whose ranks ran in their devices."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl.runtime.slots import SlotPool

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]
HERE = Path(__file__).resolve().parent


def _cgroups() -> bool:
    with SlotPool() as pool:
        return pool.memory_enforcement == "cgroup"


def _train(out: Path, factory: str, steps: int, *args: str
           ) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """`earl train` on connect4 with the scripted policy `factory` of relayout_policy.py;
    returns its trained rows and its selector rows."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--recipe", "connect4", "--selector", "on",
         f"--selector.policy_factory={HERE / 'relayout_policy.py'}:{factory}",
         "--output-dir", str(out), "--json", f"--steps={steps}", "--warm_start.steps=5",
         "--batch_size=16", "--group_size=8", "--eval_games=2", "--eval_every=0",
         "--checkpoint_every=100", "--placement.rollout=2", "--placement.slot_memory_mib=1500",
         "--placement.kv_cache_gb=0.02", "--max_policy_lag=1", *args],
        capture_output=True, text=True, timeout=840, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["steps"] == steps
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "reward" in r], [r for r in rows if "selector/when" in r]


@pytest.mark.skipif(not _cgroups(), reason="needs writable cgroup v1 memory (root)")
def test_a_device_moves_to_the_trainer_mid_run_and_nothing_is_lost(tmp_path: Path) -> None:
    steps = 5
    trained, sel = _train(tmp_path / "run", "factory", steps, "--placement.reference=0",
                          "--placement.devices=3")
    assert len(trained) == steps and len(sel) == 2 * steps
    # the layout moved once, one way: 2 replicas and one trainer rank, then one and DP 2
    dp = [r["selector/applied_trainer_dp"] for r in sel]
    replicas = [r["selector/applied_rollout_replicas"] for r in sel]
    assert dp == sorted(dp) and dp[0] == 1 and dp[-1] == 2
    assert replicas == sorted(replicas, reverse=True) and replicas[0] == 2 and replicas[-1] == 1
    assert all(r["selector/applied_recompute"] == (r["selector/applied_trainer_dp"] == 2)
               for r in sel)
    last = sel[-1]
    assert last["selector/trainer_layout_changes"] == 1
    assert last["selector/rollout_layout_changes"] == 1
    assert last["selector/device_moves"] == 1  # device1: rollout -> trainer
    moved = [r for r in sel if r.get("selector/reconfig/trainer/total_s", 0) > 0]
    assert len(moved) == 1 and moved[0]["selector/reconfig/rollout/total_s"] > 0
    assert 0 < moved[0]["selector/step"] < steps - 1  # mid-run
    # the dispatcher planned each step for the trainer layout in force when it trained
    prep = {r["selector/step"]: r for r in sel if r["selector/when"] == "prep"}
    assert [int(r["train/dispatch_replicas"]) for r in trained] == \
        [prep[r["step"] - 1]["selector/applied_trainer_dp"] for r in trained]
    assert int(trained[-1]["train/dispatch_replicas"]) == 2
    # nothing lost, versions only grow
    assert sum(r["episodes"] for r in trained) == sum(r["train/samples"] for r in trained)
    assert sum(r["episodes"] for r in trained) == 16 * steps
    assert max(r["selector/queue/lost"] for r in sel) == 0
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    # the trainer's two ranks live in devices 1 and 2 now (charged by the kernel there: their
    # weights and optimizer state; a warm host's imports stay charged where they were made)
    assert last["selector/slot/device1/used_mib"] > 20
    assert last["selector/slot/device2/used_mib"] > 20


@pytest.mark.skipif(not _cgroups(), reason="needs writable cgroup v1 memory (root)")
def test_a_device_moves_from_the_rollout_to_the_reference_mid_run_and_nothing_is_lost(
        tmp_path: Path) -> None:
    """With a KL term the reference has devices the selector plans: a scripted policy gives
    it the rollout's device 1 mid-run (DP 2). Its old rank's ``ref_logprobs`` are scored
    again by the new ranks, so every episode trains and the dock loses none."""
    steps = 4
    trained, sel = _train(tmp_path / "run", "reference_factory", steps,
                          "--algorithm.kl_coef=0.01", "--placement.reference=1",
                          "--placement.devices=4")
    ranks = [r["selector/applied_reference_ranks"] for r in sel]
    assert ranks == sorted(ranks) and ranks[0] == 1 and ranks[-1] == 2
    moved = [r for r in sel if r.get("selector/reconfig/reference/total_s", 0) > 0]
    assert len(moved) == 1 and 0 < moved[0]["selector/step"] < steps - 1  # once, mid-run
    assert sel[-1]["selector/device_moves"] == 1  # device1: rollout -> reference
    assert sel[-1]["selector/trainer_layout_changes"] == 0
    # nothing lost: every played episode trained, with its reference log-probs
    assert sum(r["episodes"] for r in trained) == sum(r["train/samples"] for r in trained)
    assert sum(r["episodes"] for r in trained) == 16 * steps
    assert max(r["selector/queue/lost"] for r in sel) == 0
    assert [r["step"] for r in trained] == list(range(1, steps + 1))
    # the KL term ran every step: a number in the k3 estimator's range (>= 0, clamped at 10;
    # float rounding may dip a hair below 0), never NaN or missing
    kl = [r.get("train/kl", math.nan) for r in trained]
    assert all(math.isfinite(k) and -1e-6 <= k <= 10 for k in kl), kl
    assert sel[-1]["selector/slot/device1/used_mib"] > 20  # a reference rank lives there
