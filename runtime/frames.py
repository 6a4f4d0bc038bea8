"""Frame format and the framing protocol shared by both ends of an actor connection.

One frame on the byte stream (little endian):

    u32 frame_len | u8 magic 0xE7 | u8 kind | u16 nbufs | u64 request_id | u32 body_len
    | nbufs x u32 buffer lengths | msgpack body | buffers ... | [32-byte HMAC-SHA256]

`frame_len` counts every byte after itself, so a receiver can skip a frame it refuses (oversized,
bad MAC) and stay in sync; a bad magic byte means the stream is garbage and the connection is
closed. With a shared secret, the server opens each connection with a HELLO frame carrying a
random nonce; both sides then MAC every frame with a key derived from (secret, nonce), a
direction byte and a per-direction sequence number, so frames cannot be forged, replayed,
reordered or reflected. Without a secret, HELLO carries an empty nonce and no MAC is sent.

Authentication comes before allocation: right after HELLO each side sends a MAC'd AUTH frame,
and until a peer's first frame has passed its MAC check that peer may not declare a frame larger
than `UNAUTH_MAX_BYTES` (such frames are parsed in the connection's fixed 64 KiB buffer) and one
bad MAC closes the connection. So an unauthenticated peer costs at most that buffer, and a
client with the wrong secret fails at connect time (mutual authentication). Without a secret
(unix sockets, private to the user), a peer is trusted from its first frame, but a large frame's
buffer is an anonymous mapping whose pages are committed only as its bytes arrive: a header
announcing 256 MiB costs address space, not memory, until 256 MiB are sent. Servers also cap how
many connections may be unauthenticated at once and for how long (`earl.runtime.server`).

Frames sent during one event-loop iteration are coalesced into one write (writev) at the end of
the iteration: pipelined calls then cost one syscall per batch instead of one per call, while a
lone call waits for nothing but the end of the current callback.

Receiving uses `asyncio.BufferedProtocol`: small frames are parsed in place from one reusable
buffer; a frame larger than that buffer is read straight into its own bytearray, and its arrays
alias it (zero-copy). This module knows nothing about endpoints or values (see `wire`).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import logging
import mmap
import os
import struct
from typing import Any

log = logging.getLogger("earl.runtime")

HEADER = struct.Struct("<IBBHQI")
MAGIC = 0xE7
MAC_LEN = 32
_SMALL = 1 << 16
UNAUTH_MAX_BYTES = _SMALL  # largest frame a peer may send before its first MAC has verified


class Kind(enum.IntEnum):
    HELLO = 1
    CALL = 2
    ONEWAY = 3
    STREAM = 4
    CANCEL = 5
    OK = 6
    ERR = 7
    ITEM = 8
    END = 9
    REJECT = 10
    CREDIT = 11  # stream flow control: the consumer grants more ITEMs
    AUTH = 12  # empty MAC'd frame each side sends right after HELLO (proves the secret)


STREAM_WINDOW = 256  # ITEM frames a stream may send ahead of its consumer


class FrameTooLarge(ValueError):
    """A frame exceeds the configured `max_message_bytes`."""


def check_size(body: bytes, bufs: list[Any], max_bytes: int) -> None:
    """Raise FrameTooLarge now if (body, bufs) cannot be sent under `max_bytes`."""
    size = 20 + 4 * len(bufs) + len(body) + sum(memoryview(b).nbytes for b in bufs) + MAC_LEN
    if size > max_bytes:
        raise FrameTooLarge(f"message of {size} bytes exceeds max_message_bytes={max_bytes}; "
                            "send big tensors over earl.runtime.transport or raise "
                            "RuntimeConfig.max_message_bytes")


def derive_key(secret: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret, b"earl-rpc-v1" + nonce, hashlib.sha256).digest()


class _Hmac:
    """HMAC-SHA256 under one key, with the padded-key hash states computed once (RFC 2104):
    per frame it costs two hash copies instead of `hmac.digest`'s fresh OpenSSL context (~3x)."""

    __slots__ = ("inner", "outer")

    def __init__(self, key: bytes) -> None:
        block = key.ljust(64, b"\0")  # keys are 32 bytes (derive_key): no pre-hash needed
        self.inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self.outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def digest(self, prefix: bytes, parts: Any) -> bytes:
        h = self.inner.copy()
        if len(parts) == 1 and len(parts[0]) <= 4096:  # small: one update (copying is cheaper)
            h.update(prefix + parts[0])
        else:
            h.update(prefix)
            for p in parts:
                h.update(p)
        o = self.outer.copy()
        o.update(h.digest())
        return o.digest()  # type: ignore[no-any-return]


class FrameProtocol(asyncio.BufferedProtocol):
    """Parses and writes frames; subclasses implement `frame_received` / `frame_refused`."""

    send_dir = b"C"  # direction byte mixed into the MAC; servers use b"S"

    def __init__(self, *, max_bytes: int, secret: bytes | None) -> None:
        self.max_bytes = max_bytes
        self.secret = secret
        self._key: bytes | None = None  # set once the HELLO nonce is known
        self._hmac: _Hmac | None = None
        self._peer_dir = b"S"
        self.authenticated = secret is None  # a frame from the peer passed its MAC check
        self.transport: asyncio.Transport | None = None
        self._send_seq = 0
        self._recv_seq = 0
        self._buf = bytearray(_SMALL)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0
        self._big: mmap.mmap | None = None
        self._big_filled = 0
        self._discard = 0
        self._dropped = False
        self._paused = False
        self._drain: asyncio.Future[None] | None = None
        self._out: list[Any] = []
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None  # set by connection_made

    @property
    def key(self) -> bytes | None:
        """The connection's MAC key (derived from the secret and the HELLO nonce)."""
        return self._key

    @key.setter
    def key(self, key: bytes | None) -> None:
        assert key is None or len(key) <= 64
        self._key = key
        self._hmac = None if key is None else _Hmac(key)
        self._peer_dir = b"S" if self.send_dir == b"C" else b"C"  # direction byte of its MACs

    # ---- sending -------------------------------------------------------------------------
    def send(self, kind: int, rid: int, body: bytes = b"", bufs: list[Any] | tuple = ()) -> None:
        """Write one frame (coalesced into a single write or writev).

        Raises:
            FrameTooLarge: the frame exceeds `max_bytes`.
            ConnectionError: the connection is closed.
        """
        t = self.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("connection closed")
        if not bufs:  # fast path: the common small call or reply
            hm = self._hmac
            flen = 16 + len(body) + (MAC_LEN if hm is not None else 0)
            if flen + 4 > self.max_bytes:
                check_size(body, [], self.max_bytes)
            frame = HEADER.pack(flen, MAGIC, kind, 0, rid, len(body)) + body
            if hm is not None:
                frame += hm.digest(self.send_dir + self._send_seq.to_bytes(8, "little"), (frame,))
                self._send_seq += 1
            self._out.append(frame)
        else:
            self._send_slow(kind, rid, body, bufs)
        if not self._flush_scheduled:
            if self._loop is None:
                return
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)
        elif len(self._out) >= 512:  # bound the queue; lets pause_writing() see pressure
            self._flush()
            self._flush_scheduled = True

    def _send_slow(self, kind: int, rid: int, body: bytes, bufs: Any) -> None:
        n = len(bufs)
        mac_len = MAC_LEN if self.key is not None else 0
        if n:
            lens = [memoryview(b).nbytes for b in bufs]
            flen = 16 + 4 * n + len(body) + sum(lens) + mac_len
            head = HEADER.pack(flen, MAGIC, kind, n, rid, len(body)) + struct.pack(
                f"<{n}I", *lens)
        else:
            flen = 16 + len(body) + mac_len
            head = HEADER.pack(flen, MAGIC, kind, 0, rid, len(body))
        if flen + 4 > self.max_bytes:
            check_size(body, list(bufs), self.max_bytes)
        if n:
            parts = [head, body, *bufs]
            if mac_len:
                parts.append(self._mac(parts))
            self._out.extend(parts)
        elif mac_len:
            frame = head + body
            self._out.append(frame + self._mac((frame,)))
        else:
            self._out.append(head + body)

    def _flush(self) -> None:
        """Write everything queued this loop iteration with one write/writev."""
        self._flush_scheduled = False
        out, self._out = self._out, []
        t = self.transport
        if t is None or t.is_closing() or not out:
            return
        if len(out) == 1:
            t.write(out[0])
        elif len(out) <= 4 or any(len(b) > 16384 for b in out):  # big buffers: writev, no copy
            t.writelines(out)
        else:
            t.write(b"".join(out))  # many small frames: one copy beats a long iovec

    def _mac(self, parts: Any) -> bytes:
        assert self._hmac is not None
        prefix = self.send_dir + self._send_seq.to_bytes(8, "little")
        self._send_seq += 1
        return self._hmac.digest(prefix, parts)

    def send_hello(self) -> None:
        """Server side: open the connection with a nonce (empty without a secret)."""
        nonce = os.urandom(16) if self.secret is not None else b""
        self.send(Kind.HELLO, 0, nonce)
        if self.secret is not None:
            self.key = derive_key(self.secret, nonce)
            self.send(Kind.AUTH, 0)

    def on_authenticated(self) -> None:
        """Called once, when the peer's first frame passes its MAC check."""

    def drop(self, reason: str) -> None:
        """Close the connection because the peer sent something no earl peer sends."""
        log.warning("dropping connection: %s", reason)
        if self._out:  # answers to the frames before this one still go out
            self._flush()
        self._lo = self._hi = 0
        self._big = None
        self._dropped = True
        if self.transport is not None:
            self.transport.close()

    async def wait_writable(self) -> None:
        """Wait while the transport's write buffer is above its high-water mark."""
        while self._paused:
            if self._drain is None:
                self._drain = asyncio.get_running_loop().create_future()
            await self._drain

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # ---- receiving -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # driven by hand (tests): frames wait for an explicit _flush()
            self._loop = None

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._big is not None:
            return memoryview(self._big)[self._big_filled:]
        if self._lo == self._hi:
            self._lo = self._hi = 0
        elif self._hi > _SMALL // 2:  # compact: move the partial frame to the front
            n = self._hi - self._lo
            self._view[:n] = self._view[self._lo:self._hi]
            self._lo, self._hi = 0, n
        return self._view[self._hi:]

    def buffer_updated(self, nbytes: int) -> None:
        if self._dropped:
            return
        if self._big is not None:
            self._big_filled += nbytes
            if self._big_filled == len(self._big):
                big, self._big = self._big, None
                self._frame(memoryview(big), copy=False)
            return
        self._hi += nbytes
        view, lo, hi = self._view, self._lo, self._hi
        while True:
            avail = hi - lo
            if self._discard:
                d = min(self._discard, avail)
                lo += d
                self._discard -= d
                if self._discard:
                    break
                continue
            if avail < 20:
                break
            flen, magic, kind, nbufs, rid, blen = HEADER.unpack_from(view, lo)
            if magic != MAGIC:
                return self.drop(f"bad frame magic {magic:#x} (not an earl peer?)")
            if flen < 16:
                return self.drop(f"frame length {flen} is shorter than a header")
            total = flen + 4
            if total > UNAUTH_MAX_BYTES and not self.authenticated:  # before any allocation
                return self.drop(f"unauthenticated peer declared a {total}-byte frame")
            if total > self.max_bytes:
                log.warning("dropping oversized frame: %d bytes > max_message_bytes=%d",
                            total, self.max_bytes)
                self._discard = total
                self._recv_seq += 1
                self.frame_refused(kind, rid, f"message of {total} bytes exceeds the actor's "
                                   f"max_message_bytes={self.max_bytes}")
                continue
            if avail < total:
                if total > _SMALL:  # read the rest of this frame straight into its own buffer
                    # an anonymous mapping: pages are committed as bytes arrive, so a header
                    # that declares a big frame costs address space, not memory
                    self._big = mmap.mmap(-1, total)
                    self._big[:avail] = view[lo:hi]
                    self._big_filled = avail
                    lo = hi = 0
                break
            hm = self._hmac
            if nbufs:
                self._frame(view[lo:lo + total], copy=True)
            elif hm is None:
                if blen + 20 == total:  # fast path: plain frame, no buffers, no MAC
                    self.frame_received(kind, rid, view[lo + 20:lo + total], [])
                else:
                    self._frame(view[lo:lo + total], copy=True)
            elif blen + 20 + MAC_LEN == total and self.authenticated and hmac.compare_digest(
                    hm.digest(self._peer_dir + self._recv_seq.to_bytes(8, "little"),
                              (view[lo:lo + total - MAC_LEN],)),
                    view[lo + total - MAC_LEN:lo + total]):  # fast path: small MAC'd frame
                self._recv_seq += 1
                self.frame_received(kind, rid, view[lo + 20:lo + total - MAC_LEN], [])
            else:  # the slow path checks again, and handles failures and the first frame
                self._frame(view[lo:lo + total], copy=True)
            if self._dropped:
                return
            lo += total
        self._lo, self._hi = lo, hi
        if self._out:  # answers produced while parsing this read go out now, in one write
            self._flush()

    def _frame(self, mv: memoryview, copy: bool) -> None:
        _, _, kind, n, rid, blen = HEADER.unpack_from(mv, 0)
        mac_len = MAC_LEN if self.key is not None else 0
        try:
            lens = struct.unpack_from(f"<{n}I", mv, 20) if n else ()
        except struct.error:
            lens = ()
        off = 20 + 4 * n
        if off + blen + sum(lens) + mac_len != len(mv):
            if not self.authenticated:
                return self.drop("malformed frame from an unauthenticated peer")
            log.warning("dropping malformed frame: lengths do not add up")
            self._recv_seq += 1 if mac_len else 0
            self.frame_refused(kind, rid, "malformed frame: lengths do not add up")
            return
        if mac_len:
            assert self._hmac is not None
            prefix = self._peer_dir + self._recv_seq.to_bytes(8, "little")
            self._recv_seq += 1
            digest = self._hmac.digest(prefix, (mv[:len(mv) - MAC_LEN],))
            if not hmac.compare_digest(digest, mv[len(mv) - MAC_LEN:]):
                if not self.authenticated:
                    return self.drop("first frame failed authentication (wrong secret?)")
                log.warning("dropping frame with a bad MAC (wrong secret or tampered)")
                self.frame_refused(kind, rid, "frame failed authentication")
                return
            if not self.authenticated:
                self.authenticated = True
                self.on_authenticated()
        body = mv[off:off + blen]
        off += blen
        bufs = []
        for ln in lens:
            b = mv[off:off + ln]
            bufs.append(bytearray(b) if copy else b)
            off += ln
        self.frame_received(kind, rid, body, bufs)

    def frame_received(self, kind: int, rid: int, body: memoryview, bufs: list[Any]) -> None:
        raise NotImplementedError

    def frame_refused(self, kind: int, rid: int, reason: str) -> None:
        """A frame was dropped (too large, malformed, bad MAC); `rid` may let us answer."""
