"""The sandbox's fork server: parallel runs, what a run inherits, and the zygote's failures."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

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
    code = "import time\nt = time.time()\ntime.sleep(1.0)\nprint({i}, t, time.time())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_python(code.format(i=i), LIMITS,
                                                     full_isolation=isolated), range(4)))
    assert all(r.ok for r in results), [r.text() for r in results]
    spans = [tuple(map(float, r.output.split())) for r in results]
    assert [int(s[0]) for s in spans] == [0, 1, 2, 3]
    assert max(s[1] for s in spans) < min(s[2] for s in spans)  # all four ran at once


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
    code = ("import os, time\nif os.fork() == 0:\n    time.sleep(60)\n"  # an escaped child
            "print('started', flush=True)\ntime.sleep(60)")
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_python, code, LIMITS, full_isolation=isolated)
        time.sleep(0.5)
        z.proc.kill()
        r = pending.result(timeout=30)
    assert not r.ok and r.error is not None, r  # reported, not raised
    assert run_python("print(8)", LIMITS, full_isolation=isolated).output == "8\n"
    assert sandbox._zygotes[isolated] is not z


def test_the_zygote_and_its_runs_die_with_the_caller() -> None:
    script = textwrap.dedent("""
        import threading, time
        from earl.runtime import sandbox
        from earl.runtime.sandbox import run_python
        run_python("pass")
        threading.Thread(target=run_python, daemon=True,
                         args=("import os, time\\nos.fork()\\ntime.sleep(60)",)).start()
        time.sleep(0.5)
        print(sandbox._zygotes[sandbox.isolation_available()].proc.pid, flush=True)
        time.sleep(60)
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout is not None
        zygote = int(caller.stdout.readline())
        runs = _children(zygote)
        runs += [p for run in runs for p in _children(run)]
        assert len(runs) == 2, "the run and its child should be alive under the zygote"
    finally:
        caller.send_signal(signal.SIGKILL)
        caller.wait()
    deadline = time.monotonic() + 10  # the zygote notices within its 1 s poll
    while (pid_alive(zygote) or any(map(pid_alive, runs))) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(zygote) and not any(map(pid_alive, runs))


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
