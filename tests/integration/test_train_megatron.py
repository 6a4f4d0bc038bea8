"""`earl train --placement.backend=megatron` on CPU with megatron-core's tensor parallel or
pipeline stages (2 ranks over gloo): it trains, checkpoints one shard file per TP rank and
stage, and resumes from them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

ARGS = ["--warm_start.steps=5", "--batch_size=16", "--group_size=4", "--eval_games=20",
        "--checkpoint_every=2", "--placement.backend=megatron", "--placement.trainer=2"]


def _train(out: Path, layout: str, *args: str) -> dict:  # type: ignore[type-arg]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "earl.cli", "train", "--output-dir", str(out),
                        "--json", layout, *args, *ARGS], capture_output=True, text=True, timeout=500,
                       env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize(("layout", "shards"), [
    ("--placement.trainer_tp=2", ["megatron_tp0.pt", "megatron_tp1.pt"]),
    ("--placement.trainer_pp=2", ["megatron_tp0_pp0.pt", "megatron_tp0_pp1.pt"]),
], ids=["tp2", "pp2"])
def test_megatron_trains_checkpoints_and_resumes(tmp_path: Path, layout: str,
                                                 shards: list[str]) -> None:
    out = tmp_path / "run"
    res = _train(out, layout, "--steps=3")
    assert res["steps"] == 3 and (Path(res["weights"]) / "config.json").is_file()
    assert sorted(p.name for p in Path(res["checkpoint"]).rglob("megatron_tp*.pt")) == shards
    res = _train(out, layout, "--steps=4", "--resume")
    assert res["steps"] == 4
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
