"""UCX transport via ucxx's synchronous core API (shared memory on one host, TCP or RDMA across).

Set up the way that reaches memcpy-class speed on one host: senders connect to the receiver's
*worker address* (no listener), endpoint error handling off, and blocking progress (the default
progress-thread mode halves throughput). Each frame is a small control message on a shared tag
(sender tag, header length, buffer sizes) followed by the payload on the sender's own tag, so
many senders can feed one receiver. Receive buffers come from a size-keyed pool and are reused
after `Frame.release()`.

Network devices: loopback only (``UCX_NET_DEVICES=lo``) unless a `host` is configured; then UCX
uses every device and each frame is authenticated: its control message carries a sequence
number and the sender's nonce, the control message's HMAC (checked before the receiver allocates
anything) and the payload's Poly1305 tag (checked before the frame is handed out), under the
run's secret (see `auth`).

`tls` (None: UCX's own choice, or `$UCX_TLS`) restricts the UCX transports of both ends'
workers, e.g. ``"tcp"`` for a link that must cross hosts over TCP.

Not here: choosing between UCX transports by hardware (UCX does: sm, tcp, rc...).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Sequence
from functools import partial

import numpy as np

from earl.runtime.transport.auth import MAC_LEN, NONCE_LEN, TAG_LEN, Mac, is_loopback, key_for
from earl.runtime.transport.base import Buffer, BufferPool, Frame, TransportError, as_bytes_view

_CTRL_TAG = 1
_CTRL_BYTES = 64 * 1024
# seq, the sender's nonce, the control message's HMAC, the payload's Poly1305 tag
_AUTH_BYTES = 8 + NONCE_LEN + MAC_LEN + TAG_LEN  # (authenticated channels only)
_MAX_BUFS = (_CTRL_BYTES - 24 - _AUTH_BYTES) // 8
_CHANNEL = b"ucx"


def _ucx():  # type: ignore[no-untyped-def]
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("the ucx transport needs ucxx: pip install ucxx-cu12") from e
    return ucx_api, Array


def _worker(loopback: bool, tls: str | None = None):  # type: ignore[no-untyped-def]
    ucx_api, _ = _ucx()
    config = {"NET_DEVICES": "lo"} if loopback else {}
    if tls:
        config["TLS"] = tls
    ctx = ucx_api.UCXContext(config_dict=config,
                             feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
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
    """Args: see `UcxReceiver`; send_timeout_s: how long one frame may wait for the receiver to
    take it (TransportError after)."""

    def __init__(self, address: str, *, host: str = "127.0.0.1", secret: bytes | None = None,
                 authenticate: bool | None = None, tls: str | None = None,
                 send_timeout_s: float = 120.0) -> None:
        if not address.startswith("ucx://"):
            raise ValueError(f"address {address!r} is not a ucx:// address")
        self.send_timeout_s = send_timeout_s
        key = key_for(host, secret, "ucx", authenticate)
        self._mac = None if key is None else Mac(key, _CHANNEL)
        self._seq, self._nonce = 0, os.urandom(NONCE_LEN)
        ucx_api, self._Array = _ucx()
        self._ctx, self._worker = _worker(is_loopback(host), tls)
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
        if self._mac is not None:
            seq, self._seq = self._seq, self._seq + 1
            ctrl += seq.to_bytes(8, "little") + self._nonce
            ctrl += self._mac.digest(seq, [ctrl]) + self._mac.seal(self._nonce, seq,
                                                                   [header, *views])
        self._ctrl[: len(ctrl)] = np.frombuffer(ctrl, np.uint8)
        tag = self._api.UCXXTag
        reqs = [self._ep.tag_send(self._Array(self._ctrl[: len(ctrl)]), tag(_CTRL_TAG))]
        hdr = np.frombuffer(header, np.uint8) if header else None
        if hdr is not None:
            reqs.append(self._ep.tag_send(self._Array(hdr), tag(self._tag)))
        reqs += [self._ep.tag_send(self._Array(p), tag(self._tag)) for p in payload if p.nbytes]
        try:
            done = _wait(self._worker, reqs, time.monotonic() + self.send_timeout_s)
        except Exception as e:
            raise TransportError(f"ucx send failed: {e}") from e
        if not done:
            raise TransportError(f"ucx send timed out after {self.send_timeout_s} s: the receiver "
                                 "took nothing (gone, or not receiving)")

    def close(self) -> None:
        # Not close_blocking: it hangs (even with a bounded period) while the receiver's worker
        # is idle. Every frame was received before a caller closes (its protocol confirms it).
        self._ep.close()
        self._worker.progress()


class UcxReceiver:
    """Args: host: loopback (default) keeps UCX on the lo device; anything else uses every
    device and authenticates frames with `secret` or the run's secret; authenticate: force or
    skip that (None: off loopback only; both ends must agree); tls: UCX transports to use
    (None: UCX's choice)."""

    def __init__(self, *, host: str = "127.0.0.1", secret: bytes | None = None,
                 authenticate: bool | None = None, tls: str | None = None) -> None:
        key = key_for(host, secret, "ucx", authenticate)
        self._mac = None if key is None else Mac(key, _CHANNEL)
        self._last: dict[bytes, int] = {}  # sender nonce -> last sequence number accepted
        ucx_api, self._Array = _ucx()
        self._api = ucx_api
        self._ctx, self._worker = _worker(is_loopback(host), tls)
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
        if n > _MAX_BUFS:
            raise TransportError(f"ucx control message declares {n} buffers; dropped")
        sizes = struct.unpack_from(f"<{n}Q", self._ctrl.data, 20)
        seq, nonce = self._check_ctrl(20 + 8 * n)  # before allocating what it declares
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
        if self._mac is not None:
            end = 20 + 8 * n + 8 + NONCE_LEN + MAC_LEN
            try:
                self._mac.open(nonce, seq, [header, *bufs], self._ctrl[end:end + TAG_LEN])
            except TransportError:
                self._pool.give(buf)
                raise

        return Frame(header=header.tobytes(), buffers=bufs,
                     _on_release=partial(self._pool.give, buf))

    def _check_ctrl(self, n: int) -> tuple[int, bytes]:
        """The control message's sequence number and sender nonce, once its MAC and order
        check out."""
        if self._mac is None:
            return 0, b""
        seq = int.from_bytes(self._ctrl[n:n + 8].tobytes(), "little")
        nonce = self._ctrl[n + 8:n + 8 + NONCE_LEN].tobytes()
        end = n + 8 + NONCE_LEN
        self._mac.check(seq, [self._ctrl[:end]], self._ctrl[end:end + MAC_LEN])
        if seq <= self._last.get(nonce, -1):
            raise TransportError("ucx control message replayed; dropped")
        self._last[nonce] = seq
        return seq, nonce

    def close(self) -> None:
        self._pool.clear()


class UcxTransport:
    """Args: see `UcxReceiver` (the same options apply to both ends)."""

    name = "ucx"

    def __init__(self, *, host: str = "127.0.0.1", secret: bytes | None = None,
                 authenticate: bool | None = None, tls: str | None = None) -> None:
        self._opts = {"host": host, "secret": secret, "authenticate": authenticate, "tls": tls}

    def listen(self) -> UcxReceiver:
        return UcxReceiver(**self._opts)  # type: ignore[arg-type]

    def connect(self, address: str) -> UcxSender:
        return UcxSender(address, **self._opts)  # type: ignore[arg-type]
