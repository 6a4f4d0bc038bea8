"""The one small protocol every transport implements, plus the array codec on top of it.

A transport moves one *frame* -- a small header plus a list of byte buffers -- from a sender
process to a receiver process. It knows nothing about samples, columns or the dock; the codec
here (`pack_arrays` / `unpack_arrays`) turns named numpy arrays into a frame and back.

Transports are plugins by name (`shm`, `ucx`, `zmq`, `gloo`, `nccl`); `runtime.transport.choose`
picks one by locality. Receivers own an address string (``"<name>://..."``) that any process can
pass around (RPC, a directory) and hand to `connect`.

Buffer lifetime: a `Frame`'s buffers stay valid until `Frame.release()`; zero-copy transports
(shm) hand out read-only views into memory they reuse, so a consumer that keeps data past
`release` must copy it (`unpack_arrays(frame, copy=True)`).
"""

from __future__ import annotations

import json
import threading
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

Buffer = bytes | bytearray | memoryview | np.ndarray


@dataclass(slots=True)
class Frame:
    """What a receiver gets: a header and buffers valid until the last `release()`.

    `retain()` adds a reference (e.g. while peers read a forwarded shm frame); the buffers go
    back to the transport when every reference is released.
    """

    header: bytes
    buffers: list[memoryview]
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    _refs: int = field(default=1, repr=False)

    def retain(self) -> None:
        if self._on_release is None and self._refs <= 0:
            raise ValueError("cannot retain a released frame")
        self._refs += 1

    def release(self) -> None:
        """Drop one reference; the last one gives the buffers back (extra calls are no-ops)."""
        if self._refs <= 0:
            return
        self._refs -= 1
        if self._refs == 0:
            cb, self._on_release = self._on_release, None
            if cb is not None:
                cb()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)


class BufferPool:
    """Receive buffers reused by exact size, for transports that copy into memory they own
    (ucx, gloo): first touch of fresh pages costs ~10x a warm copy on this machine. Thread-safe,
    since `Frame.release()` may run on any thread."""

    def __init__(self) -> None:
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 buffer of `nbytes`: a released one of that size if any, else a new one."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return np.empty(nbytes, np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """Return `buf` (from `take`) for reuse."""
        with self._lock:
            self._free[buf.nbytes].append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


@runtime_checkable
class Sender(Protocol):
    def send(self, header: bytes, buffers: Sequence[Buffer]) -> None:
        """Send one frame; returns once the caller may reuse `buffers`."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Receiver(Protocol):
    @property
    def address(self) -> str:
        """Where senders connect: ``"<transport>://..."``."""
        ...

    def recv(self, timeout: float | None = None) -> Frame:
        """Block for the next frame; raises TimeoutError after `timeout` seconds."""
        ...

    def close(self) -> None: ...


class Transport(Protocol):
    name: str

    def listen(self) -> Receiver: ...

    def connect(self, address: str) -> Sender: ...


class TransportError(RuntimeError):
    """The peer went away or the link failed mid-transfer."""


def as_bytes_view(buf: Buffer) -> memoryview:
    """A flat, byte-typed view of a contiguous buffer (no copy)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("transport buffers must be C-contiguous; call np.ascontiguousarray")
        return buf.reshape(-1).view(np.uint8).data
    return memoryview(buf).cast("B")


# ---------------------------------------------------------------------------------------------
# Array codec: named arrays <-> (header, buffers)


def pack_arrays(
    arrays: Mapping[str, np.ndarray], meta: Mapping[str, object] | None = None
) -> tuple[bytes, list[np.ndarray]]:
    """Encode named arrays as a frame header plus one buffer per array (no copy).

    Args:
        arrays: name -> array; non-contiguous arrays are made contiguous (a copy).
        meta: small JSON-serializable extras carried in the header.

    Returns:
        (header, buffers) ready for `Sender.send`.
    """
    specs = []
    bufs = []
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"array {name!r} is {type(arr).__name__}; pass a numpy array")
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")  # (np.ascontiguousarray would turn 0-d into 1-d)
        specs.append([name, arr.dtype.str, list(arr.shape)])
        bufs.append(arr)
    header = json.dumps({"a": specs, "m": dict(meta or {})}, separators=(",", ":")).encode()
    return header, bufs


def unpack_arrays(
    frame: Frame, *, copy: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, object]]:
    """Decode a frame made by `pack_arrays` into (arrays, meta).

    With ``copy=False`` the arrays are views into the frame's buffers (read-only for shm), valid
    until `frame.release()`.
    """
    doc = json.loads(frame.header)
    specs = doc["a"]
    if len(specs) != len(frame.buffers):
        raise TransportError(f"frame has {len(frame.buffers)} buffers, header names {len(specs)}")
    out: dict[str, np.ndarray] = {}
    for (name, dtype, shape), buf in zip(specs, frame.buffers, strict=True):
        arr = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        out[name] = arr.copy() if copy else arr
    return out, doc["m"]
