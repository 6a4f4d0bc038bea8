"""Trainer -> rollout weight transfer in buckets, and the rollout side that decodes them.

`WeightPublisher.push(state_dict, version=...)` cuts the trainer's tensors into buckets of about
`bucket_bytes`, ships every bucket to every rollout replica, then asks each replica to load them
all with one in-place reload (`RolloutActor.commit_weights`). Two paths:

- frames (``"auto"``, the default): each bucket is one transport frame whose buffers are the
  tensors' own memory, sent over each replica's transport by locality (`transport.route`):
  shm to a replica on this host (copied once into a reused segment, read as views: memcpy
  speed, nothing pickled), ucx or zmq (authenticated under the run's secret) to a replica on
  another host; a group spread over hosts mixes them. ``"shm"``, ``"ucx"`` or ``"zmq"``
  force one kind for every replica.
- ``"rpc"``: buckets travel as endpoint arguments (CPU tensors become zero-copy RPC frames);
  works wherever the actor runtime does.

Names are HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`), as a transformers
model's `state_dict()` gives them. This module does not choose *when* to sync (the run loop
does) and does not touch vLLM (`earl.stages.vllm_engine`).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import warnings
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from earl.runtime import ActorGroup

__all__ = ["PushTransport", "WeightPublisher", "WeightSync", "decode_bucket", "encode_bucket",
           "iter_buckets", "plan_buckets"]

T = TypeVar("T")
PushTransport = Literal["auto", "shm", "ucx", "zmq", "rpc"]
_TRANSPORTS = ("auto", "shm", "ucx", "zmq", "rpc")
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
    """One push: wall seconds trainer->serving, bytes per replica, buckets, engine load seconds,
    and the bytes each transport carried (all replicas together: which kind reached whom)."""

    seconds: float
    nbytes: int
    buckets: int
    load_s: float
    version: int
    by_transport: dict[str, int] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """Flat numbers for a metrics row (``transport/weights_bytes/<kind>`` per transport)."""
        out = {k: float(getattr(self, k)) for k in ("seconds", "nbytes", "buckets", "load_s",
                                                      "version")}
        out.update({f"transport/weights_bytes/{k}": float(v)
                    for k, v in self.by_transport.items()})
        return out


class WeightPublisher:
    """Pushes trainer weights to every replica of a rollout group.

    Args:
        group: the `RolloutActor` group.
        transport: "auto" (each replica's by locality), "shm", "ucx" or "zmq" (that kind for
            every replica), or "rpc".
        bucket_bytes: target bucket size.
        dtype: cast to this dtype on the way (e.g. torch.bfloat16 when serving bf16).
    """

    def __init__(self, group: ActorGroup[Any], *, transport: PushTransport = "auto",
                 bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None) -> None:
        if transport not in _TRANSPORTS:
            raise ValueError(f"WeightPublisher.transport must be one of {', '.join(_TRANSPORTS)}, "
                             f"got {transport!r}")
        self.group = group
        self.transport = transport
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self._senders: list[Any] | None = None
        self._kinds: list[str] = []  # each sender's transport
        self._sending = threading.Lock()  # held by the thread sending a bucket (see close)
        self._buffers: dict[str, torch.Tensor] = {}

    async def _connect(self) -> list[Any]:
        if self._senders is None:
            from earl.runtime.locality import host_id
            from earl.runtime.transport.route import open_sender

            if self.transport == "shm":  # same-host receivers (what replicas made first)
                addrs = await self.group.weights_address.call()
            else:  # each replica picks by our host, or makes the kind asked for
                prefer = "" if self.transport == "auto" else self.transport
                addrs = await self.group.weights_address.call(host_id(), prefer)
            self._senders = [open_sender(a) for a in addrs]
            self._kinds = [a.split("://", 1)[0] for a in addrs]
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

        Over frames (any transport but "rpc") the replicas start loading as the first bucket
        arrives, so transfer and load overlap.
        """
        t0 = time.perf_counter()
        plan = plan_buckets(named, self.bucket_bytes, self.dtype)
        nbytes = 0
        if self.transport != "rpc":
            senders = await self._connect()
            commit = asyncio.ensure_future(_await(self.group.commit_weights.call(
                version, mode, len(plan))))
            sending = asyncio.ensure_future(self._send_plan(senders, plan))
            try:
                await asyncio.wait([commit, sending], return_when=asyncio.FIRST_EXCEPTION)
            except BaseException:
                commit.cancel()
                sending.cancel()
                raise
            if commit.done() and commit.exception() is not None:
                # a replica failed (died): its error names it, for healing. A send to a gone
                # peer may only end at the sender's timeout: it is not waited for here, and
                # `close` closes the senders once its thread has let go of them
                sending.add_done_callback(_retrieved)
                raise commit.exception()  # type: ignore[misc]
            if sending.exception() is not None:
                await _explain_send_failure(commit, sending.exception())  # type: ignore[arg-type]
                raise sending.exception()  # type: ignore[misc]
            nbytes = sending.result()
            loads = await commit
            kinds = self._kinds
        else:
            for bucket in plan:
                wire = [self._wire(k, t) for k, t in bucket]
                await self.group.stage_bucket.call([k for k, _ in bucket], wire)
                nbytes += sum(t.numel() * t.element_size() for t in wire)
            loads = await self.group.commit_weights.call(version, mode, 0)
            kinds = ["rpc"] * len(loads)
        by_transport: dict[str, int] = {}
        for kind in kinds:
            by_transport[kind] = by_transport.get(kind, 0) + nbytes
        return WeightSync(seconds=time.perf_counter() - t0, nbytes=nbytes, buckets=len(plan),
                          load_s=max(loads), version=version, by_transport=by_transport)

    async def _send_plan(self, senders: list[Any], plan: list[list[tuple[str, Any]]]) -> int:
        """Send every bucket of `plan` to every replica; the bytes sent per replica."""
        nbytes = 0
        for bucket in plan:
            header, bufs = encode_bucket([(k, self._wire(k, t)) for k, t in bucket])
            await asyncio.to_thread(self._send_locked, senders, header, bufs)
            nbytes += sum(b.nbytes for b in bufs)
        return nbytes

    def _send_locked(self, senders: list[Any], header: bytes, bufs: list[np.ndarray]) -> None:
        with self._sending:
            _send_all(senders, header, bufs)

    def close(self) -> None:
        """Close the senders, once no thread sends through them (a push cancelled or failed
        mid-bucket leaves its thread to finish: a transport closed under it may crash)."""
        senders, self._senders, self._kinds = self._senders or [], None, []
        if not self._sending.acquire(blocking=False):
            threading.Thread(target=self._close_when_idle, args=(senders,), daemon=True).start()
            return
        try:
            for s in senders:
                s.close()
        finally:
            self._sending.release()

    def _close_when_idle(self, senders: list[Any]) -> None:
        with self._sending:
            for s in senders:
                s.close()


async def _await(aw: Awaitable[T]) -> T:
    return await aw


def torch_empty(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=dtype)


def _retrieved(f: asyncio.Future[Any]) -> None:
    """Mark a future's outcome as seen (its error was reported another way)."""
    if not f.cancelled():
        f.exception()


async def _explain_send_failure(commit: asyncio.Future[Any], exc: BaseException,
                                timeout: float = 30.0) -> None:
    """A bucket could not be sent (a network sender to a replica that died mid-push fails
    before the replicas' commit call does): raise the commit's own error, which names the dead
    replica so the run's healing restarts it, instead of a bare transport error. Cancels the
    commit when it has not failed within `timeout` s (the send error then stands)."""
    if isinstance(exc, Exception):
        done, _ = await asyncio.wait([commit], timeout=timeout)
        if done and not commit.cancelled() and commit.exception() is not None:
            raise commit.exception() from exc  # type: ignore[misc]
    commit.cancel()


def _send_all(senders: list[Any], header: bytes, bufs: list[np.ndarray]) -> None:
    for s in senders:
        s.send(header, bufs)
