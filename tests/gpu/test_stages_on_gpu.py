"""Every stage on its own GPU (issue 28): the trainer rank's device, the reference and vLLM on
CUDA, the tied LM head after a reload on CUDA, ranks in GPU slots on distinct GPUs (skipped
without CUDA; the vLLM test needs vLLM's CUDA build, the slot tests two GPUs and pyzmq)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from earl.models.tiny import default_model_dir
from earl.stages import trainer_dist as tdist
from earl.stages.compute import Compute
from earl.stages.reference import ReferenceConfig, ReferenceModel
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig
from earl.stages.vllm_build import reload_worker

FP32_GPU = Compute(device="cuda", dtype="float32")  # not "auto" (bf16 on CUDA)

pytestmark = pytest.mark.gpu


def two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")


def make_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, n in enumerate((12, 40, 7, 25)):
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 if k % 2 else -1.0)})
    return TrainBatch.from_samples(samples)


def test_a_trainer_rank_takes_its_own_gpu_and_makes_it_current(model_dir: Path) -> None:
    t = TorchTrainer(TrainerConfig(model=str(model_dir), compute=FP32_GPU), rank=0,
                     world_size=1)
    assert t.device == tdist.cuda_device(0) == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0
    assert next(t.module.parameters()).device == t.device


@pytest.mark.parametrize(("dtype", "tol"), [("float32", 1e-4), ("bfloat16", 0.15)])
def test_reference_on_cuda_matches_cpu(model_dir: Path, dtype: str, tol: float) -> None:
    rng = np.random.default_rng(0)
    samples = [rng.integers(7, 263, n) for n in (5, 40, 17)]
    cpu = ReferenceModel(ReferenceConfig(model=str(model_dir))).logprobs(samples)
    gpu_ref = ReferenceModel(ReferenceConfig(model=str(model_dir),
                                             compute=Compute(device="cuda", dtype=dtype)))
    assert next(gpu_ref.model.parameters()).is_cuda
    for a, b in zip(gpu_ref.logprobs(samples), cpu, strict=True):
        assert a.dtype == np.float32 and a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=tol, rtol=0.05)


def test_tied_head_is_retied_on_cuda_without_cpu_repacking() -> None:
    embed = torch.nn.Embedding(4, 2, device="cuda")
    head = torch.nn.Linear(2, 4, bias=False, device="cuda")
    model = SimpleNamespace(lm_head=head, model=SimpleNamespace(embed_tokens=embed))
    worker = SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda: model),
                             reload_weights=lambda **kw: None)
    reload_worker(worker, items=[], path=None, tied=True)  # no vLLM import on this path
    assert model.lm_head.weight is embed.weight


@pytest.mark.timeout(300)
async def test_vllm_on_cuda_serves_the_slot_budget_and_reloads_tied_weights() -> None:
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build (.ci/install --cuda)")
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from earl.engine import SamplingParams
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    a = default_model_dir(init_std=0.2, seed=0)
    b = default_model_dir(init_std=0.2, seed=1)
    prompt = [1, 50, 51, 52]
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    eng = VLLMEngine(EngineConfig(model=str(a), compute=Compute(dtype="float32", device="cuda"),
                                  max_model_len=512, gpu_memory_mib=4096))
    await eng.start()
    try:
        free, total = torch.cuda.mem_get_info()
        assert total - free < (4096 + 1024) << 20  # the slot's budget, not 90% of the GPU
        before = await eng.generate(prompt, greedy)
        await eng.update_weights(load_file(b / "model.safetensors"), mode="drain")
        after = await eng.generate(prompt, greedy)
    finally:
        await eng.close()
    hf_b = AutoModelForCausalLM.from_pretrained(b).eval()
    ids = torch.tensor([prompt + after.token_ids])
    with torch.no_grad():
        lp = hf_b(ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)
    assert after.token_ids != before.token_ids
    for i, t in enumerate(after.token_ids):  # B's greedy path, its tied LM head included
        assert float(lp[i, t]) >= float(lp[i].max()) - 1e-3


async def test_keep_kv_load_on_cuda_runs_without_async_scheduling() -> None:
    """An "inflight_keep_kv" load on CUDA: refused while async scheduling is on (a batch would
    be in flight across it); without it the running request is not preempted and every token
    after the load carries the new version."""
    pytest.importorskip("vllm", reason="needs vLLM's CUDA build (.ci/install --cuda)")
    import asyncio

    from safetensors.torch import load_file

    from earl.engine import SamplingParams
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    a = default_model_dir(init_std=0.2, seed=0)
    new = load_file(default_model_dir(init_std=0.2, seed=1) / "model.safetensors")
    cuda = Compute(dtype="float32", device="cuda")
    eng = VLLMEngine(EngineConfig(model=str(a), compute=cuda, max_model_len=512,
                                  gpu_memory_mib=4096))
    await eng.start()
    try:
        with pytest.raises(ValueError, match="async_scheduling=False"):
            await eng.update_weights(new, mode="inflight_keep_kv")
    finally:
        await eng.close()
    eng = VLLMEngine(EngineConfig(model=str(a), compute=cuda, max_model_len=512,
                                  gpu_memory_mib=4096, async_scheduling=False))
    await eng.start()
    try:
        v0 = eng.policy_version
        task = asyncio.create_task(eng.generate([1, 50, 51, 52], SamplingParams(
            max_tokens=400, min_tokens=400, temperature=0.0)))
        while eng.statistics().generated_tokens < 20:
            await asyncio.sleep(0.001)
        await eng.update_weights(new, mode="inflight_keep_kv")
        g = await task
        assert eng.statistics().preempted_by_updates == 0
        assert g.versions == sorted(g.versions) and set(g.versions) == {v0, v0 + 1}
        assert 20 <= g.versions.index(v0 + 1) < len(g.token_ids)
    finally:
        await eng.close()


def _probe_cls() -> Any:
    from earl.runtime import Actor, endpoint

    class GpuProbe(Actor):
        @endpoint
        async def gpu(self) -> tuple[int, str, str]:
            return (torch.cuda.device_count(), str(torch.cuda.get_device_properties(0).uuid),
                    os.environ.get("CUDA_VISIBLE_DEVICES", ""))

    return GpuProbe


@pytest.mark.timeout(120)
async def test_ranks_in_gpu_slots_run_on_distinct_gpus() -> None:
    two_gpus()
    from earl.config import PlacementConfig
    from earl.loop.devices import gpu_slots
    from earl.runtime import Runtime

    with gpu_slots(PlacementConfig(rollout=1, trainer=1), reference=0, gpus=2) as pool:
        async with Runtime() as rt:
            seen = []
            for stage in ("rollout", "trainer"):
                g = await rt.spawn(stage, _probe_cls(), slot=pool.assign(f"{stage}0", stage))
                seen.append(await g.gpu.call_one())
    assert [s[0] for s in seen] == [1, 1]  # each sees one GPU...
    assert seen[0][1] != seen[1][1]  # ...and not the same one


@pytest.mark.timeout(180)
async def test_two_trainer_ranks_train_over_nccl_each_on_its_own_gpu(model_dir: Path) -> None:
    two_gpus()
    from earl.runtime import Runtime
    from earl.runtime.slots import SlotPool
    from earl.stages.trainer import TrainerActor, free_dist_url

    cfg = TrainerConfig(model=str(model_dir), compute=FP32_GPU,
                        dist_url=free_dist_url())
    with SlotPool(use_cgroups=False) as pool:
        slots = [pool.create(f"trainer{r}", gpus=(r,)) for r in range(2)]
        async with Runtime() as rt:
            g = await rt.spawn("trainer", TrainerActor, cfg, n=2, slot=slots)
            metrics = await g.train_step.call(make_batch())  # NCCL refuses a shared GPU
    assert all(m["grad_norm"] > 0 for m in metrics)
    assert metrics[0]["loss"] == pytest.approx(metrics[1]["loss"])
