"""Another local user cannot crash a sender by pre-creating shm segment names, nor feed a
receiver a segment of their own (/dev/shm is world-writable)."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import struct
import subprocess
import textwrap
import time

import numpy as np
import pytest
import zmq

from earl.runtime.transport import connect, get_transport
from earl.runtime.transport.base import TransportError
from earl.runtime.transport.shm import SHM_DIR
from earl.runtime.transport.shm_arena import ShmArena

NOBODY = 65534
# the attacker runs a system interpreter: this venv's may sit under a directory only root reads
PYTHON = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")
needs_root = pytest.mark.skipif(os.geteuid() != 0 or PYTHON is None,
                                reason="acting as another user needs root and a system python3")

# The attacker, as uid 65534: for every EARL segment it sees, pre-create the names a counter
# would give next, and a few random ones of the same shape.
_ATTACK = textwrap.dedent(r"""
    import os, re, sys, time, secrets
    pat = re.compile(r"^(earl-[0-9a-z]+-\d+-)(\w+)$")
    end = time.monotonic() + float(sys.argv[1])
    made, seen = 0, set()
    print("ready", flush=True)
    while time.monotonic() < end:
        for name in os.listdir("/dev/shm"):
            m = pat.match(name)
            if not m or name in seen:
                continue
            seen.add(name)  # its own names are in there too: it reacts to EARL's only
            nexts = [m.group(1) + secrets.token_hex(8) for _ in range(4)]
            if m.group(2).isdigit():
                nexts += [m.group(1) + str(int(m.group(2)) + k) for k in range(1, 40)]
            for n in nexts:
                seen.add(n)
                try:
                    os.close(os.open("/dev/shm/" + n, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                    made += 1
                except OSError:
                    pass
        time.sleep(0.001)
    print(made, flush=True)
""")


def _attacker(seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen([PYTHON, "-c", _ATTACK, str(seconds)], user=NOBODY,
                            group=NOBODY, stdout=subprocess.PIPE, text=True)


def _planted() -> list[str]:
    return [n for n in os.listdir(SHM_DIR)
            if n.startswith("earl-") and os.stat(os.path.join(SHM_DIR, n)).st_uid == NOBODY]


@needs_root
def test_pre_created_names_do_not_stop_new_segments():
    arena = ShmArena(segment_bytes=1 << 16)
    receiver = get_transport("shm").listen()
    sender = connect(receiver.address)
    attack = _attacker(3.0)
    assert attack.stdout.readline() == "ready\n"
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
    finally:
        attack.wait(30)
        sender.close()
        receiver.close()
        arena.close()
        for name in _planted():
            os.unlink(os.path.join(SHM_DIR, name))
    assert int(attack.stdout.read().split()[-1]) > 0  # it did plant names


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
