"""The sandbox's fork server: parallel runs, what a run inherits, and the zygote's failures."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from earl.runtime import sandbox
from earl.runtime.cleanup import pid_alive
from earl.runtime.sandbox import SandboxLimits, isolation_available, run_python

LIMITS = SandboxLimits(wall_s=5.0, cpu_s=2, memory_mb=200, max_procs=8, output_chars=2000)
MODES = [pytest.param(True, id="isolated", marks=pytest.mark.skipif(
    not isolation_available(), reason="needs root on Linux")), pytest.param(False, id="userns")]


def _zygote(isolated: bool) -> sandbox._Zygote:
    run_python("pass", LIMITS, full_isolation=isolated)  # make sure it is up
    return sandbox._zygotes[isolated]


@pytest.mark.parametrize("isolated", MODES)
def test_runs_from_many_threads_overlap_and_keep_their_own_output(isolated: bool) -> None:
    """Four runs from four threads each wait for a SIGUSR1, which is sent only once all four
    are seen waiting at the same time (so they run in parallel); then each prints its number."""
    z = _zygote(isolated)
    # blocked, the signal stays pending (and the mask shows in /proc) until the run sees it
    code = ("import signal, time\nsignal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])\n"
            "while signal.SIGUSR1 not in signal.sigpending():\n    time.sleep(0.01)\n"
            "print(%d)")
    waiting: list[int] = []

    def all_four_wait() -> bool:
        waiting[:] = [pid for pid in _children(z.proc.pid) if _blocks_usr1(pid)]
        return len(waiting) == 4

    long_wall = replace(LIMITS, wall_s=90.0)  # the runs wait for the signal, not the clock
    with ThreadPoolExecutor(4) as pool:
        pending = [pool.submit(run_python, code % i, long_wall, full_isolation=isolated)
                   for i in range(4)]
        try:
            _wait_until(all_four_wait, "four runs waiting at once", limit_s=45)
        finally:  # released either way, so a failure does not wait out their wall time
            for pid in waiting:
                os.kill(pid, signal.SIGUSR1)
        results = [f.result(timeout=60) for f in pending]
    assert all(r.ok for r in results), [r.text() for r in results]
    assert [r.output for r in results] == ["0\n", "1\n", "2\n", "3\n"]


@pytest.mark.parametrize("isolated", MODES)
def test_a_run_holds_no_descriptor_but_stdio(isolated: bool) -> None:
    code = textwrap.dedent("""
        import os
        held = []
        for fd in range(64):
            try:
                os.fstat(fd)
                held.append(fd)
            except OSError:
                pass
        print(held)
    """)
    r = run_python(code, LIMITS, full_isolation=isolated)
    assert r.ok and r.output == "[0, 1, 2]\n", r.text()


@pytest.mark.parametrize("isolated", MODES)
def test_the_zygote_refuses_bad_requests_and_keeps_serving(isolated: bool) -> None:
    z = _zygote(isolated)
    limits = {"cpu_s": 1, "memory_mb": 64, "max_procs": 4, "file_mb": 1, "disk_mb": 1}
    bad: list[tuple[bytes, int]] = [
        (b"\xff not json", 0), (b"[1, 2]", 0), (b'{"op": "exec"}', 0),
        (b'{"op": "start", "limits": {}}', 0),  # no descriptors
        (json.dumps({"op": "start", "limits": dict(limits, cpu_s=-1)}).encode(), 2),
        (json.dumps({"op": "start", "limits": "all"}).encode(), 2),
        (b'{"op": "finish", "pid": [1]}', 0), (b'{"op": "finish", "pid": 1}', 0)]
    with z.lock:
        for msg, nfds in bad:
            fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(nfds)]
            try:
                socket.send_fds(z.sock, [msg], fds)
            finally:
                for fd in fds:
                    os.close(fd)
            assert "error" in json.loads(z.sock.recv(1 << 16)), msg
    assert z.proc.poll() is None
    assert run_python("print(7)", LIMITS, full_isolation=isolated).output == "7\n"


@pytest.mark.parametrize("isolated", MODES)
def test_a_dead_zygote_fails_its_runs_cleanly_and_is_replaced(isolated: bool) -> None:
    z = _zygote(isolated)
    mine = os.path.join(tempfile.gettempdir(), f"earl-sandbox-{os.getpid()}-*")
    before = set(glob.glob(mine))  # an isolated zygote's root is named so too: not ours to remove
    code = ("import os, time\nif os.fork() == 0:\n    time.sleep(60)\n"  # an escaped child
            "print('started', flush=True)\ntime.sleep(60)")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_python, code, LIMITS, full_isolation=isolated)
        # the run is running: its program forked the child it leaves behind
        _wait_until(lambda: any(_children(run) for run in _children(z.proc.pid)),
                    "the run and its child")
        z.proc.kill()
        r = pending.result(timeout=30)
    assert not r.ok and r.error is not None, r  # reported, not raised
    assert run_python("print(8)", LIMITS, full_isolation=isolated).output == "8\n"
    assert sandbox._zygotes[isolated] is not z
    if not isolated:  # the killed zygote left its run's dir where the caller's sweep looks
        # (not under the runs' TMPDIR, /work: a real folder on a machine that has one)
        left = [d for d in set(glob.glob(mine)) - before
                if os.path.isfile(os.path.join(d, "main.py"))]
        assert left, sorted(set(glob.glob(mine)) - before)
        for d in left:
            shutil.rmtree(d, ignore_errors=True)


def test_the_zygote_and_its_runs_die_with_the_caller() -> None:
    script = textwrap.dedent("""
        import threading, time
        from earl.runtime import sandbox
        from earl.runtime.sandbox import run_python
        run_python("pass")
        threading.Thread(target=run_python, daemon=True,
                         args=("import os, time\\nos.fork()\\ntime.sleep(60)",)).start()
        print(sandbox._zygotes[sandbox.isolation_available()].proc.pid, flush=True)
        time.sleep(60)
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        zygote = int(caller.stdout.readline())
        runs: list[int] = []

        def run_and_child() -> bool:  # the run, and the child its program forked
            runs[:] = _children(zygote)
            runs.extend(p for run in list(runs) for p in _children(run))
            return len(runs) == 2

        _wait_until(run_and_child, "the run and its child alive under the zygote")
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    # the zygote notices the caller's death (it polls every second) and kills its runs
    _wait_until(lambda: not pid_alive(zygote) and not any(map(pid_alive, runs)),
                "the zygote and its runs gone")


def test_a_forked_caller_gets_its_own_zygote() -> None:
    parent = _zygote(isolation_available())
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        try:
            r = run_python("print(9)", LIMITS)
            mine = sandbox._zygotes[isolation_available()]
            os.write(write, f"{r.output.strip()} {mine is not parent}".encode())
        finally:
            os._exit(0)
    os.close(write)
    got = os.read(read, 100).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert got == "9 True"
    assert parent.usable() and run_python("print(1)", LIMITS).output == "1\n"


def _wait_until(done: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    """Poll `done` until it holds; fail naming `what` after `limit_s` (a bound on a hang on a
    loaded machine, not a timing the test asserts)."""
    deadline = time.monotonic() + limit_s
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up after {limit_s:g} s waiting for {what}")
        time.sleep(0.02)


def _blocks_usr1(pid: int) -> bool:
    """Whether process `pid`'s main thread blocks SIGUSR1 (a run waiting for one)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
    except (OSError, StopIteration):
        return False
    return bool(mask & (1 << (signal.SIGUSR1 - 1)))


def _children(pid: int) -> list[int]:
    """Direct children of `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError):
                continue
    return out
