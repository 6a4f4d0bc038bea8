"""Trainer -> rollout weight transfer in buckets, and the rollout side that decodes them.

`WeightPublisher.push(state_dict, version=...)` cuts the trainer's tensors into buckets of about
`bucket_bytes`, ships every bucket to every rollout replica, then asks each replica to load them
all with one in-place reload (`RolloutActor.commit_weights`). Two paths:

- ``"shm"`` (same host, default): each bucket is one transport frame whose buffers are the
  tensors' own memory; the shm transport copies it once into a reused segment and the replica
  reads views of it, so nothing is pickled and warm transfers run at memcpy speed.
- ``"rpc"``: buckets travel as endpoint arguments (CPU tensors become zero-copy RPC frames);
  works wherever the actor runtime does.

Names are HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`), as a transformers
model's `state_dict()` gives them. This module does not choose *when* to sync (the run loop
does) and does not touch vLLM (`earl.runtime.vllm_engine`).
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import numpy as np
    import torch
    from earl.runtime import ActorGroup

__all__ = ["WeightPublisher", "WeightSync", "decode_bucket", "encode_bucket", "iter_buckets"]

Named = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


def iter_buckets(named: Named, bucket_bytes: int = 64 << 20,
                 dtype: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of about `bucket_bytes` (a bigger tensor is alone).

    Tensors are detached, moved to CPU, made contiguous and cast to `dtype` when given.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    items = named.items() if isinstance(named, Mapping) else named
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in items:
        t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous()
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def encode_bucket(bucket: list[tuple[str, torch.Tensor]]) -> tuple[bytes, list[np.ndarray]]:
    """A transport frame for one bucket: JSON header + each tensor's bytes (no copy)."""
    import torch

    specs = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
    bufs = [t.reshape(-1).view(torch.uint8).numpy() for _, t in bucket]
    return json.dumps(specs, separators=(",", ":")).encode(), bufs


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


@dataclass(frozen=True, slots=True)
class WeightSync:
    """One push: wall seconds trainer->serving, bytes per replica, buckets, engine load seconds."""

    seconds: float
    nbytes: int
    buckets: int
    load_s: float
    version: int


class WeightPublisher:
    """Pushes trainer weights to every replica of a rollout group.

    Args:
        group: the `RolloutActor` group.
        transport: "shm" (same host) or "rpc".
        bucket_bytes: target bucket size.
        dtype: cast to this dtype on the way (e.g. torch.bfloat16 when serving bf16).
    """

    def __init__(self, group: ActorGroup[Any], *, transport: Literal["shm", "rpc"] = "shm",
                 bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None) -> None:
        if transport not in ("shm", "rpc"):
            raise ValueError(f"WeightPublisher.transport must be 'shm' or 'rpc', got {transport!r}")
        self.group = group
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self._senders: list[Any] | None = None

    async def _connect(self) -> list[Any]:
        if self._senders is None:
            from earl.runtime.transport import get_transport

            shm = get_transport("shm")
            addrs = await self.group.weights_address.call()
            self._senders = [shm.connect(a) for a in addrs]
        return self._senders

    async def push(self, named: Named, *, version: int,
                   mode: Literal["drain", "inflight"] = "inflight") -> WeightSync:
        """Send all tensors, then load them on every replica; returns when all have switched."""
        t0 = time.perf_counter()
        nbytes = n = 0
        if self.transport == "shm":
            senders = await self._connect()
            for bucket in iter_buckets(named, self.bucket_bytes, self.dtype):
                header, bufs = encode_bucket(bucket)
                await asyncio.to_thread(_send_all, senders, header, bufs)
                nbytes += sum(b.nbytes for b in bufs)
                n += 1
            loads = await self.group.commit_weights.call(version, mode, n)
        else:
            for bucket in iter_buckets(named, self.bucket_bytes, self.dtype):
                names = [k for k, _ in bucket]
                await self.group.stage_bucket.call(names, [t for _, t in bucket])
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
                n += 1
            loads = await self.group.commit_weights.call(version, mode, 0)
        return WeightSync(seconds=time.perf_counter() - t0, nbytes=nbytes, buckets=n,
                          load_s=max(loads), version=version)

    def close(self) -> None:
        for s in self._senders or []:
            s.close()
        self._senders = None


def _send_all(senders: list[Any], header: bytes, bufs: list[np.ndarray]) -> None:
    for s in senders:
        s.send(header, bufs)
