"""Transports behind one protocol (`base.Transport`), picked by name or by locality.

`choose()` applies the locality rule: CUDA tensors -> ``nccl``; same host -> ``shm``; other
hosts -> ``ucx`` when ucxx imports, else ``zmq``. `connect(address)` opens a sender for any
receiver address, dispatching on its ``<name>://`` scheme. The job's data flows apply the rule
per producer -> consumer pair through `route` (host ids exchanged, one receiver per kind).
"""

from __future__ import annotations

import importlib
import importlib.util

from earl.runtime.transport.base import (
    Frame,
    Receiver,
    Sender,
    Transport,
    TransportError,
    pack_arrays,
    unpack_arrays,
)

__all__ = [
    "NAMES",
    "Frame",
    "Receiver",
    "Sender",
    "Transport",
    "TransportError",
    "available",
    "choose",
    "connect",
    "get_transport",
    "pack_arrays",
    "unpack_arrays",
]

_REGISTRY = {
    "shm": ("earl.runtime.transport.shm", "ShmTransport"),
    "zmq": ("earl.runtime.transport.zmq", "ZmqTransport"),
    "ucx": ("earl.runtime.transport.ucx", "UcxTransport"),
    "gloo": ("earl.runtime.transport.torch_dist", "GlooTransport"),
    "nccl": ("earl.runtime.transport.torch_dist", "NcclTransport"),
}
NAMES = tuple(_REGISTRY)


def get_transport(name: str, **options: object) -> Transport:
    """Instantiate a transport by name (``shm``, ``ucx``, ``zmq``, ``gloo``, ``nccl``)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(NAMES)}")
    module, cls = _REGISTRY[name]
    return getattr(importlib.import_module(module), cls)(**options)  # type: ignore[no-any-return]


def available(name: str) -> bool:
    """Whether the transport's library imports here (nccl also needs CUDA)."""
    if name == "ucx":
        return importlib.util.find_spec("ucxx") is not None
    if name in ("gloo", "nccl"):
        import torch.distributed as dist

        if name == "nccl":
            import torch

            return dist.is_available() and torch.cuda.is_available()
        return dist.is_available()
    return name in _REGISTRY


def choose(*, same_host: bool, device: str = "cpu", prefer: str | None = None) -> str:
    """Pick a transport name by locality; `prefer` overrides (validated)."""
    if prefer is not None:
        if prefer not in _REGISTRY:
            raise ValueError(f"unknown transport {prefer!r}; choose one of {', '.join(NAMES)}")
        return prefer
    if device.startswith("cuda") and available("nccl"):
        return "nccl"
    if same_host:
        return "shm"
    return "ucx" if available("ucx") else "zmq"


def connect(address: str, **options: object) -> Sender:
    """Open a sender to any receiver address (``shm://``, ``ucx://``, ``zmq://``, ...)."""
    scheme = address.split("://", 1)[0]
    if scheme not in _REGISTRY:
        raise ValueError(f"address {address!r} has no known transport scheme ({', '.join(NAMES)})")
    return get_transport(scheme, **options).connect(address)
