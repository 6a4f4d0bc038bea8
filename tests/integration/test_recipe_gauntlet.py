"""`earl train --recipe gauntlet` end to end on CPU (vLLM rollout, trainer, reference, the
recipe's per-game critic in the producer): a few steps with small sizes; the result carries the
recipe's metric and every trained trajectory is a gauntlet whose info agrees with its rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]


def test_train_gauntlet_a_few_steps(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--recipe", "gauntlet", "--output-dir",
         str(out), "--json", "--steps=3", "--warm_start.steps=5", "--warm_start.batch_size=4",
         "--batch_size=16", "--group_size=4", "--eval_games=4", "--checkpoint_every=100",
         "--dump_share=1"],
        capture_output=True, text=True, timeout=560, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["recipe"] == "gauntlet" and res["steps"] == 3
    assert res["target_key"] == "games_survived"
    for ev in (res["eval_start"], res["eval"]):
        assert ev["episodes"] == 4 and ev["games"] >= 1 and ev["tokens"] > 0
        assert ev["win_rate"] + ev["draw_rate"] + ev["loss_rate"] == pytest.approx(1.0)
        assert ev["illegal_rate"] <= ev["loss_rate"] + 1e-9  # an illegal move is a loss
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward" in r] == [1, 2, 3]
    trajs = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    # the dump holds every finished group, trained or still waiting when the run ended
    # (partial rollouts play ahead): 3 steps' worth at least, each sample once
    assert len(trajs) >= 3 * 16
    assert len({t["sample_id"] for t in trajs}) == len(trajs)
    for t in trajs:
        info = t["info"]
        assert t["failed"] or len(t["turn_rewards"]) == len(t["turn_spans"]) == info["moves"]
        if not t["failed"]:
            assert info["games"] == sum(r != 0 for r in t["turn_rewards"])
            assert info["survived"] == info["wins"] + info["draws"] <= info["games"]
            assert t["reward"] == pytest.approx(sum(t["turn_rewards"]))
            assert len(t["token_ids"]) <= 4096  # the recipe's max_model_len
