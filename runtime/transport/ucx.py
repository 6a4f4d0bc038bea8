"""UCX transport via ucxx's synchronous core API (shared memory on one host, TCP or RDMA across).

Set up the way that reaches memcpy-class speed on one host: senders connect to the receiver's
*worker address* (no listener), endpoint error handling off, and blocking progress (the default
progress-thread mode halves throughput). Each frame is a small control message on a shared tag
(sender tag, header length, buffer sizes) followed by the payload on the sender's own tag, so
many senders can feed one receiver. Receive buffers come from a size-keyed pool and are reused
after `Frame.release()`.

Not here: the choice between UCX transports (UCX_TLS decides: sm, tcp, rc...).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from functools import partial

import numpy as np

from earl.runtime.transport.base import Buffer, BufferPool, Frame, TransportError, as_bytes_view

_CTRL_TAG = 1
_CTRL_BYTES = 64 * 1024
_MAX_BUFS = (_CTRL_BYTES - 24) // 8


def _ucx():  # type: ignore[no-untyped-def]
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the ucx transport needs ucxx: pip install ucxx-cu12") from e
    return ucx_api, Array


def _worker():  # type: ignore[no-untyped-def]
    ucx_api, _ = _ucx()
    ctx = ucx_api.UCXContext(feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
    worker = ucx_api.UCXWorker(ctx)
    worker.init_blocking_progress_mode()
    return ctx, worker


def _wait(worker, requests, deadline: float | None) -> bool:  # type: ignore[no-untyped-def]
    while not all(r.completed for r in requests):
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            worker.progress_worker_event(max(1, int(left * 1000)))
        else:
            worker.progress_worker_event(100)
    for r in requests:
        r.check_error()
    return True


class UcxSender:
    def __init__(self, address: str) -> None:
        if not address.startswith("ucx://"):
            raise ValueError(f"address {address!r} is not a ucx:// address")
        ucx_api, self._Array = _ucx()
        self._ctx, self._worker = _worker()
        remote = ucx_api.UCXAddress.create_from_buffer(bytes.fromhex(address[len("ucx://") :]))
        self._ep = ucx_api.UCXEndpoint.create_from_worker_address(self._worker, remote, False)
        self._api = ucx_api
        self._tag = (os.getpid() << 20 | id(self) & 0xFFFFF) << 2 | 2  # never equals _CTRL_TAG
        self._ctrl = np.zeros(_CTRL_BYTES, np.uint8)
        self._staging = np.empty(0, np.uint8)

    def send(self, header: bytes, buffers: Sequence[Buffer]) -> None:
        views = [as_bytes_view(b) for b in buffers]
        if len(views) > 1:  # coalesce: one large message beats many small ones
            total = sum(v.nbytes for v in views)
            if self._staging.nbytes < total:
                self._staging = np.empty(total, np.uint8)
            off = 0
            for v in views:
                self._staging[off : off + v.nbytes] = np.frombuffer(v, np.uint8)
                off += v.nbytes
            payload = [self._staging[:total]]
            sizes = [v.nbytes for v in views]
        else:
            payload = [np.frombuffer(v, np.uint8) for v in views]
            sizes = [v.nbytes for v in views]
        if len(sizes) > _MAX_BUFS:
            raise ValueError(f"ucx frames carry at most {_MAX_BUFS} buffers, got {len(sizes)}")
        ctrl = struct.pack(f"<QQI{len(sizes)}Q", self._tag, len(header), len(sizes), *sizes)
        self._ctrl[: len(ctrl)] = np.frombuffer(ctrl, np.uint8)
        tag = self._api.UCXXTag
        reqs = [self._ep.tag_send(self._Array(self._ctrl[: len(ctrl)]), tag(_CTRL_TAG))]
        hdr = np.frombuffer(header, np.uint8) if header else None
        if hdr is not None:
            reqs.append(self._ep.tag_send(self._Array(hdr), tag(self._tag)))
        reqs += [self._ep.tag_send(self._Array(p), tag(self._tag)) for p in payload if p.nbytes]
        try:
            _wait(self._worker, reqs, None)
        except Exception as e:
            raise TransportError(f"ucx send failed: {e}") from e

    def close(self) -> None:
        self._ep.close_blocking() if hasattr(self._ep, "close_blocking") else None


class UcxReceiver:
    def __init__(self) -> None:
        ucx_api, self._Array = _ucx()
        self._api = ucx_api
        self._ctx, self._worker = _worker()
        self._addr = self._worker.address.tobytes().hex()
        self._ctrl = np.zeros(_CTRL_BYTES, np.uint8)
        self._ctrl_req = None
        self._pool = BufferPool()

    @property
    def address(self) -> str:
        return f"ucx://{self._addr}"

    def recv(self, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        tag = self._api.UCXXTag
        if self._ctrl_req is None:
            self._ctrl_req = self._worker.tag_recv(self._Array(self._ctrl), tag(_CTRL_TAG))
        if not _wait(self._worker, [self._ctrl_req], deadline):
            raise TimeoutError(f"no frame within {timeout} s")  # request stays posted
        self._ctrl_req = None
        sender_tag, hlen, n = struct.unpack_from("<QQI", self._ctrl.data)
        sizes = struct.unpack_from(f"<{n}Q", self._ctrl.data, 20)
        header = np.empty(hlen, np.uint8)
        total = sum(sizes)
        buf = self._pool.take(total)
        reqs = []
        if hlen:
            reqs.append(self._worker.tag_recv(self._Array(header), tag(sender_tag)))
        if total:
            reqs.append(self._worker.tag_recv(self._Array(buf), tag(sender_tag)))
        try:
            _wait(self._worker, reqs, None)
        except Exception as e:
            raise TransportError(f"ucx receive failed: {e}") from e
        mv = buf.data
        bufs, off = [], 0
        for s in sizes:
            bufs.append(mv[off : off + s])
            off += s

        return Frame(header=header.tobytes(), buffers=bufs,
                     _on_release=partial(self._pool.give, buf))

    def close(self) -> None:
        self._pool.clear()


class UcxTransport:
    name = "ucx"

    def listen(self) -> UcxReceiver:
        return UcxReceiver()

    def connect(self, address: str) -> UcxSender:
        return UcxSender(address)
