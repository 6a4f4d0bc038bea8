"""Trainer offload on CUDA (colocated placement): offloading frees the GPU memory it reports,
a trainer that went to the host and back trains on exactly like one that stayed, the round
trip is bit-identical and keeps the same Parameter objects, and a DDP-wrapped model trains on
after it (skipped without CUDA; the DDP test needs NCCL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_stages_on_gpu import make_batch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from earl.stages.compute import Compute
from earl.stages.trainer_offload import offload, onload, resident_bytes
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

FP32_GPU = Compute(device="cuda", dtype="float32")  # not "auto" (bf16 on CUDA)

pytestmark = pytest.mark.gpu

TIMING = {"step_time_s", "tokens_per_s"}


def cuda_trainer(model_dir: Path) -> TorchTrainer:
    return TorchTrainer(TrainerConfig(model=str(model_dir), compute=FP32_GPU),
                        rank=0, world_size=1)


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.timeout(300)
def test_offload_frees_the_gpu_and_the_trainer_trains_on_like_one_that_stayed(
        model_dir: Path) -> None:
    batch = make_batch()
    # the math attention backward is deterministic: both trainers do the same arithmetic
    with sdpa_kernel(SDPBackend.MATH):
        moving, staying = cuda_trainer(model_dir), cuda_trainer(model_dir)
        moving.train_step(batch)
        staying.train_step(batch)
        param_bytes = nbytes([p.data for p in moving.model.parameters()])
        # a byte count only: a list of the tensors would keep their GPU memory alive
        state_bytes = nbytes([t for t in state_tensors(moving.optimizer) if t.is_cuda])
        assert state_bytes > 0  # AdamW's moments
        resident = resident_bytes(moving.model, moving.optimizer)
        assert resident == param_bytes + state_bytes
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()

        moved = offload(moving.model, moving.optimizer)
        freed = before - torch.cuda.memory_allocated()
        assert moved.parameters == param_bytes
        assert moved.gradients == 0  # train_step leaves them None
        assert moved.optimizer == state_bytes
        assert moved.total == resident and moved.seconds > 0
        assert freed >= 0.9 * moved.total, (freed, moved)
        assert resident_bytes(moving.model, moving.optimizer) == 0
        assert all(p.device.type == "cpu" for p in moving.model.parameters())

        back = onload(moving.model, moving.optimizer, moving.device)
        assert (back.parameters, back.gradients, back.optimizer) == (
            moved.parameters, 0, moved.optimizer)
        assert resident_bytes(moving.model, moving.optimizer) == resident
        a, b = moving.train_step(batch), staying.train_step(batch)
    assert a.keys() == b.keys()
    for k in a.keys() - TIMING:
        assert a[k] == pytest.approx(b[k], abs=1e-5), k
    for (name, p), (_, q) in zip(moving.module.named_parameters(),
                                 staying.module.named_parameters(), strict=True):
        assert p.device == q.device == moving.device, name
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


@pytest.mark.timeout(300)
def test_round_trip_is_bit_identical_and_keeps_the_same_objects(model_dir: Path) -> None:
    t = cuda_trainer(model_dir)
    batch = make_batch()
    t.train_step(batch)
    t.accumulate(batch)  # gradients too
    params = list(t.model.parameters())
    grads = [p.grad for p in params]
    assert all(g is not None for g in grads)
    keys = list(t.optimizer.state)
    devices = [v.device for v in state_tensors(t.optimizer)]
    before = ([p.detach().clone() for p in params] + [g.clone() for g in grads if g is not None]
              + [v.clone() for v in state_tensors(t.optimizer)])

    moved = offload(t.model, t.optimizer)
    assert moved.gradients == nbytes([g for g in grads if g is not None]) > 0
    for p in params:
        assert p.is_cpu and p.data.is_pinned()
        assert p.grad is not None and p.grad.is_cpu and p.grad.is_pinned()
    for v, dev in zip(state_tensors(t.optimizer), devices, strict=True):
        assert v.is_cpu and (v.is_pinned() or dev.type == "cpu")  # host-side `step` stays as is
    again = offload(t.model, t.optimizer)
    assert again.total == 0

    back = onload(t.model, t.optimizer, t.device)
    assert back.total == moved.total
    assert all(p is q for p, q in zip(t.model.parameters(), params, strict=True))
    assert all(p is q for p, q in zip(t.optimizer.param_groups[0]["params"], params, strict=True))
    assert all(p is q for p, q in zip(t.optimizer.state, keys, strict=True))
    assert [v.device for v in state_tensors(t.optimizer)] == devices
    after = ([p.detach() for p in params] + [p.grad for p in params if p.grad is not None]
             + state_tensors(t.optimizer))
    assert len(after) == len(before)
    for old, new in zip(before, after, strict=True):
        assert new.device == old.device and torch.equal(new, old)
    assert onload(t.model, t.optimizer, t.device).total == 0
    assert t.optimizer_step()["grad_norm"] > 0  # the moved gradients and state step fine


@pytest.fixture
def one_rank_nccl() -> Iterator[None]:
    if not dist.is_nccl_available():
        pytest.skip("needs NCCL")
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_a_ddp_model_trains_on_after_a_round_trip(one_rank_nccl: None) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", 0)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    inner = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(dev)
    inner.load_state_dict(plain.state_dict())
    ddp = DDP(inner, device_ids=[0])
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, ddp)]
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(dev)

    def step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
        opt.zero_grad(set_to_none=True)
        m(x).pow(2).mean().backward()
        opt.step()

    for m, opt in zip((plain, ddp), opts, strict=True):
        step(m, opt)
    moved = offload(ddp, opts[1])
    assert moved.parameters == nbytes([p.data for p in plain.parameters()])
    assert resident_bytes(ddp, opts[1]) == 0
    onload(ddp, opts[1], dev)
    for m, opt in zip((plain, ddp), opts, strict=True):
        step(m, opt)  # DDP's reducer still reduces into the same Parameters
    for p, q in zip(plain.parameters(), inner.parameters(), strict=True):
        assert q.device == dev
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)
