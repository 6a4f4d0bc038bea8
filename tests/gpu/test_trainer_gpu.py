"""Trainer backends on CUDA: torch (fp32/bf16) and megatron-core, against the CPU trainer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from process_groups import tear_down

from earl.stages.compute import Compute
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

FP32_GPU = Compute(device="cuda", dtype="float32")  # not "auto" (bf16 on CUDA)

pytestmark = pytest.mark.gpu


def make_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, n in enumerate((12, 40, 7, 25, 300)):
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 if k % 2 else -1.0)})
    return TrainBatch.from_samples(samples)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_torch_trainer_cuda_matches_cpu(model_dir: Path, dtype: str) -> None:
    batch = make_batch()
    cpu = TorchTrainer(TrainerConfig(model=str(model_dir), compute=Compute(device="cpu")))
    gpu = TorchTrainer(TrainerConfig(model=str(model_dir),
                                     compute=Compute(device="cuda", dtype=dtype)))
    assert next(gpu.module.parameters()).is_cuda
    tol = 1e-4 if dtype == "float32" else 0.15
    torch.testing.assert_close(gpu.compute_logprobs(batch), cpu.compute_logprobs(batch),
                               atol=tol, rtol=0.05)
    m = gpu.train_step(batch)
    assert m["grad_norm"] > 0 and m["step"] == 1


@pytest.fixture
def megatron_process_group() -> Iterator[None]:
    """A MegatronTrainer joins a process group even on one rank (megatron needs one) and sets
    up megatron's parallel state; both are torn down after the test."""
    try:
        yield
    finally:
        tear_down()


def test_megatron_trainer_cuda_matches_torch(model_dir: Path, megatron_process_group: None
                                             ) -> None:
    from earl.stages.trainer_megatron import MegatronTrainer

    batch = make_batch()
    ref = TorchTrainer(TrainerConfig(model=str(model_dir), compute=FP32_GPU))
    mt = MegatronTrainer(TrainerConfig(model=str(model_dir), compute=FP32_GPU))
    torch.testing.assert_close(mt.compute_logprobs(batch), ref.compute_logprobs(batch),
                               atol=1e-4, rtol=1e-4)
    a, b = mt.train_step(batch), ref.train_step(batch)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)
    assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-3)
