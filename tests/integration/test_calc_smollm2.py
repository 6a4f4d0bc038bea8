"""`earl train --recipe calc_smollm2` end to end for two steps: SmolLM2-135M with LoRA, the
warm start, vLLM serving the merged weights, the JSON contract of the other recipes; and the
same task as a user's OpenAI-client agent from its run file (`agents/openai_calc_smollm2.yaml`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

# 3 groups a step: the two steps hold all six wordings once (`CalcTasks(cycle=True)`), so some
# group almost always has rewards that differ (a gradient); 2 groups a step could all agree.
SMALL = ["--steps=2", "--warm_start.steps=6", "--batch_size=12", "--group_size=4",
         "--eval_games=8", "--checkpoint_every=1"]


ROOT = Path(__file__).resolve().parents[2]


# the OpenAI-client agent's case is soak (~115 s): CI trains that agent on the tiny model
# (test_train_user_agent.py) and runs it on SmolLM2 (test_openai_endpoint.py)
@pytest.mark.parametrize("what", [["--recipe", "calc_smollm2"],
                                  pytest.param(["--config", "agents/openai_calc_smollm2.yaml"],
                                               marks=pytest.mark.soak)],
                         ids=["recipe", "openai_client_agent"])
def test_calc_smollm2_trains_two_steps_with_lora(tmp_path: Path, what: list[str]) -> None:
    from safetensors import safe_open

    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "earl.cli", "train", *what,
                        "--output-dir", str(out), "--json", *SMALL], capture_output=True,
                       text=True, timeout=850, env=env, check=False, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["recipe"] == ("calc_smollm2" if what[0] == "--recipe" else "agent") \
        and res["steps"] == 2
    for split in ("eval", "eval_start"):
        assert res[split]["episodes"] == 8
        assert 0.0 <= res[split]["accuracy"] <= 1.0
    assert res["wall_minutes"] > 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["lora"]["rank"] > 0 and cfg["placement"]["shared_prefix"]
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["sync_s"] > 0 for r in rows)  # merged weights pushed to vLLM every step
    # the policy the run ends with is a plain checkpoint (adapters merged) that moved away from
    # the warm start exactly when a step had a gradient: a step whose every group scored alike
    # has zero advantages (GRPO) and leaves the adapters at their start
    learned = any(r["train/grad_norm"] > 0 for r in rows)
    with safe_open(str(Path(res["weights"]) / "model.safetensors"), "pt") as end, \
            safe_open(str(out / "weights_start" / "model.safetensors"), "pt") as start:
        assert not any("lora" in k or "base_layer" in k for k in end.keys())  # noqa: SIM118
        name = "model.layers.0.self_attn.q_proj.weight"
        moved = bool((end.get_tensor(name) - start.get_tensor(name)).abs().max() > 0)
    assert moved == learned, [(r["reward"], r["train/grad_norm"]) for r in rows]
