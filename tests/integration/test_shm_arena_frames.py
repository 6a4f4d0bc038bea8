"""Frames that point into a producer's ShmArena, between real processes: the consumer reads the
producer's pages (no copy), forwards them on, and the producer gets its bytes back only on
release; a forged descriptor is refused, not trusted."""

from __future__ import annotations

import json
import multiprocessing as mp

import numpy as np
import pytest
import zmq

from earl.runtime.dock_warehouse import Warehouse, unpack_batch
from earl.runtime.transport import connect, get_transport, pack_arrays, unpack_arrays
from earl.runtime.transport.base import TransportError

CTX = mp.get_context("spawn")
N = 6


def _columns(i: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(40_000, dtype=np.int64) + i,
            "versions": np.full(40_000, i, np.int32),
            "loss_mask": np.array(1, np.int8)}


def _producer(address: str, conn) -> None:  # runs in the child
    from earl.runtime.transport.shm_arena import ShmArena

    arena = ShmArena(segment_bytes=1 << 20)
    wh = Warehouse("w0", arena=arena)
    for i in range(N):
        wh.put(f"s{i}", _columns(i), group_id=f"g{i}")
    names = sorted(arena._segments)
    sender = connect(address)
    sender.send(*wh.pack([f"s{i}" for i in range(N)], ["input_ids", "versions", "loss_mask"]))
    # a frame mixing arena views with private arrays: those are copied into a pooled segment
    mixed = {"arena": wh.get(["s1"], ["input_ids"])["0/input_ids"], "own": np.arange(7.0),
             "empty": np.zeros(0, np.int8)}
    sender.send(*pack_arrays(mixed))
    conn.send((names, arena.statistics().lent_frames))
    assert conn.recv() == "evict"
    wh.evict([f"s{i}" for i in range(N)])  # while the consumer still reads: bytes stay put
    conn.send(arena.statistics().segments)
    assert conn.recv() == "released"
    assert sender.wait_released(30)
    conn.send(arena.statistics())
    sender.close()
    arena.close()


def test_arena_frames_are_read_in_place_forwarded_and_returned_on_release():
    receiver = get_transport("shm").listen()
    peer = get_transport("shm").listen()
    parent, child_end = CTX.Pipe()
    child = CTX.Process(target=_producer, args=(receiver.address, child_end))
    child.start()
    try:
        assert parent.poll(60)
        names, lent = parent.recv()
        frame = receiver.recv(timeout=30)
        assert frame.parts[0] == b"M" and lent >= 1
        sent_from = {name for name, _ in json.loads(frame.parts[2])}
        assert set(names) <= sent_from  # the producer's own segments, not a copy of them
        parent.send("evict")
        assert parent.recv() >= len(names)  # evicted but lent: no segment reused or unlinked
        fwd = connect(peer.address)
        fwd.forward(frame)  # a TP peer gets the same pages
        frame2 = peer.recv(timeout=30)
        for f in (frame, frame2):
            batch = unpack_batch(f)
            for i in range(N):
                for col, want in _columns(i).items():
                    got = batch[f"s{i}"][col]
                    np.testing.assert_array_equal(got, want)
                    assert not got.flags.writeable
        mixed = receiver.recv(timeout=30)
        assert mixed.parts[0] == b"M"
        arrays, _ = unpack_arrays(mixed)
        np.testing.assert_array_equal(arrays["arena"], _columns(1)["input_ids"])
        np.testing.assert_array_equal(arrays["own"], np.arange(7.0))
        assert arrays["empty"].size == 0
        segs = [name for name, _ in json.loads(mixed.parts[2])]
        assert segs[0] not in names and set(segs[1:]) <= set(names)  # pool copy + arena
        mixed.release()
        frame2.release()
        assert fwd.wait_released(30)
        frame.release()
        parent.send("released")
        stats = parent.recv()
        assert stats.lent_frames == 0 and stats.live_bytes == 0
        child.join(60)
        assert child.exitcode == 0
        fwd.close()
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()
        peer.close()


@pytest.mark.parametrize("parts", [
    [b"M", b"t", b'[["../../etc/passwd", 4096]]', np.zeros(3, np.uint64).tobytes(), b"h"],
    [b"M", b"t", b"not json", b"", b"h"],
    [b"M", b"t", b"[]", np.zeros(3, np.uint64).tobytes(), b"h"],  # segment index out of range
    [b"M", b"t", b"[]", b"12345", b"h"],
    [b"F", b"earl-x-1-1", b"\x00", b"h"],
    [b"Q", b"x"],
])
def test_forged_descriptors_are_refused(parts):
    receiver = get_transport("shm").listen()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(receiver.address[len("shm://"):])
        sock.send_multipart(parts)
        with pytest.raises(TransportError):
            receiver.recv(timeout=10)
        sender = connect(receiver.address)  # and the receiver still works
        sender.send(b"ok", [np.ones(4)])
        assert receiver.recv(timeout=10).header == b"ok"
        sender.close()
    finally:
        sock.close(0)
        receiver.close()


def test_a_sender_of_arena_only_frames_takes_back_their_releases():
    """A frame whose buffers all lie in an arena needs no pool segment, and the sender used to
    read releases only when it acquired one: the frames a consumer released stayed lent, so
    their segments were never reused and a producer's arena grew a segment every few dozen
    steps of a plain `earl train`."""
    from earl.runtime.transport.shm_arena import ShmArena

    arena = ShmArena(segment_bytes=1 << 20)
    wh = Warehouse("w0", arena=arena)
    receiver = get_transport("shm").listen()
    sender = connect(receiver.address)
    try:
        for i in range(N):
            wh.put(f"s{i}", _columns(i), group_id=f"g{i}")
            sender.send(*wh.pack([f"s{i}"], ["input_ids", "versions"]))
            frame = receiver.recv(timeout=30)
            assert frame.parts[0] == b"M"
            last = len(json.loads(frame.parts[2]))  # the segments this frame lent
            frame.release()
            wh.evict([f"s{i}"])
        assert arena.statistics().lent_frames <= last  # only the last release may be unread
        assert sender.wait_released(30)
        assert arena.statistics().lent_frames == 0
    finally:
        sender.close()
        receiver.close()
        arena.close()
