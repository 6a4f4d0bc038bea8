"""SenderCache: a consumer's sender unused for `idle_s` is closed, and the arena segment its
dead receiver never released comes back (real shm sender and receiver, in one process)."""

from __future__ import annotations

import os

import numpy as np

from earl.runtime.transport.route import open_sender
from earl.runtime.transport.senders import SenderCache
from earl.runtime.transport.shm import ShmReceiver
from earl.runtime.transport.shm_arena import ShmArena

KiB = 1 << 10


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_dead_receivers_sender_is_closed_and_its_segment_retired():
    arena = ShmArena(segment_bytes=256 * KiB, max_spare=0)
    dead, live = ShmReceiver(), ShmReceiver()
    clock = Clock()
    cache = SenderCache(open_sender, idle_s=60.0, clock=clock)
    try:
        stored = arena.store(np.full(100 * KiB, 3, np.uint8))  # a segment of its own
        sender, lock = cache.lease(dead.address)
        with lock:
            sender.send(b"h", [stored])
        frame = dead.recv(timeout=5)
        assert bytes(frame.buffers[0][:1]) == b"\x03"
        (seg,) = arena._segments.values()
        dead.close()  # dies holding the frame: its release never comes
        arena.free(stored)
        assert os.path.exists(seg.path)  # pinned by the lend
        clock.t = 30.0
        cache.lease(live.address)
        assert len(cache) == 2 and os.path.exists(seg.path)  # not idle long enough yet
        clock.t = 100.0
        cache.lease(live.address)
        assert len(cache) == 1  # the dead receiver's sender closed...
        assert not os.path.exists(seg.path) and arena.statistics().segments == 0  # ...and freed
    finally:
        cache.close()
        live.close()
        arena.close()


def test_a_used_sender_stays_open():
    made: list[str] = []

    class Fake:
        def __init__(self, address: str) -> None:
            made.append(address)
            self.closed = False

        def close(self) -> None:
            self.closed = True

    clock = Clock()
    cache = SenderCache(Fake, idle_s=10.0, clock=clock)  # type: ignore[arg-type]
    a, _ = cache.lease("a")
    for t in (8.0, 16.0, 24.0):  # "a" is used every 8 s: never idle for 10
        clock.t = t
        assert cache.lease("a")[0] is a
        cache.lease("b")
    assert made == ["a", "b"] and not a.closed
    clock.t = 40.0
    cache.lease("b")
    assert a.closed and made == ["a", "b"]
    assert cache.lease("a")[0] is not a  # a consumer idle that long gets a fresh sender
