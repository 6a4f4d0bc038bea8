"""Moving a trainer's parameters, gradients and optimizer state off the GPU and back.

For colocated placement the rollout's vLLM and the trainer share one GPU in turn: while vLLM
generates, the trainer's state waits in host memory (verl's ``offload_fsdp_model_to_cpu`` and
optimizer offload, slime's likewise). `offload` copies every CUDA parameter, gradient and
optimizer-state tensor into pinned host memory and frees the GPU copies; `onload` copies them
back. Both replace ``p.data`` / ``p.grad`` and the values of ``optimizer.state[p]``, so the
module, a DDP wrapper and the optimizer keep the very same ``Parameter`` objects (DDP's reducer
and the optimizer refer to Parameters, not their storage).

Which optimizer state comes back: `offload` records, per optimizer, the ``(parameter, key)``
pairs whose tensors it moved off the GPU; `onload` moves exactly those onto its device and
forgets them. State that lived on the CPU all along (AdamW's scalar ``step`` unless
``capturable``/``fused``) stays there. Parameters and gradients have no such record: `onload`
puts every one that is not on ``device`` onto it (a model lives on one device).

It does not move buffers (rotary tables and the like: small, and DDP broadcasts them), DDP's own
gradient buckets, or anything of an FSDP2 / tensor-parallel model (DTensor parameters are
refused); it does not decide when to offload (`earl.loop` does).

Example:
    >>> moved = offload(trainer.model, trainer.optimizer)   # before vLLM wakes up
    >>> ...                                                  # rollout generates
    >>> onload(trainer.model, trainer.optimizer, trainer.device)
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Moved", "offload", "onload", "resident_bytes"]

# optimizer -> the (parameter, state key) pairs `offload` moved off the GPU, for `onload`
_OFFLOADED: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[tuple[Tensor, str]]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True, slots=True)
class Moved:
    """What one `offload` or `onload` moved.

    Attributes:
        parameters: bytes of parameter data moved.
        gradients: bytes of gradients moved (0 when the gradients are None).
        optimizer: bytes of optimizer state moved.
        seconds: wall time of the move, the copies' completion and the cache release included.
    """

    parameters: int
    gradients: int
    optimizer: int
    seconds: float

    @property
    def total(self) -> int:
        """Bytes moved in all."""
        return self.parameters + self.gradients + self.optimizer


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def _check_plain(model: nn.Module) -> None:
    """Refuse DTensor parameters (FSDP2 shards, tensor-parallel plans)."""
    if not torch.distributed.is_available():
        return
    from torch.distributed.tensor import DTensor

    sharded = [name for name, p in model.named_parameters()
               if isinstance(p, DTensor) or isinstance(p.data, DTensor)]
    if sharded:
        raise ValueError(
            f"parameter {sharded[0]!r} is a DTensor (FSDP2 or tensor parallel): colocated "
            "offload supports one rank or DDP: set placement.trainer_tp=1 (the trainer then "
            "uses DDP), or placement.colocate=false"
        )


def _to_host(t: Tensor) -> Tensor:
    """A pinned host copy of CUDA tensor ``t``, filled asynchronously (synchronize before use)."""
    out = torch.empty_like(t, device="cpu", pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[Tensor, str, Tensor]]:
    """``(parameter, key, tensor)`` for every tensor value of ``optimizer.state``."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, Tensor):
                yield p, key, value


def offload(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> Moved:
    """Move every CUDA parameter's ``.data`` and ``.grad`` and every CUDA tensor in
    ``optimizer.state`` to pinned host memory, then release the freed GPU blocks.

    Tensors already on the CPU are left alone, so on a CPU run this moves nothing and returns
    zeros; calling it twice moves nothing the second time.

    Args:
        model: the trainer's model (plain or DDP-wrapped).
        optimizer: its optimizer, or None.

    Returns:
        The bytes moved and the time it took.

    Raises:
        ValueError: a parameter is a DTensor (FSDP2 or tensor parallel), before anything moves.
    """
    _check_plain(model)
    start = time.perf_counter()
    params = grads = state_bytes = 0
    for p in model.parameters():
        # .data before .grad: a gradient must live on its parameter's device
        if p.data.is_cuda:
            params += _nbytes(p.data)
            p.data = _to_host(p.data)
        if p.grad is not None and p.grad.is_cuda:
            grads += _nbytes(p.grad)
            p.grad = _to_host(p.grad)
    if optimizer is not None:
        record = _OFFLOADED.setdefault(optimizer, [])
        for owner, key, value in list(_state_tensors(optimizer)):
            if value.is_cuda:
                state_bytes += _nbytes(value)
                optimizer.state[owner][key] = _to_host(value)
                record.append((owner, key))
    if params + grads + state_bytes:
        torch.cuda.synchronize()  # the host copies are complete before anyone reads them
        torch.cuda.empty_cache()  # hand the freed blocks back for vLLM
    return Moved(parameters=params, gradients=grads, optimizer=state_bytes,
                 seconds=time.perf_counter() - start)


def onload(model: nn.Module, optimizer: torch.optim.Optimizer | None,
           device: torch.device) -> Moved:
    """Move what `offload` moved back onto ``device`` (a no-op with zeros when it is the CPU).

    Every parameter (and its gradient) not on ``device`` goes to it; of the optimizer state,
    exactly the tensors `offload` took off the GPU do (see the module docstring).

    Args:
        model: the trainer's model (plain or DDP-wrapped).
        optimizer: its optimizer, or None.
        device: the trainer's device (``TorchTrainer.device``).

    Returns:
        The bytes moved and the time it took.

    Raises:
        ValueError: a parameter is a DTensor (FSDP2 or tensor parallel), before anything moves.
    """
    _check_plain(model)
    if device.type == "cpu":
        return Moved(parameters=0, gradients=0, optimizer=0, seconds=0.0)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    start = time.perf_counter()
    params = grads = state_bytes = 0
    for p in model.parameters():
        if p.data.device != device:
            params += _nbytes(p.data)
            p.data = p.data.to(device, non_blocking=True)
        if p.grad is not None and p.grad.device != device:
            grads += _nbytes(p.grad)
            p.grad = p.grad.to(device, non_blocking=True)
    if optimizer is not None:
        for owner, key in _OFFLOADED.pop(optimizer, []):
            value = optimizer.state.get(owner, {}).get(key)
            if isinstance(value, Tensor) and value.device != device:
                state_bytes += _nbytes(value)
                optimizer.state[owner][key] = value.to(device, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return Moved(parameters=params, gradients=grads, optimizer=state_bytes,
                 seconds=time.perf_counter() - start)


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of parameters, gradients and optimizer state on a CUDA device now (0 when
    offloaded; buffers are not counted)."""
    total = 0
    for p in model.parameters():
        total += _nbytes(p.data) if p.data.is_cuda else 0
        total += _nbytes(p.grad) if p.grad is not None and p.grad.is_cuda else 0
    if optimizer is not None:
        total += sum(_nbytes(v) for _, _, v in _state_tensors(optimizer) if v.is_cuda)
    return total
