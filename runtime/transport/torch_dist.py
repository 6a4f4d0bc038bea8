"""torch.distributed point-to-point transport: gloo for CPU tensors, NCCL for CUDA tensors.

Each receiver hosts a TCPStore; one sender joins it to form a private 2-rank process group (no
global `init_process_group`, so it coexists with a trainer's own groups). A frame is a fixed-size
int64 meta tensor (header length, buffer sizes) followed by the header and each buffer.

For ``nccl`` the payload travels as CUDA tensors: the receiver's `Frame.buffers` is empty and
`Frame.tensors` (see `TorchFrame`) holds one uint8 CUDA tensor per buffer.

The store and gloo's own sockets bind loopback unless the receiver is given a `host`. Off
loopback, the meta tensor carries an HMAC (checked before anything is allocated for the frame)
and, for gloo, a 32-byte MAC of the header and buffers follows the payload and is checked before
the frame is handed out (see `auth`). NCCL payloads are not MAC'd (only their meta is).

Not here: collectives inside a TP group (the dispatcher's replication uses the trainer's group).
One sender per receiver: open one receiver per producer.
"""

from __future__ import annotations

import datetime
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import cast

import torch
import torch.distributed as dist

from earl.runtime.transport.auth import MAC_LEN, Mac, advertised, is_loopback, key_for
from earl.runtime.transport.base import Buffer, BufferPool, Frame, TransportError, as_bytes_view

_META = 1024  # int64 slots: [header_len, n, sizes..., (last 4: the meta's MAC off loopback)]
_MAC_SLOTS = MAC_LEN // 8
_TIMEOUT = datetime.timedelta(seconds=120)
_PG = dist.ProcessGroup  # the backends below quack like one (send/recv with tags)


@dataclass(slots=True)
class TorchFrame(Frame):
    tensors: list[torch.Tensor] = field(default_factory=list)


def _group(store: dist.Store, rank: int, backend: str, host: str) -> _PG:
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # its own sockets
        opts._timeout = _TIMEOUT
        return cast(_PG, dist.ProcessGroupGloo(store, rank, 2, opts))
    opts = dist.ProcessGroupNCCL.Options()
    return cast(_PG, dist.ProcessGroupNCCL(store, rank, 2, opts))


def _channel(address: str) -> bytes:
    return address.encode()


def _meta_mac(mac: Mac, seq: int, meta: torch.Tensor) -> bytes:
    return mac.digest(seq, [meta[:-_MAC_SLOTS].numpy()])


class TorchDistSender:
    def __init__(self, address: str, *, backend: str = "gloo", secret: bytes | None = None,
                 authenticate: bool | None = None) -> None:
        scheme = f"{backend}://"
        if not address.startswith(scheme):
            raise ValueError(f"address {address!r} is not a {scheme} address")
        host, port = address[len(scheme) :].rsplit(":", 1)
        key = key_for(host, secret, backend, authenticate)
        self._mac = None if key is None else Mac(key, _channel(address))
        self._seq = 0
        self._backend = backend
        self._store = dist.TCPStore(host, int(port), is_master=False, timeout=_TIMEOUT)
        if self._store.add("senders", 1) != 1:
            raise ValueError(f"{address} already has a sender; {backend} channels are 1:1")
        self._pg = _group(self._store, 1, backend, host if is_loopback(host) else
                          socket.gethostname())
        self._meta = torch.zeros(_META, dtype=torch.int64)

    def send(self, header: bytes, buffers: Sequence[Buffer | torch.Tensor]) -> None:
        tensors = [_as_u8_tensor(b) for b in buffers]
        if len(tensors) > _META - 2:
            raise ValueError(f"{self._backend} frames carry at most {_META - 2} buffers")
        self._meta.zero_()
        self._meta[0], self._meta[1] = len(header), len(tensors)
        for i, t in enumerate(tensors):
            self._meta[2 + i] = t.numel()
        msgs = [self._meta]
        if header:
            msgs.append(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        msgs += [t for t in tensors if t.numel()]
        if self._mac is not None:
            seq, self._seq = self._seq, self._seq + 1
            self._meta[-_MAC_SLOTS:] = torch.tensor(
                struct.unpack("<4q", _meta_mac(self._mac, seq, self._meta)))
            if self._backend == "gloo":  # the payload's MAC goes last
                body = [header, *(t.numpy() for t in tensors)]
                msgs.append(torch.frombuffer(bytearray(self._mac.digest(seq, body)),
                                             dtype=torch.uint8))
        try:
            for m in msgs:
                if self._backend == "nccl":
                    m = m.cuda()
                self._pg.send([m], 0, 0).wait()  # the receiver is rank 0
        except RuntimeError as e:
            raise TransportError(f"{self._backend} send failed: {e}") from e

    def close(self) -> None:
        self._pg = None  # type: ignore[assignment]


def _as_u8_tensor(b: Buffer | torch.Tensor) -> torch.Tensor:
    if isinstance(b, torch.Tensor):
        return b.contiguous().view(torch.uint8).reshape(-1)
    v = as_bytes_view(b)
    if v.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(v, dtype=torch.uint8)


class TorchDistReceiver:
    """Args: backend: "gloo" or "nccl"; host: where the store and gloo listen (loopback by
    default; anything else authenticates frames with `secret` or the run's secret);
    authenticate: force or skip that (None: off loopback only; both ends must agree)."""

    def __init__(self, *, backend: str = "gloo", host: str = "127.0.0.1",
                 secret: bytes | None = None, authenticate: bool | None = None) -> None:
        self._backend = backend
        key = key_for(host, secret, backend, authenticate)
        self._bind = host
        self._host = advertised(host)
        # TCPStore's own server listens on every interface: hand it a socket bound to `host`
        self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._listener.bind((host, 0))
        self._listener.listen(128)
        self._store = dist.TCPStore(
            self._host, self._listener.getsockname()[1], is_master=True,
            wait_for_workers=False, timeout=_TIMEOUT, master_listen_fd=self._listener.fileno())
        # the store owns the descriptor now and closes it when it goes: this socket object
        # must not close it too (the number may belong to another socket by then)
        self._listener.detach()
        self._mac = None if key is None else Mac(key, _channel(self.address))
        self._seq = 0
        self._pg: _PG | None = None
        self._meta = torch.zeros(_META, dtype=torch.int64)
        self._meta_work: dist.Work | None = None
        self._pool = BufferPool()

    @property
    def address(self) -> str:
        return f"{self._backend}://{self._host}:{self._store.port}"

    def recv(self, timeout: float | None = None) -> Frame:
        wait = _TIMEOUT if timeout is None else datetime.timedelta(seconds=timeout)
        if self._pg is None:
            try:
                self._store.wait(["senders"], wait)
            except RuntimeError as e:  # torch raises DistStoreError (a RuntimeError)
                raise TimeoutError(f"no sender within {timeout} s") from e
            self._pg = _group(self._store, 0, self._backend,
                              self._bind if is_loopback(self._bind) else socket.gethostname())
        meta = self._meta.cuda() if self._backend == "nccl" else self._meta
        if self._meta_work is None:
            self._meta_work = self._pg.recv([meta], 1, 0)
        try:
            self._meta_work.wait(wait)
        except RuntimeError as e:
            if "imeout" in str(e) or "imed out" in str(e):
                raise TimeoutError(f"no frame within {timeout} s") from e
            raise TransportError(f"{self._backend} receive failed: {e}") from e
        self._meta_work = None
        meta_cpu = meta.cpu()
        seq = self._seq
        if self._mac is not None:  # before allocating anything the meta asks for
            self._seq += 1
            self._mac.check(seq, [meta_cpu[:-_MAC_SLOTS].numpy()],
                            meta_cpu[-_MAC_SLOTS:].numpy())
        m = meta_cpu.tolist()
        hlen, sizes = m[0], m[2 : 2 + m[1]]
        dev = "cuda" if self._backend == "nccl" else "cpu"
        header = torch.empty(hlen, dtype=torch.uint8, device=dev)
        try:
            if hlen:
                self._recv(header)
            header = header.cpu()
            if self._backend == "nccl":
                tensors = [torch.empty(s, dtype=torch.uint8, device="cuda") for s in sizes]
                for t in tensors:
                    if t.numel():
                        self._recv(t)
                return TorchFrame(header=header.numpy().tobytes(), buffers=[], tensors=tensors)
            total = sum(sizes)
            buf = self._pool.take(total)
            views, off = [], 0
            for s in sizes:
                if s:
                    self._recv(torch.from_numpy(buf[off : off + s]))
                views.append(buf[off : off + s].data)
                off += s
            if self._mac is not None:
                mac = torch.empty(MAC_LEN, dtype=torch.uint8)
                self._recv(mac)
                try:
                    self._mac.check(seq, [header.numpy(), *views], mac.numpy())
                except TransportError:
                    self._pool.give(buf)
                    raise
        except RuntimeError as e:
            raise TransportError(f"{self._backend} receive failed: {e}") from e

        return Frame(header=header.numpy().tobytes(), buffers=views,
                     _on_release=partial(self._pool.give, buf))

    def _recv(self, t: torch.Tensor) -> None:
        assert self._pg is not None
        self._pg.recv([t], 1, 0).wait()

    def close(self) -> None:
        # the store's server, and the listening socket it owns, go with the last reference
        # to it (the group holds one)
        self._pg = self._meta_work = None
        self._store = None  # type: ignore[assignment]
        self._pool.clear()


class GlooTransport:
    name = "gloo"
    backend = "gloo"

    def __init__(self, *, host: str = "127.0.0.1", secret: bytes | None = None,
                 authenticate: bool | None = None) -> None:
        self._host, self._secret, self._auth = host, secret, authenticate

    def listen(self) -> TorchDistReceiver:
        return TorchDistReceiver(backend=self.backend, host=self._host, secret=self._secret,
                                 authenticate=self._auth)

    def connect(self, address: str) -> TorchDistSender:
        return TorchDistSender(address, backend=self.backend, secret=self._secret,
                               authenticate=self._auth)


class NcclTransport(GlooTransport):
    name = "nccl"
    backend = "nccl"
