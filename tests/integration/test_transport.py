"""Every transport between two real processes; shm pool reuse and crash cleanup in /dev/shm;
receivers bind loopback, and authenticated channels drop data without the secret."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import numpy as np
import psutil
import pytest

from earl.runtime.transport import (
    available,
    choose,
    connect,
    get_transport,
    pack_arrays,
    unpack_arrays,
)
from earl.runtime.transport.shm import SHM_DIR, cleanup_leaked_segments

CTX = mp.get_context("spawn")


def _payloads(i: int) -> dict[str, np.ndarray]:
    return {
        "big": np.arange((1 << 20) // 8, dtype=np.int64) + i,  # 1 MiB
        "odd": np.arange(13, dtype=np.float32) * i,
        "empty": np.zeros(0, np.int8),
    }


SECRET = b"s" * 32
AUTH = {"authenticate": True, "secret": SECRET}  # MAC'd as off-host traffic is, on loopback
CASES = {"shm": {}, "zmq": {}, "zmq-tcp": {"local": False}, "zmq-tcp-auth": {"local": False, **AUTH},
         "ucx": {}, "ucx-auth": AUTH, "gloo": {}, "gloo-auth": AUTH}


def _send(address: str, n: int, q, done, options) -> None:  # runs in the child
    sender = connect(address, **options)
    for rnd in range(2):
        for i in range(n):
            header, bufs = pack_arrays(_payloads(i), {"i": i})
            sender.send(header, bufs)
            if rnd == 1 and hasattr(sender, "wait_released"):
                assert sender.wait_released(30)  # lock-step: every send can reuse
        done.get()  # the parent has read and released this round
        if hasattr(sender, "wait_released"):
            assert sender.wait_released(30)
        stats = sender.statistics() if hasattr(sender, "statistics") else None
        q.put(None if stats is None else (stats.created, stats.segments, stats.in_flight))
    sender.close()


def _listening_ips() -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("case", list(CASES))
def test_transport_moves_frames_between_processes(case):
    name, options = case.split("-")[0], CASES[case]
    assert available(name), f"{name} must import here: it is a required dependency"  # ucxx-cu12
    before = _listening_ips()
    receiver = get_transport(name, **options).listen()
    assert receiver.address.startswith(f"{name}://")
    assert _listening_ips() <= before | {"127.0.0.1"}  # nothing bound beyond loopback
    q, done = CTX.Queue(), CTX.Queue()
    child = CTX.Process(target=_send, args=(receiver.address, 5, q, done, options))
    child.start()
    try:
        segments = []
        for _ in range(2):
            for i in range(5):
                frame = receiver.recv(timeout=60)
                arrays, meta = unpack_arrays(frame)
                assert meta == {"i": i}
                for key, want in _payloads(i).items():
                    np.testing.assert_array_equal(arrays[key], want)
                if name == "shm":  # zero-copy: read-only views into the sender's segment
                    assert not arrays["big"].flags.writeable
                frame.release()
            done.put("next")
            segments.append(q.get(timeout=60))
        if name == "shm":  # released segments are reused; idle ones are bounded
            (created0, idle0, busy0), (created1, idle1, busy1) = segments
            assert 1 <= created0 <= 5 and created1 == created0
            assert busy0 == busy1 == 0 and idle0 <= 4 and idle1 <= 4
        child.join(60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
        receiver.close()


def _leak(address: str, conn) -> None:  # sends one frame, then dies without cleaning up
    sender = connect(address)
    header, bufs = pack_arrays({"x": np.ones(1000)})
    sender.send(header, bufs)
    conn.send(os.getpid())  # a pipe write is done when it returns (a Queue's is not)
    conn.recv()  # the parent has the frame
    os.kill(os.getpid(), signal.SIGKILL)


def test_shm_segments_leaked_by_a_crash_are_cleaned_on_restart():
    receiver = get_transport("shm").listen()
    parent, child_end = CTX.Pipe()
    child = CTX.Process(target=_leak, args=(receiver.address, child_end))
    child.start()
    assert parent.poll(60)
    pid = parent.recv()
    frame = receiver.recv(timeout=30)
    parent.send("die")
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    # the data outlives its producer until cleanup
    np.testing.assert_array_equal(unpack_arrays(frame)[0]["x"], np.ones(1000))
    leaked = [n for n in os.listdir(SHM_DIR) if n.startswith("earl-") and f"-{pid}-" in n]
    assert len(leaked) == 1
    get_transport("shm")  # a restarted transport cleans up after dead processes
    assert not [n for n in os.listdir(SHM_DIR) if f"-{pid}-" in n]
    assert cleanup_leaked_segments() == []
    receiver.close()


def test_choose_by_locality_and_override():
    assert choose(same_host=True) == "shm"
    assert choose(same_host=False) in ("ucx", "zmq")
    assert choose(same_host=True, prefer="zmq") == "zmq"
    with pytest.raises(ValueError, match="unknown transport 'tcp'"):
        choose(same_host=True, prefer="tcp")
    with pytest.raises(ValueError, match="no known transport scheme"):
        connect("http://x")


def _forge(address: str, secret: bytes) -> None:  # runs in the child
    sender = connect(address, local=False, authenticate=True, secret=secret)
    sender.send(b"forged" if secret != SECRET else b"genuine", [np.ones(8)])
    sender.close()


def test_authenticated_zmq_drops_data_without_the_secret():
    receiver = get_transport("zmq", local=False, **AUTH).listen()
    try:
        for secret in (b"w" * 32, SECRET):
            child = CTX.Process(target=_forge, args=(receiver.address, secret))
            child.start()
            child.join(60)
        frame = receiver.recv(timeout=30)
        assert frame.header == b"genuine"  # the forged frame was dropped, not handed out
        with pytest.raises(TimeoutError):
            receiver.recv(timeout=0.5)
    finally:
        receiver.close()


def test_off_loopback_receivers_need_a_secret(monkeypatch):
    from earl.runtime.transport import auth

    monkeypatch.setattr(auth, "_run_secret", [None])
    for name, options in (("zmq", {"local": False}), ("gloo", {}), ("ucx", {})):
        with pytest.raises(ValueError, match="needs a secret"):
            get_transport(name, host="0.0.0.0", **options).listen()  # refused before binding


def test_gloo_receivers_made_one_after_another_each_take_a_sender():
    """A gloo receiver's store owns its listening socket: closing one and making the next in
    the same process (a weights pair re-keyed for a restarted trainer) must not close the new
    one's socket under it."""
    import threading

    from earl.runtime.transport import get_transport

    key = b"k" * 32
    for i in range(3):
        r = get_transport("gloo", secret=key, authenticate=True).listen()
        addr = r.address

        def send(a: str = addr, n: int = i) -> None:
            s = get_transport("gloo", secret=key, authenticate=True).connect(a)
            s.send(f"frame {n}".encode(), [np.arange(10, dtype=np.uint8)])
            s.close()

        t = threading.Thread(target=send)
        t.start()
        f = r.recv(30)
        assert f.header == f"frame {i}".encode() and bytes(f.buffers[0]) == bytes(range(10))
        f.release()
        t.join()
        r.close()
