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
does) and does not touch vLLM (`earl.stages.vllm_engine`).
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from earl.runtime import ActorGroup

__all__ = ["WeightPublisher", "WeightSync", "decode_bucket", "encode_bucket", "iter_buckets",
           "plan_buckets"]

T = TypeVar("T")
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
        self._buffers: dict[str, torch.Tensor] = {}

    async def _connect(self) -> list[Any]:
        if self._senders is None:
            from earl.runtime.transport import get_transport

            shm = get_transport("shm")
            addrs = await self.group.weights_address.call()
            self._senders = [shm.connect(a) for a in addrs]
        return self._senders

    def _wire(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """`t` as it goes on the wire: on CPU, contiguous, in `dtype`. Casts and device copies
        land in a buffer kept per tensor, so repeated pushes write warm memory."""
        t = t.detach()
        dtype = self.dtype or t.dtype
        if t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous():
            return t
        buf = self._buffers.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != dtype:
            buf = self._buffers[name] = torch_empty(t.shape, dtype)
        buf.copy_(t)
        return buf

    async def push(self, named: Named, *, version: int,
                   mode: Literal["drain", "inflight"] = "inflight") -> WeightSync:
        """Send all tensors and load them on every replica; returns when all have switched.

        Over shm the replicas start loading as the first bucket arrives, so transfer and
        load overlap.
        """
        t0 = time.perf_counter()
        plan = plan_buckets(named, self.bucket_bytes, self.dtype)
        nbytes = 0
        if self.transport == "shm":
            senders = await self._connect()
            async with asyncio.TaskGroup() as tg:
                commit = tg.create_task(_await(self.group.commit_weights.call(version, mode,
                                                                              len(plan))))
                for bucket in plan:
                    header, bufs = encode_bucket([(k, self._wire(k, t)) for k, t in bucket])
                    await asyncio.to_thread(_send_all, senders, header, bufs)
                    nbytes += sum(b.nbytes for b in bufs)
            loads = commit.result()
        else:
            for bucket in plan:
                wire = [self._wire(k, t) for k, t in bucket]
                await self.group.stage_bucket.call([k for k, _ in bucket], wire)
                nbytes += sum(t.numel() * t.element_size() for t in wire)
            loads = await self.group.commit_weights.call(version, mode, 0)
        return WeightSync(seconds=time.perf_counter() - t0, nbytes=nbytes, buckets=len(plan),
                          load_s=max(loads), version=version)

    def close(self) -> None:
        for s in self._senders or []:
            s.close()
        self._senders = None


async def _await(aw: Awaitable[T]) -> T:
    return await aw


def torch_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=dtype)


def _send_all(senders: list[Any], header: bytes, bufs: list[np.ndarray]) -> None:
    for s in senders:
        s.send(header, bufs)
