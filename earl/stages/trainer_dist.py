"""Parallelism for the torch trainer: process group, device mesh, DDP / FSDP2 / tensor parallel.

gloo on CPU, NCCL on CUDA. Ranks form a 2-D ``(dp, tp)`` device mesh, TP varying fastest (the
order of `earl.runtime.layout.Layout`). Data parallel: DDP keeps a full replica per rank and
all-reduces gradients; FSDP2 (``fully_shard`` per decoder layer, then the root) shards
parameters, gradients and optimizer state over the ``dp`` dimension. Both average gradients
over DP ranks, which the trainer compensates (see ``TorchTrainer.accumulate``). Tensor parallel:
DTensor plans (``ColwiseParallel`` on q/k/v and gate/up, ``RowwiseParallel`` on o and down) shard
every decoder layer over the ``tp`` dimension; embeddings, norms and the LM head stay replicated
(their gradients come out equal on every TP rank). This module knows nothing about losses or
batches.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

Parallel = Literal["ddp", "fsdp"]


def free_dist_url(host: str = "127.0.0.1") -> str:
    """A ``tcp://host:port`` rendezvous address with a port free right now (give it to all ranks)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return f"tcp://{host}:{s.getsockname()[1]}"


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` on this host (None: no such interface)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addrs):
            return name
    return None


def use_node_interface() -> None:
    """Make gloo and NCCL talk over the interface of this node's routable address
    (`earl.runtime.locality.node_address`, set by the Ray launcher), unless the user chose one
    ($GLOO_SOCKET_IFNAME / $NCCL_SOCKET_IFNAME). By default gloo binds what the hostname resolves
    to, or loopback where that is not bindable, which peers on other hosts cannot reach."""
    import os

    from earl.runtime.locality import node_address

    address = node_address()
    if address in ("127.0.0.1", "::1"):
        return
    name = interface_of(address)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)


def own_gpu(rank: int, visible: int) -> int:
    """The CUDA index of trainer rank `rank`'s own GPU among the `visible` ones it sees.

    A rank whose slot pins it to one GPU (CUDA_VISIBLE_DEVICES of one entry) uses device 0;
    a rank that sees several (no slots, one host) uses the one of its rank, so that no two
    ranks share a GPU (NCCL refuses that).

    Raises:
        ValueError: no GPU visible, or fewer visible GPUs than ranks.
    """
    if visible < 1:
        raise ValueError(f"TrainerConfig.compute.device='cuda' but trainer rank {rank} sees no "
                         "GPU; use device='cpu' or make a GPU visible (CUDA_VISIBLE_DEVICES)")
    if visible == 1:
        return 0
    if rank >= visible:
        raise ValueError(f"trainer rank {rank} has no GPU of its own: it sees {visible}; run "
                         "at most that many ranks, or give each rank a slot with its GPU "
                         "(placement.device=cuda does)")
    return rank


def cuda_device(rank: int) -> torch.device:
    """Rank `rank`'s own GPU (`own_gpu`), made this process's current CUDA device (NCCL and
    megatron-core use the current device)."""
    index = own_gpu(rank, torch.cuda.device_count())
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


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
            "address, e.g. earl.stages.trainer_dist.free_dist_url()"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    use_node_interface()
    dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size)
    return True


def build_mesh(world_size: int, tp: int, device: torch.device) -> DeviceMesh | None:
    """The ``(dp, tp)`` mesh over all ranks (None when there is one rank)."""
    if world_size <= 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    if world_size % tp:
        raise ValueError(f"TrainerConfig.tp={tp} does not divide the {world_size} trainer ranks; "
                         "spawn dp * tp ranks")
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def dp_group(mesh: DeviceMesh | None) -> dist.ProcessGroup | None:
    """The process group reductions over data go through (None: one DP rank, nothing to do)."""
    if mesh is None or mesh["dp"].size() == 1:
        return None
    if mesh["tp"].size() == 1:
        return dist.group.WORLD
    return mesh["dp"].get_group()


def tp_plan() -> dict[str, ParallelStyle]:
    """Megatron-style sharding of one Llama/Qwen decoder layer (one all-reduce per block)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def apply_tp(model: nn.Module, mesh: DeviceMesh) -> None:
    """Shard every decoder layer of an HF causal LM over the 1-D ``mesh`` (in place).

    Raises:
        ValueError: the heads or the MLP width do not divide by the TP degree, or the model
            has no ``model.layers``.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    tp = mesh.size()
    cfg = getattr(model, "config", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if cfg is None or layers is None:
        raise ValueError("tensor parallel needs an HF decoder model with model.layers")
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if getattr(cfg, field) % tp:
            raise ValueError(f"TrainerConfig.tp={tp} does not divide the model's {field}="
                             f"{getattr(cfg, field)}; choose a TP degree that does")
    for layer in layers:
        parallelize_module(layer, mesh, tp_plan())


def wrap_model(model: nn.Module, parallel: Parallel, device: torch.device,
               mesh: DeviceMesh | None = None) -> nn.Module:
    """Apply tensor parallel (``mesh["tp"]``) then data parallel (``mesh["dp"]``).

    Call only inside a process group of > 1 rank. Without a mesh, one DP dimension over all
    ranks. TP with DP > 1 needs ``parallel="fsdp"`` (FSDP2 composes with DTensor; DDP does not).
    """
    tp = 1 if mesh is None else mesh["tp"].size()
    dp = dist.get_world_size() if mesh is None else mesh["dp"].size()
    if tp > 1:
        if dp > 1 and parallel != "fsdp":
            raise ValueError(f"TrainerConfig.tp={tp} with {dp} data-parallel replicas needs "
                             "parallel='fsdp' (DDP does not compose with tensor parallel)")
        assert mesh is not None
        apply_tp(model, mesh["tp"])
    if dp == 1:
        return model
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    if parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        dp_mesh = init_device_mesh(device.type, (dp,)) if mesh is None else mesh["dp"]
        layers = getattr(getattr(model, "model", None), "layers", None)
        for layer in layers or []:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        return model
    raise ValueError(f"TrainerConfig.parallel={parallel!r} unknown; choose 'ddp' or 'fsdp'")


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Total gradient norm over all ranks, and clip to `max_norm` (in place).

    Handles gradients that mix plain tensors (replicated) and DTensors of different meshes
    (tensor parallel, FSDP2), which ``torch.nn.utils.clip_grad_norm_`` does not: each DTensor's
    norm is reduced over its own mesh.
    """
    from torch.distributed.tensor import DTensor

    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        assert p.grad is not None
        n = torch.linalg.vector_norm(p.grad.detach(), dtype=torch.float32)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        total += n.double().cpu() ** 2
    norm = total.sqrt()
    coef = min(1.0, max_norm / (float(norm) + 1e-6))
    if coef < 1.0:
        for p in params:
            assert p.grad is not None
            p.grad.detach().mul_(coef)
    return norm.float()


def unwrap(model: nn.Module) -> nn.Module:
    """The HF model inside a DDP wrapper (FSDP2 modifies in place, so it is the model itself)."""
    return model.module if hasattr(model, "module") else model  # type: ignore[return-value]


def full_tensor(t: Tensor) -> Tensor:
    """A full tensor from an FSDP2 DTensor shard (a collective: all ranks must call), or ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_reduce(t: Tensor, op: Literal["sum", "max"] = "sum", *,
               group: dist.ProcessGroup | None = None) -> Tensor:
    """In-place all-reduce over `group` (the trainer's DP group); a no-op when it is None."""
    if group is not None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX,
                        group=group)
    return t


def named_full_params(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of every parameter and buffer of the unwrapped model, in order."""
    for name, t in unwrap(model).state_dict().items():
        yield name, full_tensor(t)
