"""Trainer offload on CPU: nothing moves (or is even copied) on a CPU run, optimizer state
survives a round trip and training goes on as if nothing happened, DTensor parameters are
refused. The CUDA moves themselves: tests/gpu/test_trainer_offload_gpu.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from earl.stages.trainer_offload import Moved, offload, onload, resident_bytes


def stepped() -> tuple[nn.Linear, torch.optim.AdamW]:
    """A tiny Linear after one AdamW step, with fresh gradients from a second backward."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()
    model(torch.randn(5, 4)).sum().backward()
    return model, opt


def snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for i, p in enumerate(model.parameters()):
        out[f"p{i}"] = p.detach().clone()
        assert p.grad is not None
        out[f"g{i}"] = p.grad.clone()
        for key, v in opt.state[p].items():
            out[f"s{i}.{key}"] = v.clone()
    return out


def storages(model: nn.Module, opt: torch.optim.Optimizer) -> list[int]:
    """Data pointers of every parameter, gradient and optimizer-state tensor."""
    out = []
    for p in model.parameters():
        assert p.grad is not None
        out += [p.data_ptr(), p.grad.data_ptr()]
        out += [v.data_ptr() for v in opt.state[p].values()]
    return out


def test_moved_total_adds_the_three_parts() -> None:
    assert Moved(parameters=1, gradients=2, optimizer=4, seconds=0.5).total == 7


def test_a_cpu_run_moves_nothing_and_keeps_every_tensor() -> None:
    model, opt = stepped()
    before = snapshot(model, opt)
    params = list(model.parameters())
    storage = storages(model, opt)
    zero = (0, 0, 0)
    for moved in (offload(model, opt), onload(model, opt, torch.device("cpu"))):
        assert (moved.parameters, moved.gradients, moved.optimizer) == zero
    assert resident_bytes(model, opt) == 0
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert storages(model, opt) == storage  # not even copied
    after = snapshot(model, opt)
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_optimizer_state_is_identical_after_a_round_trip_and_training_goes_on() -> None:
    model, opt = stepped()
    twin, twin_opt = stepped()
    before = snapshot(model, opt)
    offload(model, opt)
    onload(model, opt, torch.device("cpu"))
    after = snapshot(model, opt)
    assert before.keys() == after.keys() and {"s0.exp_avg", "s0.step"} <= before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    for m, o in ((model, opt), (twin, twin_opt)):
        o.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    assert not dist.is_initialized(), "a process group leaked from an earlier test"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor_parameters_are_refused_before_anything_moves(one_rank_group: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    model = nn.Module()
    model.plain = nn.Linear(2, 2)
    model.sharded = nn.Parameter(distribute_tensor(torch.ones(2, 2), mesh, [Replicate()]))
    weight = model.plain.weight.data_ptr()
    for call in (lambda: offload(model, None),
                 lambda: onload(model, None, torch.device("cuda", 0))):
        with pytest.raises(ValueError, match=r"'sharded'.*placement\.trainer_tp=1"):
            call()
    assert model.plain.weight.data_ptr() == weight
