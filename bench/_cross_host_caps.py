"""The caps of bench/dispatch.py's cross-host case (bench/_cross_host.py), and the plumbing its
roles share: a raw TCP stream from host B to host A (after an HMAC challenge), checksummed by the
receiver, and the data-plane MAC (`Mac.seal`) on one core.

A role reads its config as one JSON line on stdin (`role_config`) and answers JSON lines on
stdout (`emit`). Not here: the dispatch modes and the orchestration (bench/_cross_host.py).
"""

from __future__ import annotations

import hmac
import json
import os
import socket
import statistics
import sys
import time
from typing import Any

import numpy as np
from _dispatch_layout import checksum

from earl.runtime.transport.auth import set_run_secret

TIMEOUT_S = 300.0


def emit(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def role_config() -> dict[str, Any]:
    """The role's config (one JSON line on stdin); the run's secret is set from it."""
    cfg: dict[str, Any] = json.loads(sys.stdin.readline())
    set_run_secret(bytes.fromhex(cfg["secret"]))
    return cfg


def _challenge(conn: socket.socket, key: bytes) -> None:
    nonce = os.urandom(16)
    conn.sendall(nonce)
    mac = _recv_exact(conn, 32)
    if not hmac.compare_digest(mac, hmac.digest(key, nonce, "sha256")):
        raise ConnectionError("tcp probe: the sender failed the challenge")


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("tcp probe: peer closed")
        buf += chunk
    return bytes(buf)


def _payload(nbytes: int) -> np.ndarray:
    return np.arange(nbytes // 8, dtype=np.uint64).view(np.uint8)


def role_tcp_recv() -> None:
    """On host A: accept the sender (after it answers an HMAC challenge), time each transfer
    from "go" to having received and checksummed every byte."""
    cfg = role_config()
    srv = socket.create_server((cfg["address"], 0))
    emit({"port": srv.getsockname()[1]})
    conn, _ = srv.accept()
    _challenge(conn, bytes.fromhex(cfg["secret"]))
    nbytes = cfg["bytes"]
    want = checksum(_payload(nbytes))
    buf = np.empty(nbytes, np.uint8)
    buf[:] = 0  # warm
    view = memoryview(buf)  # type: ignore[arg-type]
    times = []
    for _ in range(cfg["reps"] + 1):
        t = time.perf_counter()
        conn.sendall(b"g")
        got = 0
        while got < nbytes:
            k = conn.recv_into(view[got:])
            if not k:
                raise ConnectionError("tcp probe: sender closed")
            got += k
        ok = checksum(buf) == want
        times.append(time.perf_counter() - t)
        assert ok, "tcp probe: corrupted bytes"
    conn.sendall(b"s")
    emit({"times": times[1:]})


def role_tcp_send() -> None:
    cfg = role_config()
    conn = socket.create_connection((cfg["address"], cfg["port"]), timeout=TIMEOUT_S)
    nonce = _recv_exact(conn, 16)
    conn.sendall(hmac.digest(bytes.fromhex(cfg["secret"]), nonce, "sha256"))
    payload = _payload(cfg["bytes"])
    while _recv_exact(conn, 1) == b"g":
        conn.sendall(payload.data)
    conn.close()


def mac_gbps(nbytes: int = 64 << 20, reps: int = 3) -> float:
    """The data-plane MAC (`Mac.seal`: what authenticates each cross-host payload, at both
    ends) on one core."""
    from earl.runtime.transport.auth import NONCE_LEN, Mac

    a = np.ones(nbytes, np.uint8)
    mac, nonce = Mac(b"k" * 32, b"bench"), os.urandom(NONCE_LEN)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        mac.seal(nonce, i, [a])
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times) / 1e9


