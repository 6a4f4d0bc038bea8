"""Colocation on a GPU with vLLM's CUDA build (skipped without it: the lent machines so far have
no vLLM): the engine's sleep releases its GPU memory and a weight load while asleep lands (the
colocated publish), then a colocated `earl train` on one GPU, weights by CUDA IPC."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


async def test_vllm_sleeps_wakes_and_loads_weights_while_asleep() -> None:
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build (.ci/install --cuda)")
    from safetensors.torch import load_file

    from earl.engine import SamplingParams
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    a, b = default_model_dir(init_std=0.2, seed=0), default_model_dir(init_std=0.2, seed=1)
    prompt, greedy = [1, 50, 51, 52], SamplingParams(max_tokens=16, temperature=0.0)
    eng = VLLMEngine(EngineConfig(model=str(a), compute=Compute(dtype="float32", device="cuda"),
                                  max_model_len=512, gpu_memory_mib=4096, sleep_mode=True))
    await eng.start()
    try:
        before = await eng.generate(prompt, greedy)
        used_awake = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        assert await eng.sleep()
        used_asleep = torch.cuda.mem_get_info()[1] - torch.cuda.mem_get_info()[0]
        assert used_asleep < used_awake - (1 << 30)  # the KV cache (most of 4 GiB) is gone
        await eng.update_weights(load_file(b / "model.safetensors"))  # wakes the weights only
        assert await eng.wake()
        after = await eng.generate(prompt, greedy)
        assert after.token_ids != before.token_ids and after.versions[0] == 1
    finally:
        await eng.close()


def test_colocated_earl_train_on_one_gpu(tmp_path: Path) -> None:
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build (.ci/install --cuda)")
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--output-dir", str(out), "--json",
         "--trace", "--steps=3", "--warm_start.steps=5", "--batch_size=16", "--group_size=4",
         "--eval_games=20", "--placement.device=cuda", "--placement.colocate=true",
         "--placement.rollout_slot_memory_mib=8192"],
        capture_output=True, text=True, timeout=540, env=env, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 3
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert all(r.get("transport/weights_bytes/ipc", 0) > 0 for r in rows)
    names = {e["name"] for e in json.loads(Path(res["trace"]).read_text())["traceEvents"]}
    assert {"colocate_rollout", "colocate_train"} <= names
