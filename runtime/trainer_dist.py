"""Data parallelism for the torch trainer: process group, DDP / FSDP2 wrapping, small reductions.

gloo on CPU, NCCL on CUDA. DDP keeps a full replica per rank and all-reduces gradients; FSDP2
(``fully_shard`` per decoder layer, then the root) shards parameters, gradients and optimizer
state. Both average gradients over ranks, which the trainer compensates (see
``TorchTrainer.accumulate``). This module knows nothing about losses or batches.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

Parallel = Literal["ddp", "fsdp"]


def free_dist_url(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous address with a port free right now (give it to all ranks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def init_distributed(rank: int, world_size: int, url: str | None, device: torch.device) -> bool:
    """Join the default process group when ``world_size > 1``; returns whether one is in use."""
    if world_size <= 1:
        return False
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"a process group of size {dist.get_world_size()} exists; trainer wants {world_size}"
            )
        return True
    if url is None:
        raise ValueError(
            "TrainerConfig.dist_url is needed with world_size > 1: give every rank the same "
            "address, e.g. earl.runtime.trainer_dist.free_dist_url()"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size)
    return True


def wrap_model(model: nn.Module, parallel: Parallel, device: torch.device) -> nn.Module:
    """Wrap for data parallelism (call only inside a process group of > 1 rank)."""
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers or []:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    raise ValueError(f"TrainerConfig.parallel={parallel!r} unknown; choose 'ddp' or 'fsdp'")


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP wrapper (FSDP2 modifies in place, so it is the model itself)."""
    return model.module if hasattr(model, "module") else model  # type: ignore[return-value]


def full_tensor(t: Tensor) -> Tensor:
    """A full tensor from an FSDP2 DTensor shard (a collective: all ranks must call), or ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_reduce(t: Tensor, op: Literal["sum", "max"] = "sum") -> Tensor:
    """In-place all-reduce when a process group exists; a no-op otherwise."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t


def named_full_params(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of every parameter and buffer of the unwrapped model, in order."""
    for name, t in unwrap(model).state_dict().items():
        yield name, full_tensor(t)
