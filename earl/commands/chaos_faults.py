"""The fault primitives of `earl chaos` and its after-run checks.

Faults: random bytes and a length lie on an actor's socket (`corrupt`), delayed driver control
messages (`delay_requests`), a driver connection cut with a call in flight (`cut_when_busy`), a small tmpfs of its own under a folder (`mount_tmpfs`, `umount`)
filled up (`fill`); `until` polls a condition. Checks: processes, shm segments and folders a
run left (`orphans`), policy versions of the trajectories that never go back past the staleness
bound (`versions_monotone`). Not here: when to inject, and the report (`earl.commands.chaos`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["corrupt", "cut_when_busy", "delay_requests", "fill", "mount_tmpfs", "orphans", "umount", "until",
           "versions_monotone"]


async def corrupt(address: str, rng: Any) -> None:
    """Random bytes, then a frame header whose length lies, to an actor's socket."""
    from earl.runtime.conn import open_stream

    _, writer = await open_stream(address)
    try:  # the actor may hang up at the first bad byte: that is the expected outcome
        writer.write(bytes(rng.getrandbits(8) for _ in range(256)))
        writer.write((250 << 20).to_bytes(4, "little") + b"\x01" * 64)
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


async def delay_requests(seconds: float, rng: Any) -> int:
    """Delay 30% of the driver's control messages by 50-300 ms for `seconds`."""
    from earl.runtime.conn import Connection

    orig = Connection.request
    count = 0

    def request(self: Any, kind: int, body: bytes, bufs: list[Any]) -> Any:
        nonlocal count
        if rng.random() >= 0.3:
            return orig(self, kind, body, bufs)
        count += 1
        loop = asyncio.get_running_loop()
        outer = loop.create_future()

        def send() -> None:
            try:
                inner = orig(self, kind, body, bufs)
            except Exception as exc:  # noqa: BLE001
                if not outer.done():
                    outer.set_exception(exc)
                return

            def done(f: Any) -> None:
                if outer.done():
                    return
                if f.cancelled():
                    outer.cancel()
                elif f.exception() is not None:
                    outer.set_exception(f.exception())
                else:
                    outer.set_result(f.result())

            inner.add_done_callback(done)

        loop.call_later(rng.uniform(0.05, 0.3), send)
        return outer

    Connection.request = request  # type: ignore[method-assign]
    try:
        await asyncio.sleep(seconds)
    finally:
        Connection.request = orig  # type: ignore[method-assign]
    return count


def cut_when_busy(conn: Any) -> asyncio.Future[int]:
    """Abort the driver's connection `conn` (`earl.runtime.conn.Connection`) with a call in
    flight: now if it has one, else right after its next call is sent (a poll would miss a
    short call, answered within a millisecond). The future gives the calls and streams in
    flight when it was cut; cancel it to leave the connection alone."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[int] = loop.create_future()

    def busy() -> int:
        return len(conn.pending) + len(conn.streams)

    def cut() -> None:
        if done.done() or not busy():  # answered already: wait for the next call
            return
        if conn.transport is None or conn.dead is not None:
            done.set_exception(ConnectionError(f"{conn.label}: the connection is gone"))
            return
        n = busy()
        conn.transport.abort()
        done.set_result(n)

    def request(kind: int, body: bytes, bufs: list[Any]) -> Any:
        fut = orig(kind, body, bufs)
        loop.call_soon(cut)  # once the call is on the wire
        return fut

    orig = conn.request
    conn.request = request
    done.add_done_callback(lambda _: vars(conn).pop("request", None))
    cut()
    return done


def mount_tmpfs(folder: Path, size: int) -> str:
    """A tmpfs of `size` bytes at `folder` (root only); "" when it cannot be mounted."""
    import subprocess

    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return ""
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                       capture_output=True, check=False)
    return "tmpfs" if r.returncode == 0 else ""


def umount(folder: Path) -> None:
    import subprocess

    subprocess.run(["umount", "-l", str(folder)], capture_output=True, check=False)


def fill(path: Path) -> None:
    """Write zeros to `path` until the file system is full."""
    chunk = b"\0" * (1 << 20)
    try:
        with open(path, "wb") as f:
            while True:
                f.write(chunk)
                f.flush()
    except OSError:
        pass


def orphans(pids: set[int]) -> dict[str, list[str]]:
    """What the run left: live actor processes, and shm segments / folders named after any
    process of the run (the driver and every actor pid seen)."""
    import glob
    import re

    from earl.runtime.cleanup import SEGMENT_RE, pid_alive

    procs = [str(p) for p in sorted(pids) if p != os.getpid() and pid_alive(p)]
    shm, dirs = [], []
    for path in glob.glob("/dev/shm/earl-*"):
        m = SEGMENT_RE.match(os.path.basename(path))
        if m and int(m.group(2)) in pids:
            shm.append(path)
    for base in sorted({tempfile.gettempdir(), "/tmp"}):
        for path in glob.glob(os.path.join(base, "earl-*")):
            m = re.match(r"^earl-(?:shm-|zmq-|sandbox-)?(\d+)-", os.path.basename(path))
            if m and int(m.group(1)) in pids:
                dirs.append(path)
    return {"processes": procs, "shm_segments": shm, "folders": dirs}


def versions_monotone(out: Path, lag: int, partial: bool = False) -> bool:
    """Steps logged 1, 2, ... once each; within each dumped trajectory the policy versions of
    its tokens never go down, and none is older than its batch allows (`max_policy_lag`). With
    partial rollouts a step trains groups of any batch: no trained token is more than
    `max_policy_lag` versions older than its step (`staleness_max` of each step)."""
    metrics = out / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] \
        if metrics.is_file() else []
    if [r["step"] for r in rows] != list(range(1, len(rows) + 1)):
        return False
    if partial and any(r.get("staleness_max", 0) > lag for r in rows):
        return False
    for path in out.glob("trajectories*.jsonl"):
        for line in path.read_text().splitlines():
            t = json.loads(line)
            v = [x for x in t.get("versions", []) if x >= 0]
            if any(b < a for a, b in itertools.pairwise(v)):
                return False
            if v and v[0] < t["step"] - 1 - lag and not partial:
                return False
    return True


def healed_count(events: list[dict[str, Any]], what: str, actor: str | None = None) -> int:
    """How many of the supervisor's `events` are `what` ("restart", "rewind", "stall"), of
    `actor` when given: a fault healed when its count went up after it fired."""
    return sum(e["event"] == what and (actor is None or e["actor"] == actor) for e in events)


async def until(pred: Any, timeout: float) -> bool:
    """Wait until `pred()` holds, polling every 0.1 s; False after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True
