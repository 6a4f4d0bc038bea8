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
- ``"gloo"`` / ``"nccl"``: a torch.distributed pair per replica (`TorchDistReceiver`), keyed
  with a secret this publisher makes and sends over the control plane; over NCCL the buckets
  go GPU to GPU and arrive in the replica's GPU memory (verl, slime and AReaL update vLLM over
  NCCL the same way, with one broadcast group).
- ``"ipc"``: CUDA IPC to a replica on this process's own GPU (colocated placement): each
  bucket is copied into one of two reused GPU buffers whose handles the replica maps
  (`earl.stages.weights_ipc`); a bucket's RPC returns once the replica has loaded it, so a
  buffer is reused only after its previous bucket is in.
- ``"rpc"``: buckets travel as endpoint arguments (CPU tensors become zero-copy RPC frames);
  works wherever the actor runtime does.

"auto" on CUDA lets each replica choose: ipc on the publisher's GPU, nccl elsewhere.

Names are HF checkpoint names (`model.layers.0.self_attn.q_proj.weight`), as a transformers
model's `state_dict()` gives them. This module does not choose *when* to sync (the run loop
does) and does not touch vLLM (`earl.stages.vllm_engine`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from earl.stages.weights_codec import (
    Named,
    decode_bucket,
    encode_bucket,
    encode_tensors,
    iter_buckets,
    plan_buckets,
)

if TYPE_CHECKING:
    import torch

    from earl.runtime import ActorGroup
    from earl.stages.vllm_engine import UpdateMode

__all__ = ["PushTransport", "WeightPublisher", "WeightSync", "decode_bucket", "encode_bucket",
           "iter_buckets", "plan_buckets"]

T = TypeVar("T")
PushTransport = Literal["auto", "shm", "ucx", "zmq", "gloo", "nccl", "ipc", "rpc"]
_TRANSPORTS = ("auto", "shm", "ucx", "zmq", "gloo", "nccl", "ipc", "rpc")
_ON_GPU = ("nccl",)  # frame kinds whose buffers stay on the publisher's GPU
_IPC_BUFFERS = 2  # GPU buffers an IPC push alternates between


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


@dataclass(slots=True)
class _Lanes:
    """Where each replica's buckets go: frame senders by medium, and the replicas fed by IPC."""

    cpu: list[Any] = field(default_factory=list)  # senders of host-memory frames
    gpu: list[Any] = field(default_factory=list)  # senders of GPU frames (nccl)
    ipc: list[int] = field(default_factory=list)  # replica indices fed by CUDA IPC
    kinds: list[str] = field(default_factory=list)  # each replica's kind

    @property
    def senders(self) -> list[Any]:
        return self.cpu + self.gpu


class WeightPublisher:
    """Pushes trainer weights to every replica of a rollout group.

    Args:
        group: the `RolloutActor` group.
        transport: "auto" (each replica's by locality), "shm", "ucx", "zmq", "gloo", "nccl"
            or "ipc" (that kind for every replica), or "rpc".
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
        self._lanes: _Lanes | None = None
        self._sending = threading.Lock()  # held by the thread sending a bucket (see close)
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._exporter: Any = None  # IpcExporter, made on the first IPC push

    async def _connect(self) -> _Lanes:
        if self._lanes is None:
            import os

            from earl.runtime.locality import host_id
            from earl.runtime.transport.route import open_sender
            from earl.stages.weights_inbox import COLLECTIVE, gpu_uuid

            prefer = "" if self.transport == "auto" else self.transport
            key = os.urandom(32)  # keys this publisher's gloo/nccl pairs
            # each replica picks by our host and GPU, or makes the kind asked for
            addrs = await self.group.weights_address.call(host_id(), prefer, gpu_uuid(), key)
            lanes = _Lanes()
            for i, addr in enumerate(addrs):
                kind = addr.split("://", 1)[0]
                lanes.kinds.append(kind)
                if kind == "ipc":
                    lanes.ipc.append(i)
                elif kind in COLLECTIVE:  # the pair was keyed with what we sent
                    (lanes.gpu if kind in _ON_GPU else lanes.cpu).append(
                        _PairSender(addr, kind, key))
                else:
                    lanes.cpu.append(open_sender(addr))
            self._lanes = lanes
        return self._lanes

    def _wire(self, name: str, t: torch.Tensor, device: str = "cpu") -> torch.Tensor:
        """`t` as it goes on the wire: on `device`, contiguous, in `dtype`. Casts and device
        copies land in a buffer kept per tensor, so repeated pushes write warm memory."""
        t = t.detach()
        dtype = self.dtype or t.dtype
        on = t.device.type == device
        if on and t.dtype == dtype and t.is_contiguous():
            return t
        buf = self._buffers.get((name, device))
        if buf is None or buf.shape != t.shape or buf.dtype != dtype:
            buf = self._buffers[(name, device)] = torch_empty(t.shape, dtype, device)
        buf.copy_(t)
        return buf

    async def push(self, named: Named, *, version: int,
                   mode: UpdateMode = "inflight") -> WeightSync:
        """Send all tensors and load them on every replica; returns when all have switched.
        `mode`: what each replica does with the requests it is running
        (`earl.stages.vllm_engine.VLLMEngine.update_weights`).

        Over frames and IPC (any transport but "rpc") the replicas start loading as the first
        bucket arrives, so transfer and load overlap.
        """
        t0 = time.perf_counter()
        plan = plan_buckets(named, self.bucket_bytes, self.dtype)
        nbytes = 0
        if self.transport != "rpc":
            lanes = await self._connect()
            commit = asyncio.ensure_future(_await(self.group.commit_weights.call(
                version, mode, len(plan))))
            sending = asyncio.ensure_future(self._send_plan(lanes, plan))
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
            kinds = lanes.kinds
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

    async def _send_plan(self, lanes: _Lanes, plan: list[list[tuple[str, Any]]]) -> int:
        """Send every bucket of `plan` to every replica; the bytes sent per replica."""
        nbytes = 0
        acks: list[asyncio.Future[Any]] = []  # IPC buckets not yet loaded, oldest first
        try:
            for i, bucket in enumerate(plan):
                if lanes.cpu:
                    header, bufs = encode_bucket([(k, self._wire(k, t)) for k, t in bucket])
                    await asyncio.to_thread(self._send_locked, lanes.cpu, header, bufs)
                if lanes.gpu:
                    header, tens = encode_tensors([(k, self._wire(k, t, "cuda"))
                                                   for k, t in bucket])
                    await asyncio.to_thread(self._send_locked, lanes.gpu, header, tens)
                if lanes.ipc:
                    if len(acks) == _IPC_BUFFERS:  # the buffer about to be reused is loaded
                        await acks.pop(0)
                    message = await asyncio.to_thread(self._export, bucket, i % _IPC_BUFFERS)
                    acks.append(asyncio.ensure_future(_await(asyncio.gather(
                        *(self.group[r].ipc_bucket.call_one(message) for r in lanes.ipc)))))
                nbytes += sum(t.numel() * (self.dtype or t.dtype).itemsize for _, t in bucket)
            for ack in acks:
                await ack
        finally:
            for ack in acks:
                ack.cancel()
        return nbytes

    def _export(self, bucket: list[tuple[str, Any]], index: int) -> dict[str, Any]:
        if self._exporter is None:
            from earl.stages.weights_ipc import IpcExporter

            self._exporter = IpcExporter()
        return self._exporter.export(bucket, index, self.dtype)  # type: ignore[no-any-return]

    def _send_locked(self, senders: list[Any], header: bytes, bufs: list[Any]) -> None:
        with self._sending:
            _send_all(senders, header, bufs)

    def close(self) -> None:
        """Close the senders, once no thread sends through them (a push cancelled or failed
        mid-bucket leaves its thread to finish: a transport closed under it may crash)."""
        senders = self._lanes.senders if self._lanes is not None else []
        self._lanes = None
        if self._exporter is not None:
            self._exporter.close()
            self._exporter = None
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


class _PairSender:
    """The publisher's end of a gloo/nccl pair, joined on the first send: the pair forms when
    both ends join, and the replica's end joins inside the `commit_weights` a push starts
    before sending (joining earlier would wait for it)."""

    def __init__(self, address: str, kind: str, key: bytes) -> None:
        self.address, self.kind, self._key = address, kind, key
        self._sender: Any = None

    def send(self, header: bytes, buffers: list[Any]) -> None:
        if self._sender is None:
            from earl.runtime.transport import connect

            self._sender = connect(self.address, secret=self._key, authenticate=True)
        self._sender.send(header, buffers)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()


async def _await(aw: Awaitable[T]) -> T:
    return await aw


def torch_empty(shape: torch.Size, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    import torch

    return torch.empty(shape, dtype=dtype, device=device)


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


def _send_all(senders: list[Any], header: bytes, bufs: list[Any]) -> None:
    for s in senders:
        s.send(header, bufs)
