"""ShmArena bookkeeping in one process: stored copies, segment reuse, lends and orphans."""

from __future__ import annotations

import os

import numpy as np
import pytest

from earl.runtime.cleanup import SHM_DIR
from earl.runtime.transport.shm_arena import ShmArena, locate

KiB = 1 << 10


@pytest.fixture
def arena():
    a = ShmArena(segment_bytes=256 * KiB, max_spare=1)
    yield a
    a.close()


def _names(arena: ShmArena) -> set[str]:
    return set(arena._segments)


def test_store_is_a_read_only_copy_in_shared_memory(arena):
    src = np.arange(1000, dtype=np.float32)
    out = arena.store(src)
    np.testing.assert_array_equal(out, src)
    assert out.dtype == src.dtype and not out.flags.writeable
    src[:] = -1  # the producer's array is not the stored one
    assert out[5] == 5
    (name,) = _names(arena)
    assert os.path.exists(os.path.join(SHM_DIR, name))
    ((a, seg, off),) = locate([out])
    assert a is arena and seg.name == name and off % 64 == 0
    assert locate([src]) == [None]  # private memory is not in any arena
    scalar, empty = np.array(3, np.int8), np.zeros(0, np.int64)
    stored = arena.store(scalar)
    assert stored.shape == () and stored == 3 and locate([stored])[0] is not None
    assert arena.store(empty) is empty  # nothing to place


def test_emptied_segments_are_reused_and_extra_ones_unlinked(arena):
    first = [arena.store(np.ones(16 * KiB, np.uint8)) for _ in range(40)]  # 640 KiB: 3 segments
    names = _names(arena)
    assert len(names) == 3 and arena.statistics().live_bytes == 40 * 16 * KiB
    for a in first:
        arena.free(a)
    st = arena.statistics()
    assert st.live_bytes == 0 and st.segments == 2  # the current one + 1 spare, the rest unlinked
    again = [arena.store(np.ones(16 * KiB, np.uint8)) for _ in range(30)]
    assert _names(arena) <= names and len(_names(arena)) == 2  # warm pages, no new segment
    assert sum(1 for n in os.listdir(SHM_DIR) if n in names) == 2
    del again


def test_lent_bytes_are_not_reused_until_given_back(arena):
    a = arena.store(np.full(100 * KiB, 7, np.uint8))  # big: a segment of its own
    ((_, seg, _),) = locate([a])
    arena.lend(seg)  # a receiver holds a frame pointing here
    arena.free(a)
    b = arena.store(np.full(100 * KiB, 9, np.uint8))
    assert locate([b])[0][1] is not seg  # the freed bytes still belong to the reader
    assert bytes(seg.bytes[:1]) == b"\x07"
    arena.give_back(seg)
    c = arena.store(np.full(100 * KiB, 5, np.uint8))
    assert locate([c])[0][1] is seg  # released: reused


def test_orphaned_segments_are_unlinked_never_rewritten(arena):
    a = arena.store(np.ones(100 * KiB, np.uint8))
    ((_, seg, _),) = locate([a])
    arena.lend(seg)
    arena.give_back(seg, orphan=True)  # the sender closed with the frame still out
    arena.free(a)
    assert seg.name not in _names(arena)
    assert not os.path.exists(seg.path)


def test_close_unlinks_everything(arena):
    arena.store(np.ones(10, np.int64))
    names = _names(arena)
    arena.close()
    assert not any(os.path.exists(os.path.join(SHM_DIR, n)) for n in names)
    assert arena.statistics().segments == 0


def test_a_receiver_unmaps_segments_their_sender_unlinked():
    """A receiver caches its mappings of senders' segments; one the sender unlinked (retired,
    or its process died) is unmapped when the receiver maps a new one, or its pages would stay
    in memory for as long as the receiver lives."""
    from earl.runtime.transport.shm import ShmReceiver

    a = ShmArena(segment_bytes=256 * KiB, max_spare=0)
    b = ShmArena(segment_bytes=256 * KiB, max_spare=0)
    rx = ShmReceiver()
    try:
        a.store(np.ones(100, np.float32))
        (old,) = _names(a)
        rx._map(old, 256 * KiB)
        a.close()  # the sender's segments are unlinked
        b.store(np.ones(100, np.float32))
        (new,) = _names(b)
        rx._map(new, 256 * KiB)
        assert [name for name, _ in rx._maps] == [new]
    finally:
        rx.close()
        b.close()
