"""ZeroMQ transport: the fallback that works everywhere (IPC on one host, TCP across hosts).

Frames travel as one multipart message (header + buffers, sent with ``copy=False``). The
receiver's buffers are ZMQ-owned messages, so `Frame.release()` is a no-op and the data stays
valid as long as the views are referenced. Slower than shm/ucx (fresh receive buffers each time)
but needs nothing but a socket.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Sequence

import zmq

from earl.runtime.transport.base import Buffer, Frame, TransportError, as_bytes_view


class ZmqSender:
    def __init__(self, address: str, *, send_timeout_s: float = 60.0) -> None:
        if not address.startswith("zmq://"):
            raise ValueError(f"address {address!r} is not a zmq:// address")
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.connect(address[len("zmq://") :])

    def send(self, header: bytes, buffers: Sequence[Buffer]) -> None:
        parts = [header, *(as_bytes_view(b) for b in buffers)]
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
    """Binds IPC (``local=True``) or TCP on all interfaces."""

    def __init__(self, *, local: bool = True) -> None:
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._dir: str | None = None
        if local:
            self._dir = tempfile.mkdtemp(prefix="earl-zmq-")
            self._endpoint = f"ipc://{self._dir}/data"
            self._sock.bind(self._endpoint)
        else:
            port: int = self._sock.bind_to_random_port("tcp://0.0.0.0")
            self._endpoint = f"tcp://{socket.gethostname()}:{port}"

    @property
    def address(self) -> str:
        return f"zmq://{self._endpoint}"

    def recv(self, timeout: float | None = None) -> Frame:
        if timeout is not None and not self._sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no frame within {timeout} s")
        parts = self._sock.recv_multipart(copy=False)
        return Frame(header=parts[0].bytes, buffers=[memoryview(p.buffer) for p in parts[1:]])

    def close(self) -> None:
        self._sock.close(0)
        if self._dir is not None:
            try:
                os.unlink(f"{self._dir}/data")
                os.rmdir(self._dir)
            except OSError:
                pass


class ZmqTransport:
    name = "zmq"

    def __init__(self, *, local: bool = True) -> None:
        self._local = local

    def listen(self) -> ZmqReceiver:
        return ZmqReceiver(local=self._local)

    def connect(self, address: str) -> ZmqSender:
        return ZmqSender(address)
