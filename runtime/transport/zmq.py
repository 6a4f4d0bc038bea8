"""ZeroMQ transport: the fallback that works everywhere (IPC on one host, TCP across hosts).

Frames travel as one multipart message (header + buffers, sent with ``copy=False``). The
receiver's buffers are ZMQ-owned messages, so `Frame.release()` is a no-op and the data stays
valid as long as the views are referenced. Slower than shm/ucx (fresh receive buffers each time)
but needs nothing but a socket.

A TCP receiver binds loopback unless given a `host`; off loopback every message starts with an
auth part (sender nonce, sequence number, Poly1305 tag under the run's secret: see `auth`) and
the receiver drops messages that fail it, or replay a sequence number, before handing them out.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Sequence

import zmq

from earl.runtime.transport.auth import NONCE_LEN, TAG_LEN, Mac, advertised, key_for
from earl.runtime.transport.base import Buffer, Frame, TransportError, as_bytes_view

log = logging.getLogger("earl.runtime")
_CHANNEL = b"zmq"


def _tcp_host(address: str) -> str | None:
    """The host of a ``zmq://tcp://host:port`` address (None for ipc://)."""
    endpoint = address.removeprefix("zmq://")
    if not endpoint.startswith("tcp://"):
        return None
    return endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")


class ZmqSender:
    def __init__(self, address: str, *, send_timeout_s: float = 60.0,
                 secret: bytes | None = None, authenticate: bool | None = None) -> None:
        if not address.startswith("zmq://"):
            raise ValueError(f"address {address!r} is not a zmq:// address")
        host = _tcp_host(address)
        key = None if host is None else key_for(host, secret, "zmq", authenticate)
        self._mac = None if key is None else Mac(key, _CHANNEL)
        self._nonce = os.urandom(NONCE_LEN)
        self._seq = 0
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.connect(address[len("zmq://") :])

    def send(self, header: bytes, buffers: Sequence[Buffer]) -> None:
        parts: list[Buffer] = [header, *(as_bytes_view(b) for b in buffers)]
        if self._mac is not None:
            seq = self._seq.to_bytes(8, "little")
            parts.insert(0, self._nonce + seq + self._mac.seal(self._nonce, self._seq, parts))
            self._seq += 1
        try:
            # copy=False + track: return only once zmq is done with the caller's memory
            tracker = self._sock.send_multipart(parts, copy=False, track=True)
        except zmq.Again as e:
            raise TransportError("zmq send timed out: receiver gone or not reading") from e
        if tracker is not None:
            tracker.wait()

    def close(self) -> None:
        self._sock.close()


class ZmqReceiver:
    """Binds IPC (``local=True``) or TCP on `host` (loopback unless configured)."""

    def __init__(self, *, local: bool = True, host: str = "127.0.0.1",
                 secret: bytes | None = None, authenticate: bool | None = None) -> None:
        key = None if local else key_for(host, secret, "zmq", authenticate)
        self._mac = None if key is None else Mac(key, _CHANNEL)
        self._last: dict[bytes, int] = {}  # sender nonce -> last sequence number accepted
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._dir: str | None = None
        if local:
            self._dir = tempfile.mkdtemp(prefix=f"earl-zmq-{os.getpid()}-")
            self._endpoint = f"ipc://{self._dir}/data"
            self._sock.bind(self._endpoint)
        else:
            bind = f"[{host}]" if ":" in host else host
            if ":" in host:
                self._sock.setsockopt(zmq.IPV6, 1)
            port: int = self._sock.bind_to_random_port(f"tcp://{bind}")
            where = advertised(host)
            self._endpoint = f"tcp://{f'[{where}]' if ':' in where else where}:{port}"

    @property
    def address(self) -> str:
        return f"zmq://{self._endpoint}"

    def recv(self, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if left is not None and not self._sock.poll(int(left * 1000)):
                raise TimeoutError(f"no frame within {timeout} s")
            parts = self._sock.recv_multipart(copy=False)
            if self._mac is None:
                break
            if self._authentic(parts):
                parts = parts[1:]
                break
            log.warning("zmq receiver %s: dropped a message that failed authentication",
                        self._endpoint)
        return Frame(header=parts[0].bytes, buffers=[memoryview(p.buffer) for p in parts[1:]])

    def _authentic(self, parts: list[zmq.Frame]) -> bool:
        assert self._mac is not None
        auth = parts[0].bytes
        if len(parts) < 2 or len(auth) != 24 + TAG_LEN:
            return False
        nonce, seq = auth[:16], int.from_bytes(auth[16:24], "little")
        if seq <= self._last.get(nonce, -1):
            return False  # a replay
        try:
            self._mac.open(nonce, seq, [p.buffer for p in parts[1:]], auth[24:])
        except TransportError:
            return False
        self._last[nonce] = seq
        return True

    def close(self) -> None:
        self._sock.close(0)
        if self._dir is not None:
            try:
                os.unlink(f"{self._dir}/data")
                os.rmdir(self._dir)
            except OSError:
                pass


class ZmqTransport:
    """Args: local: IPC on this host (else TCP); host: TCP bind address (loopback by default;
    anything else authenticates every message with `secret` or the run's secret);
    authenticate: force or skip that (None: off loopback only; both ends must agree)."""

    name = "zmq"

    def __init__(self, *, local: bool = True, host: str = "127.0.0.1",
                 secret: bytes | None = None, authenticate: bool | None = None) -> None:
        self._local, self._host, self._secret, self._auth = local, host, secret, authenticate

    def listen(self) -> ZmqReceiver:
        return ZmqReceiver(local=self._local, host=self._host, secret=self._secret,
                           authenticate=self._auth)

    def connect(self, address: str) -> ZmqSender:
        return ZmqSender(address, secret=self._secret, authenticate=self._auth)
