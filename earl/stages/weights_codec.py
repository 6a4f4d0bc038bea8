"""How a bucket of named weights travels: the bucket plan, and a frame's header and buffers.

A bucket is a list of (HF name, tensor) of about `bucket_bytes`. On the wire it is one frame:
a JSON header (name, dtype, shape per tensor) and one buffer per tensor, the tensor's own bytes
(host memory: numpy views; NCCL: flat uint8 tensors on the GPU). Decoding gives tensors that
view the received buffers, without copying. Used by the publisher (`earl.stages.weights`) and
the replica's inbox (`earl.stages.weights_inbox`); nothing here sends or receives.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

__all__ = ["Named", "decode_bucket", "decode_tensors", "encode_bucket", "encode_tensors",
           "iter_buckets", "plan_buckets"]

Named = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


def plan_buckets(named: Named, bucket_bytes: int = 64 << 20,
                 dtype: torch.dtype | None = None) -> list[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of about `bucket_bytes` (measured in `dtype`, the
    wire dtype; a bigger tensor is alone). Nothing is copied."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = named.items() if isinstance(named, Mapping) else named
    out: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in items:
        n = t.numel() * (dtype.itemsize if dtype is not None else t.element_size())
        if not out or (out[-1] and size + n > bucket_bytes):
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += n
    return out


def iter_buckets(named: Named, bucket_bytes: int = 64 << 20,
                 dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`plan_buckets`, each tensor detached, on CPU, contiguous and cast to `dtype` (copies
    into fresh memory when casting; `WeightPublisher` reuses warm buffers instead)."""
    for bucket in plan_buckets(named, bucket_bytes, dtype):
        yield [(k, t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()) for k, t in bucket]


def encode_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[np.ndarray]]:
    """A transport frame for one bucket: JSON header + each tensor's bytes (no copy)."""
    import torch

    specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
    bufs = [t.reshape(-1).view(torch.uint8).numpy() for _, t in bucket]
    return json.dumps(specs, separators=(",", ":")).encode(), bufs


def encode_tensors(bucket: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[torch.Tensor]]:
    """`encode_bucket` with the buffers as flat uint8 tensors where they are (GPU for nccl)."""
    import torch

    specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
    bufs = [t.reshape(-1).view(torch.uint8) for _, t in bucket]
    return json.dumps(specs, separators=(",", ":")).encode(), bufs


def decode_tensors(header: bytes, tensors: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """`decode_bucket` for frames whose buffers arrived as uint8 tensors (nccl: on the GPU)."""
    import torch

    return [(name, t.view(getattr(torch, dtype)).view(shape))
            for (name, dtype, shape), t in zip(json.loads(header), tensors, strict=True)]


def decode_bucket(header: bytes, buffers: list[memoryview]) -> list[tuple[str, torch.Tensor]]:
    """Tensors viewing `buffers` (valid as long as the buffers are)."""
    import torch

    out = []
    with warnings.catch_warnings():  # shm views are read-only; the loader only reads them
        warnings.simplefilter("ignore", UserWarning)
        for (name, dtype, shape), buf in zip(json.loads(header), buffers, strict=True):
            dt = getattr(torch, dtype)
            t = torch.frombuffer(buf, dtype=dt) if len(buf) else torch.empty(0, dtype=dt)
            out.append((name, t.view(shape)))
    return out
