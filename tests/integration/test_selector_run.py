"""`earl train --selector on` end to end on connect4 (real vLLM, real trainer, cgroup slots):
the selector's first plan sets up the rollout replica it spawns; started lean
(`selector.initial_context` below the games' length), its window is outgrown and the selector
grows it before the next rollout by re-creating the vLLM replica (weights re-pushed at the
current version); every played sample is trained, and the decisions are in metrics.jsonl and
the Perfetto trace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl.runtime.slots import SlotPool

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


def _cgroups() -> bool:
    with SlotPool() as pool:
        return pool.memory_enforcement == "cgroup"


@pytest.mark.skipif(not _cgroups(), reason="needs writable cgroup v1 memory (root)")
def test_selector_grows_the_window_and_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--recipe", "connect4", "--selector", "on",
         "--output-dir", str(out), "--json", "--trace", "--steps=4", "--warm_start.steps=5",
         "--batch_size=16", "--group_size=8", "--eval_games=2", "--eval_every=0",
         "--checkpoint_every=100", "--placement.reference=0", "--placement.context_window=192",
         "--selector.initial_context=192",
         "--placement.slot_memory_mib=1500", "--placement.kv_cache_gb=0.02"],
        capture_output=True, text=True, timeout=560, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["steps"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    sel = [r for r in rows if "selector/when" in r]
    assert len(steps) == 4
    assert {r["selector/when"] for r in sel} == {"rollout", "prep"}
    assert len(sel) == 8  # one decision before each rollout and each training step
    # the first plan was applied at spawn (nothing re-created), a window for 192 tokens ahead
    assert sel[0]["selector/reconfigurations"] == 0 and sel[0]["selector/reconfig_s"] == 0
    assert 192 < sel[0]["selector/applied_max_model_len"] < 1024
    # the games outgrew that window; the selector grew it: the replica rebuilt its engine in
    # its warm process (no new process spawned)
    assert sel[-1]["selector/applied_max_model_len"] > sel[0]["selector/applied_max_model_len"]
    assert sel[-1]["selector/reconfigurations"] >= 1
    grown = [r for r in sel if r.get("selector/reconfig/rollout/rebuild_s", 0) > 0]
    assert grown and all(r["selector/reconfig/rollout/spawn_s"] == 0 for r in grown)
    # nothing lost: every played sample was trained, the dock lost none
    assert sum(r["episodes"] for r in steps) == sum(r["train/samples"] for r in steps) == 64
    assert max(r["selector/queue/lost"] for r in sel) == 0
    assert all(r["selector/slot/trainer0/peak_mib"] <= 1500 for r in sel)
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    names = [e["name"] for e in trace]
    assert "selector: switch" in names and "reconfigure" in names
