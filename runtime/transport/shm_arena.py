"""Shared-memory storage that same-host receivers read in place: zero-copy sends of stored data.

A `ShmArena` holds arrays in segments under /dev/shm (named like the shm transport's pool
segments, ``earl-<run>-<pid>-<random>``, so the leak sweep covers them). `store` copies an array in
once and returns a read-only view of the stored bytes. When a `ShmSender` sends buffers that are
such views, it sends their segment names and offsets instead of copying them: the receiver maps
the producer's pages read-only. The warehouse keeps experience here, so a consumer's fetch costs
the producer one message, not a copy of the batch.

Allocation is a bump pointer per segment: freed bytes are reused once their whole segment is
empty and no frame that points into it is still held by a receiver (`lend` / `give_back`). This
suits experience, which is put and evicted roughly in order. One long-lived sample pins its
segment, no more. Arrays larger than a quarter of a segment get a segment of their own.

Not here: the wire format of a frame that points into an arena (shm.py).
"""

from __future__ import annotations

import atexit
import bisect
import mmap
import os
import secrets
import threading
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from earl.runtime.cleanup import SHM_DIR

__all__ = ["ArenaSegment", "ArenaStatistics", "Placement", "ShmArena", "locate"]

PREFIX = "earl-"  # segment names: earl-<run>-<pid>-<random> (runtime.cleanup sweeps them)
_NAME_TRIES = 16
ALIGN = 64
_LIVE: weakref.WeakSet[ShmArena] = weakref.WeakSet()


@atexit.register
def _close_live() -> None:
    for arena in list(_LIVE):
        arena.close()


def _address(buf: object) -> int:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)  # type: ignore[call-overload]
    return int(arr.__array_interface__["data"][0])


def create_segment(shm_dir: str, run: str, size: int) -> tuple[str, mmap.mmap]:
    """A new owner-only segment file of `size` bytes in `shm_dir`, mapped read-write.

    Its name ends in 64 random bits, not a counter: /dev/shm is world-writable, so another user
    could otherwise pre-create the next name and make this call fail. A name that exists anyway
    (created by someone else) is skipped for a fresh one.

    Returns:
        (name, mapping).
    """
    for _ in range(_NAME_TRIES):
        name = f"{PREFIX}{run}-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            fd = os.open(os.path.join(shm_dir, name),
                         os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        try:
            os.ftruncate(fd, size)
            return name, mmap.mmap(fd, size)
        finally:
            os.close(fd)
    raise FileExistsError(f"{_NAME_TRIES} random shm segment names in {shm_dir} all existed")


class ArenaSegment:
    """One shared-memory file of an arena, with its bump pointer and reference counts."""

    def __init__(self, run: str, size: int, shm_dir: str) -> None:
        self.name, self.map = create_segment(shm_dir, run, size)
        self.size, self.path = size, os.path.join(shm_dir, self.name)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.base = _address(self.bytes)
        self.used = 0  # bump pointer
        self.live = 0  # bytes of stored arrays not yet freed
        self.lent = 0  # frames pointing here that receivers still hold
        self.orphaned = False  # a receiver may hold it forever: never write to it again

    def destroy(self) -> None:
        del self.bytes
        try:
            self.map.close()
        except BufferError:
            pass  # a stored view is still alive; the mapping goes away with it
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


@dataclass(frozen=True, slots=True)
class ArenaStatistics:
    segments: int
    reserved_bytes: int
    live_bytes: int
    lent_frames: int


class ShmArena:
    """Arrays in shared memory, sendable to same-host receivers without a copy.

    Args:
        segment_bytes: size of the segments small arrays share. Every page of a segment in
            use is touched in time, by its producer and by each consumer that reads it, so the
            arena's footprint is ~(segments in use + spares) x this in every one of them: a
            plain `earl train` (Tic-Tac-Toe) holds 2 segments, its trainer ~43 MiB of the
            shards' pages, flat after ~100 steps.
        max_spare: empty segments kept warm for reuse (fresh pages cost ~10x a warm copy).
    """

    def __init__(self, *, segment_bytes: int = 16 << 20, max_spare: int = 2,
                 shm_dir: str = SHM_DIR) -> None:
        if segment_bytes < ALIGN:
            raise ValueError(f"segment_bytes must be >= {ALIGN}, got {segment_bytes}")
        self._segment_bytes, self._max_spare, self._shm_dir = segment_bytes, max_spare, shm_dir
        self._run = "a" + uuid.uuid4().hex[:7]
        self._lock = threading.Lock()
        self._segments: dict[str, ArenaSegment] = {}
        # sorted base addresses and their segments; replaced whole, so `find` needs no lock
        self._index: tuple[tuple[int, ...], tuple[ArenaSegment, ...]] = ((), ())
        self._current: ArenaSegment | None = None
        self._spare: list[ArenaSegment] = []
        _LIVE.add(self)

    def store(self, arr: np.ndarray) -> np.ndarray:
        """A read-only copy of C-contiguous `arr` held in this arena (empty arrays kept as is)."""
        if arr.nbytes == 0:
            return arr
        with self._lock:
            seg, off = self._alloc(arr.nbytes)
            seg.live += aligned(arr.nbytes)
        out = seg.bytes[off : off + arr.nbytes].view(arr.dtype).reshape(arr.shape)
        out.flags.writeable = True
        np.copyto(out, arr, casting="no")
        out.flags.writeable = False
        return out

    def free(self, arr: np.ndarray) -> None:
        """Give back the bytes of an array `store` returned (no-op for anything else)."""
        hit = self.find(arr)
        if hit is None:
            return
        seg, _ = hit
        with self._lock:
            seg.live -= aligned(arr.nbytes)
            self._recycle(seg)

    def find(self, buf: object) -> tuple[ArenaSegment, int] | None:
        """(segment, offset) of a contiguous buffer lying inside this arena, else None."""
        nbytes = buf.nbytes if isinstance(buf, np.ndarray | memoryview) else len(buf)  # type: ignore[arg-type]
        bases, segs = self._index
        if nbytes == 0 or not bases:
            return None
        addr = _address(buf)
        i = bisect.bisect_right(bases, addr) - 1
        if i < 0:
            return None
        seg = segs[i]
        off = addr - seg.base
        return (seg, off) if off + nbytes <= seg.size else None

    def lend(self, seg: ArenaSegment) -> None:
        """A frame pointing into `seg` went to a receiver: keep its bytes until `give_back`."""
        with self._lock:
            seg.lent += 1

    def give_back(self, seg: ArenaSegment, *, orphan: bool = False) -> None:
        """The receiver released the frame (`orphan`: it never will; retire the segment)."""
        with self._lock:
            seg.lent -= 1
            seg.orphaned |= orphan
            self._recycle(seg)

    def _alloc(self, nbytes: int) -> tuple[ArenaSegment, int]:
        need = aligned(nbytes)
        if need > self._segment_bytes // 4:  # big: a segment of its own
            seg = self._take_spare(need) or self._new_segment(need)
            seg.used = need
            return seg, 0
        cur = self._current
        if cur is None or cur.used + need > cur.size:
            old, cur = cur, (self._take_spare(self._segment_bytes)
                             or self._new_segment(self._segment_bytes))
            self._current = cur
            if old is not None:
                self._recycle(old)
        off, cur.used = cur.used, cur.used + need
        return cur, off

    def _take_spare(self, nbytes: int) -> ArenaSegment | None:
        fits = [s for s in self._spare if s.size >= nbytes]
        if not fits:
            return None
        seg = min(fits, key=lambda s: s.size)
        self._spare.remove(seg)
        return seg

    def _new_segment(self, nbytes: int) -> ArenaSegment:
        size = self._segment_bytes  # a big array's: whole MiB, so later ones can reuse it
        if nbytes > size:
            size = -(-nbytes // (1 << 20)) << 20
        seg = ArenaSegment(self._run, size, self._shm_dir)
        self._segments[seg.name] = seg
        self._reindex()
        return seg

    def _reindex(self) -> None:
        segs = sorted(self._segments.values(), key=lambda s: s.base)
        self._index = (tuple(s.base for s in segs), tuple(segs))

    def _recycle(self, seg: ArenaSegment) -> None:
        """Reuse or drop `seg` once nothing stored or lent points into it (lock held)."""
        if seg.live > 0 or seg.lent > 0:
            return
        if seg is self._current:
            if not seg.orphaned:
                seg.used = 0  # the current segment emptied: start it over, pages stay warm
            return
        if seg.name not in self._segments or seg in self._spare:
            return
        seg.used = 0
        if not seg.orphaned and len(self._spare) < self._max_spare:
            self._spare.append(seg)
            return
        del self._segments[seg.name]
        self._reindex()
        seg.destroy()

    def statistics(self) -> ArenaStatistics:
        with self._lock:
            segs = list(self._segments.values())
            return ArenaStatistics(segments=len(segs), reserved_bytes=sum(s.size for s in segs),
                                   live_bytes=sum(s.live for s in segs),
                                   lent_frames=sum(s.lent for s in segs))

    def close(self) -> None:
        """Unlink every segment (receivers' existing mappings stay readable)."""
        with self._lock:
            for seg in self._segments.values():
                seg.destroy()
            self._segments.clear()
            self._index = ((), ())
            self._spare.clear()
            self._current = None
        _LIVE.discard(self)


Placement = tuple[ShmArena, ArenaSegment, int]  # arena, segment, offset


def locate(buffers: Sequence[object]) -> list[Placement | None]:
    """For each contiguous buffer: the arena of this process holding it, with segment and
    offset, or None."""
    arenas = list(_LIVE)
    if not arenas:
        return [None] * len(buffers)
    out: list[Placement | None] = []
    for v in buffers:
        hit = None
        for arena in arenas:
            found = arena.find(v)
            if found is not None:
                hit = (arena, found[0], found[1])
                break
        out.append(hit)
    return out


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to the buffer alignment of segments (arena and shm pool)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN
