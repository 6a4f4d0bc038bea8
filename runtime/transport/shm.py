"""Same-host shared-memory transport with a reusable segment pool and zero-copy receive.

The sender copies a frame's buffers once into a segment it owns (``/dev/shm/earl-<run>-<pid>-<random>``)
and sends a tiny descriptor over a ZMQ control socket; the receiver maps the segment read-only
and hands out views -- no second copy. `Frame.release()` returns the segment to the sender's pool,
so steady-state transfers touch only warm pages (first touch of fresh memory costs ~10x a warm copy).
Buffers that already live in a `ShmArena` of the sender's process (the warehouse keeps experience
there) are not copied at all: the frame names their segments and offsets (kind ``M``), and the
arena keeps those bytes until the receiver releases the frame.

Every sender and receiver still open when its process exits is closed then (atexit): its
segments are unlinked and its ``earl-shm-<pid>-*`` control dir removed. Segments of a process
that died without cleaning up (SIGKILL) are unlinked by `cleanup_leaked_segments`, which every
new `ShmTransport` runs on start; `earl.runtime.cleanup.sweep` also removes its control dirs.

Not here: cross-host transfer (see ucx.py / zmq.py) or GPU memory (torch_dist.py).
"""

from __future__ import annotations

import atexit
import json
import mmap
import os
import struct
import tempfile
import threading
import time
import uuid
import weakref
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from earl.runtime.cleanup import SEGMENT_RE, SHM_DIR, cleanup_leaked_segments
from earl.runtime.transport import shm_arena
from earl.runtime.transport.base import Buffer, Frame, TransportError, as_bytes_view
from earl.runtime.transport.shm_arena import aligned

_MIN_SEGMENT = 1 << 20


_LIVE: weakref.WeakSet[ShmSender | ShmReceiver] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    """Close every sender and receiver this process still holds (segments, control dirs)."""
    for end in list(_LIVE):
        try:
            end.close()
        except Exception:  # noqa: BLE001, S110 (exiting: best effort, the sweep is the backstop)
            pass


def _segment_size(nbytes: int) -> int:
    """Round up to a multiple of 1/8 of the size's power of two (<= 25% slack), >= 1 MiB."""
    step = max(_MIN_SEGMENT, 1 << max(0, (nbytes - 1).bit_length() - 3))
    return max(_MIN_SEGMENT, -(-nbytes // step) * step)


class _Segment:
    def __init__(self, run: str, size: int, shm_dir: str) -> None:
        self.name, self.map = shm_arena.create_segment(shm_dir, run, size)
        self.size, self.path = size, os.path.join(shm_dir, self.name)
        self.view = memoryview(self.map)

    def destroy(self) -> None:
        self.view.release()
        self.map.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(slots=True)
class ShmFrame(Frame):
    """A frame mapped from a sender's segments; `ShmSender.forward` passes it on zero-copy.

    `parts` are the wire parts before the header; `release_id` is what the receiver sends back
    on release (the segment name for a pooled frame, a token for an arena frame).
    """

    parts: tuple[bytes, ...] = ()
    release_id: bytes = b""


@dataclass(frozen=True, slots=True)
class ShmStatistics:
    created: int  # segments ever created (reuse keeps this flat)
    segments: int
    pool_bytes: int
    in_flight: int


class ShmSender:
    """Copies frames into pooled segments; see module docstring.

    Args:
        address: the receiver's ``shm://`` address.
        max_pool_bytes: total segment memory; `send` waits for releases beyond it.
        max_free: idle segments kept for reuse; smaller extras are unlinked.
        release_timeout_s: how long `send` waits for a free segment before TransportError.
    """

    def __init__(
        self,
        address: str,
        *,
        max_pool_bytes: int = 4 << 30,
        release_timeout_s: float = 60.0,
        max_free: int = 4,
        shm_dir: str = SHM_DIR,
    ) -> None:
        if not address.startswith("shm://"):
            raise ValueError(f"address {address!r} is not an shm:// address")
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address[len("shm://") :])
        self._run = uuid.uuid4().hex[:8]
        self._shm_dir = shm_dir
        self._free: list[_Segment] = []
        self._busy: dict[str, _Segment] = {}
        self._forwarded: dict[str, list[Frame]] = {}
        # arena frames out: token -> (pool segment for the buffers outside an arena, lends)
        self._lent: dict[str, tuple[_Segment | None,
                                    list[tuple[shm_arena.ShmArena, shm_arena.ArenaSegment]]]] = {}
        self._pool_bytes = 0
        self._max_pool_bytes = max_pool_bytes
        self._release_timeout_s = release_timeout_s
        self._max_free = max_free
        self._seq = 0  # segments created
        self._frames = 0  # arena frames sent
        _LIVE.add(self)

    def send(self, header: bytes, buffers: Sequence[Buffer]) -> None:
        views = [as_bytes_view(b) for b in buffers]
        found = shm_arena.locate(buffers)
        self._drain_releases(0)  # frames released since: their pool and arena bytes come back
        if any(found):
            self._send_refs(header, views, found)
            return
        offsets, total = [], 0
        for v in views:
            offsets.append(total)
            total += aligned(v.nbytes)
        seg = self._acquire(max(total, 1))
        for off, v in zip(offsets, views, strict=True):
            seg.view[off : off + v.nbytes] = v
        desc = struct.pack(f"<QI{2 * len(views)}Q", seg.size, len(views), *[
            x for off, v in zip(offsets, views, strict=True) for x in (off, v.nbytes)
        ])
        self._sock.send_multipart([b"F", seg.name.encode(), desc, header], copy=False)

    def _send_refs(self, header: bytes, views: list[memoryview],
                   found: list[shm_arena.Placement | None]) -> None:
        """Send buffers in place where they lie in an arena; copy the rest into one segment."""
        seglist: list[tuple[str, int]] = []  # the frame's segments: (name, size)
        index: dict[str, int] = {}
        lends: list[tuple[shm_arena.ShmArena, shm_arena.ArenaSegment]] = []
        pool, off = None, 0
        rest = sum(aligned(v.nbytes) for v, f in zip(views, found, strict=True) if f is None)
        if rest:
            pool = self._acquire(rest)
            del self._busy[pool.name]  # released by the frame's token, with the lends
            index[pool.name] = 0
            seglist.append((pool.name, pool.size))
        triples: list[int] = []
        for v, f in zip(views, found, strict=True):
            if f is None:  # outside any arena (scalars, small extras): copied
                assert pool is not None or v.nbytes == 0
                if pool is not None:
                    pool.view[off : off + v.nbytes] = v
                triples += [0, off, v.nbytes]
                off += aligned(v.nbytes)
                continue
            arena, seg, seg_off = f
            if seg.name not in index:
                index[seg.name] = len(seglist)
                seglist.append((seg.name, seg.size))
                arena.lend(seg)
                lends.append((arena, seg))
            triples += [index[seg.name], seg_off, v.nbytes]
        self._frames += 1
        token = f"m-{self._run}-{os.getpid()}-{self._frames}"
        self._lent[token] = (pool, lends)
        self._sock.send_multipart([b"M", token.encode(), json.dumps(seglist).encode(),
                                   np.asarray(triples, np.uint64).tobytes(), header], copy=False)

    def forward(self, frame: Frame) -> None:
        """Pass a received frame on without copying when it is shm-mapped (read-only readers).

        The frame stays retained until this receiver releases it; other frames are re-sent.
        """
        if not isinstance(frame, ShmFrame):
            self.send(frame.header, frame.buffers)
            return
        frame.retain()
        self._forwarded.setdefault(frame.release_id.decode(), []).append(frame)
        self._sock.send_multipart([*frame.parts, frame.header])

    def _acquire(self, nbytes: int) -> _Segment:
        deadline = time.monotonic() + self._release_timeout_s
        graced = False
        while True:
            fits = [s for s in self._free if s.size >= nbytes]
            if fits:
                seg = min(fits, key=lambda s: s.size)
                self._free.remove(seg)
                self._busy[seg.name] = seg
                return seg
            if not graced and any(s.size >= nbytes for s in self._busy.values()):
                # a release may be in flight: waiting a little beats touching fresh pages
                # (~1 GB/s here vs ~10 GB/s warm), so allow a quarter of that cost
                graced = True
                self._drain_releases(0.002 + nbytes / 4e9)
                continue
            size = _segment_size(nbytes)
            while self._free and self._pool_bytes + size > self._max_pool_bytes:
                old = self._free.pop(0)  # evict smaller free segments to make room
                self._pool_bytes -= old.size
                old.destroy()
            if self._pool_bytes + size <= self._max_pool_bytes or not self._busy:
                seg = _Segment(self._run, size, self._shm_dir)
                self._seq += 1
                self._pool_bytes += size
                self._busy[seg.name] = seg
                return seg
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportError(
                    f"shm pool full ({self._pool_bytes} bytes, {len(self._busy)} frames not "
                    "released); the receiver must call Frame.release() or raise max_pool_bytes"
                )
            self._drain_releases(min(left, 0.5))

    def _drain_releases(self, timeout_s: float) -> None:
        if not self._sock.poll(int(timeout_s * 1000)):
            return
        while True:
            try:
                name = self._sock.recv(zmq.NOBLOCK).decode()
            except zmq.Again:
                return
            seg = self._busy.pop(name, None)
            if seg is not None:
                self._to_free(seg)
            elif name in self._lent:
                pool, lends = self._lent.pop(name)
                if pool is not None:
                    self._to_free(pool)
                for arena, aseg in lends:
                    arena.give_back(aseg)
            elif self._forwarded.get(name):
                self._forwarded[name].pop(0).release()

    def _to_free(self, seg: _Segment) -> None:
        self._free.append(seg)
        if len(self._free) > self._max_free:  # bound idle memory: drop the smallest
            old = min(self._free, key=lambda s: s.size)
            self._free.remove(old)
            self._pool_bytes -= old.size
            old.destroy()

    def wait_released(self, timeout_s: float | None = None) -> bool:
        """Wait until receivers released every frame sent so far; False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._busy or self._lent or any(self._forwarded.values()):
            left = 0.5 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                return False
            self._drain_releases(min(left, 0.5))
        return True

    def statistics(self) -> ShmStatistics:
        return ShmStatistics(
            created=self._seq,
            segments=len(self._free) + len(self._busy),
            pool_bytes=self._pool_bytes,
            in_flight=len(self._busy) + len(self._lent),
        )

    def close(self) -> None:
        for frames in self._forwarded.values():
            for f in frames:
                f.release()
        self._forwarded.clear()
        for pool, lends in self._lent.values():  # a receiver may still read these bytes:
            if pool is not None:  # unlinking keeps its mapping; the arena never rewrites them
                self._busy[pool.name] = pool
            for arena, aseg in lends:
                arena.give_back(aseg, orphan=True)
        self._lent.clear()
        for seg in [*self._free, *self._busy.values()]:
            seg.destroy()
        self._free, self._busy, self._pool_bytes = [], {}, 0
        self._sock.close(0)


class ShmReceiver:
    """Binds an IPC control socket and maps senders' segments read-only (cached)."""

    def __init__(self, *, shm_dir: str = SHM_DIR, max_mapped: int = 256) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._dir = tempfile.mkdtemp(prefix=f"earl-shm-{os.getpid()}-")
        self._endpoint = f"ipc://{self._dir}/ctl"
        self._sock.bind(self._endpoint)
        self._shm_dir = shm_dir
        self._maps: OrderedDict[tuple[str, int], mmap.mmap] = OrderedDict()
        self._max_mapped = max_mapped
        self._lock = threading.Lock()  # guards the socket: release() may be another thread
        self._pending: deque[tuple[bytes, bytes]] = deque()
        _LIVE.add(self)

    @property
    def address(self) -> str:
        return f"shm://{self._endpoint}"

    def recv(self, timeout: float | None = None) -> Frame:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # zmq sockets are single-threaded: poll in short slices under the lock, so a
            # release() from another thread never waits long and never deadlocks with us
            with self._lock:
                self._flush_releases()
                if self._sock.poll(10):
                    ident, *parts = self._sock.recv_multipart()
                    break
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no frame within {timeout} s")
        try:
            if parts[0] == b"F" and len(parts) == 4:
                release_id, bufs = parts[1], self._pooled(parts[1], parts[2])
            elif parts[0] == b"M" and len(parts) == 5:
                release_id, bufs = parts[1], self._referenced(parts[2], parts[3])
            else:
                raise TransportError(f"unknown shm frame kind {parts[0][:8]!r} "
                                     f"with {len(parts)} parts")
        except (ValueError, TypeError, KeyError, IndexError, struct.error) as e:
            raise TransportError(f"malformed shm frame descriptor: {e}") from e

        def release() -> None:
            self._pending.append((ident, release_id))
            if self._lock.acquire(blocking=False):  # else the polling thread flushes it
                try:
                    self._flush_releases()
                finally:
                    self._lock.release()

        return ShmFrame(header=parts[-1], buffers=bufs, _on_release=release,
                        parts=tuple(parts[:-1]), release_id=release_id)

    def _pooled(self, name_b: bytes, desc: bytes) -> list[memoryview]:
        """Buffers of a frame copied into one pool segment: (size, n, n x (offset, length))."""
        size, n = struct.unpack_from("<QI", desc)
        pairs = struct.unpack_from(f"<{2 * n}Q", desc, 12)
        base = memoryview(self._map(name_b.decode(), size))
        return [_slice(base, pairs[2 * i], pairs[2 * i + 1]) for i in range(n)]

    def _referenced(self, seglist: bytes, desc: bytes) -> list[memoryview]:
        """Buffers lying in the sender's segments: [[name, size]...], n x (segment, off, len)."""
        segs = json.loads(seglist)
        bases = [memoryview(self._map(str(name), int(size))) for name, size in segs]
        if len(desc) % 24:
            raise ValueError(f"descriptor of {len(desc)} bytes is not (segment, offset, length)s")
        t = np.frombuffer(desc, np.uint64).reshape(-1, 3).tolist()
        return [_slice(bases[i], off, n) for i, off, n in t]

    def _flush_releases(self) -> None:
        while self._pending and not self._sock.closed:
            self._sock.send_multipart(list(self._pending.popleft()))

    def _map(self, name: str, size: int) -> mmap.mmap:
        if not SEGMENT_RE.match(name):
            raise ValueError(f"{name!r} is not an EARL shm segment name")
        key = (name, size)
        mm = self._maps.get(key)
        if mm is None:
            self._forget_unlinked()
            try:
                fd = os.open(os.path.join(self._shm_dir, name), os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError as e:
                raise TransportError(f"shm segment {name} vanished (sender died?)") from e
            try:
                if os.fstat(fd).st_uid != os.geteuid():  # planted by another user
                    raise TransportError(f"shm segment {name} is not owned by this user")
                mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            self._maps[key] = mm
            while len(self._maps) > self._max_mapped:
                _, old = self._maps.popitem(last=False)
                _close_quietly(old)
        else:
            self._maps.move_to_end(key)
        return mm

    def _forget_unlinked(self) -> None:
        """Unmap the cached segments their sender has unlinked (a segment it retired, or all
        of a process that died): a mapping keeps an unlinked segment's pages alive, so a
        long-lived receiver would hold every producer's old segments until it mapped 256."""
        for key in [k for k in self._maps
                    if not os.path.exists(os.path.join(self._shm_dir, k[0]))]:
            _close_quietly(self._maps.pop(key))

    def close(self) -> None:
        with self._lock:
            if not self._sock.closed:
                self._flush_releases()
            self._sock.close(100)
        for mm in self._maps.values():
            _close_quietly(mm)
        self._maps.clear()
        try:
            os.unlink(f"{self._dir}/ctl")
            os.rmdir(self._dir)
        except OSError:
            pass


def _slice(base: memoryview, off: int, n: int) -> memoryview:
    if off + n > base.nbytes:
        raise ValueError(f"buffer [{off}, {off + n}) lies outside its {base.nbytes}-byte segment")
    return base[off : off + n]


def _close_quietly(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:
        pass  # a view is still exported; the mapping goes away with it


class ShmTransport:
    name = "shm"

    def __init__(self, *, max_pool_bytes: int = 4 << 30, shm_dir: str = SHM_DIR) -> None:
        self._max_pool_bytes = max_pool_bytes
        self._shm_dir = shm_dir
        cleanup_leaked_segments(shm_dir)

    def listen(self) -> ShmReceiver:
        return ShmReceiver(shm_dir=self._shm_dir)

    def connect(self, address: str) -> ShmSender:
        return ShmSender(address, max_pool_bytes=self._max_pool_bytes, shm_dir=self._shm_dir)
