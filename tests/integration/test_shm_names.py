"""Another local user cannot crash a sender by pre-creating shm segment names, nor feed a
receiver a segment of their own (/dev/shm is world-writable)."""

from __future__ import annotations

import os
import re
import secrets
import struct
import subprocess
import time

import numpy as np
import pytest
import zmq

from earl.commands.chaos_attacks import NOBODY, PYTHON, plant_shm_names
from earl.runtime.transport import connect, get_transport
from earl.runtime.transport.base import TransportError
from earl.runtime.transport.shm import SHM_DIR
from earl.runtime.transport.shm_arena import ShmArena

needs_root = pytest.mark.skipif(os.geteuid() != 0 or PYTHON is None,
                                reason="acting as another user needs root and a system python3")


def _planted() -> list[str]:
    return [n for n in os.listdir(SHM_DIR)
            if n.startswith("earl-") and os.stat(os.path.join(SHM_DIR, n)).st_uid == NOBODY]


@needs_root
def test_pre_created_names_do_not_stop_new_segments():
    arena = ShmArena(segment_bytes=1 << 16)
    receiver = get_transport("shm").listen()
    sender = connect(receiver.address)
    attack = plant_shm_names(3.0)  # what `earl chaos --faults squat:shm` runs
    attack.wait_ready()
    try:
        arena.store(np.zeros(16, np.uint8))  # a first segment for the attacker to see
        for i in range(300):  # new arena segments and new pool segments while it runs
            arena.store(np.full(1 << 15, i % 256, np.uint8))
            size = (1 << 16) * (1 + i % 7)
            sender.send(b"x", [np.full(size, i % 256, np.uint8)])
            frame = receiver.recv(timeout=10)
            assert int(np.asarray(frame.buffers[0])[0]) == i % 256
            frame.release()
            time.sleep(0.002)  # let the attacker see each new name
        planted = attack.result(30)["planted"]
    finally:
        sender.close()
        receiver.close()
        arena.close()
        for name in _planted():  # the attacker removes its own; in case it was killed
            os.unlink(os.path.join(SHM_DIR, name))
    assert planted > 0


@needs_root
def test_a_segment_planted_by_another_user_is_refused():
    name = f"earl-a1234567-{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    plant = f"import os; fd = os.open({path!r}, os.O_CREAT | os.O_WRONLY, 0o644); os.ftruncate(fd, 4096)"
    subprocess.run([PYTHON, "-c", plant], user=NOBODY, group=NOBODY, check=True)
    receiver = get_transport("shm").listen()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.connect(receiver.address[len("shm://"):])
        desc = struct.pack("<QIQQ", 4096, 1, 0, 16)  # (size, n, n x (offset, length))
        sock.send_multipart([b"F", name.encode(), desc, b"h"])
        with pytest.raises(TransportError, match="not owned"):
            receiver.recv(timeout=10)
    finally:
        sock.close(0)
        receiver.close()
        os.unlink(path)


def test_segment_names_are_not_sequential():
    arena = ShmArena(segment_bytes=1 << 12)
    try:
        for _ in range(3):
            arena.store(np.zeros(1 << 12, np.uint8))  # each fills a segment of its own
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(f"earl-{arena._run}-")]
    finally:
        arena.close()
    assert len(names) >= 3
    tails = [n.rsplit("-", 1)[1] for n in names]
    assert all(re.fullmatch(r"[0-9a-f]{16}", t) for t in tails), names
