"""Hostile programs in the `python` sandbox: each is contained and reported as an error."""

from __future__ import annotations

import os
import socket
import time

import pytest

from earl.runtime.sandbox import SandboxLimits, isolation_available, run_python

LIMITS = SandboxLimits(wall_s=3.0, cpu_s=1, memory_mb=200, max_procs=8, output_chars=2000)
needs_isolation = pytest.mark.skipif(not isolation_available(),
                                     reason="namespaces/chroot/uid isolation needs root on Linux")


def _sandbox_processes() -> list[int]:
    """Running (not zombie) processes owned by sandbox uids (>= 1,000,000)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.stat(f"/proc/{entry}").st_uid < 1_000_000:
                    continue
                with open(f"/proc/{entry}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError):
                continue
            if state not in ("Z", "X"):
                pids.append(int(entry))
    return pids


def _wait_no_sandbox_processes(timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout  # SIGKILL delivery is asynchronous
    while (left := _sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_normal_code_runs() -> None:
    r = run_python("import math\nprint(math.factorial(10))", LIMITS)
    assert r.ok and r.output == "3628800\n" and r.error is None


def test_exception_is_reported() -> None:
    r = run_python("raise ValueError('bad')", LIMITS)
    assert not r.ok and "ValueError: bad" in r.output and r.error == "exit status 1"


def test_infinite_loop_hits_cpu_limit() -> None:
    r = run_python("while True:\n    pass", LIMITS)
    assert not r.ok and ("CPU limit" in r.error or "timeout" in r.error)
    assert r.returncode < 0  # killed by a signal (SIGXCPU/SIGKILL), not finished


def test_sleeping_forever_hits_wall_timeout() -> None:
    r = run_python("import time\ntime.sleep(100)", SandboxLimits(wall_s=0.5))
    assert not r.ok and r.error.startswith("timeout")


def test_memory_hog_is_stopped() -> None:
    r = run_python("chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))", LIMITS)
    assert not r.ok and "MemoryError" in r.output


def test_huge_output_is_capped() -> None:
    r = run_python("while True:\n    print('x' * 1000)", LIMITS)
    assert not r.ok and r.truncated and len(r.output) <= LIMITS.output_chars
    assert r.error == "output limit exceeded"


def test_unicode_output() -> None:
    r = run_python("print('héllo → 世界')", LIMITS)
    assert r.ok and r.output == "héllo → 世界\n"


@needs_isolation
def test_fork_bomb_is_contained_and_cleaned_up() -> None:
    code = ("import os\nwhile True:\n    try:\n        os.fork()\n"
            "    except OSError:\n        pass")
    r = run_python(code, LIMITS)
    assert not r.ok
    assert _wait_no_sandbox_processes() == []  # every descendant was killed
    assert run_python("print('still serving')", LIMITS).output == "still serving\n"


@needs_isolation
def test_no_network_even_to_host_loopback() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "print('connected')")
        r = run_python(code, LIMITS)
    finally:
        server.close()
    assert not r.ok and "connected" not in r.output and "Error" in r.output


@needs_isolation
def test_cannot_read_outside_its_dir() -> None:
    here = os.path.abspath(__file__)
    code = ("import os\nfor p in ['/etc/passwd', " + repr(here) + ", '/proc/1/environ']:\n"
            "    try:\n        open(p).read(); print('READ', p)\n"
            "    except OSError as e:\n        print('denied', p, type(e).__name__)\n"
            "print(sorted(os.listdir('/')))")
    r = run_python(code, LIMITS)
    assert r.ok and "READ" not in r.output and r.output.count("denied") == 3
    assert "etc" not in r.output.splitlines()[-1]


@needs_isolation
def test_cannot_write_outside_its_dir(tmp_path) -> None:
    target = tmp_path / "pwned"
    code = ("import os\nopen('mine.txt', 'w').write('ok')\nprint(open('mine.txt').read())\n"
            f"for p in [{str(target)!r}, '/usr/pwned', '/pwned']:\n"
            "    try:\n        open(p, 'w').write('x'); print('WROTE', p)\n"
            "    except OSError as e:\n        print('denied', type(e).__name__)")
    r = run_python(code, LIMITS)
    assert r.ok and r.output.startswith("ok\n") and "WROTE" not in r.output
    assert not target.exists() and not os.path.exists("/usr/pwned")


@needs_isolation
def test_cannot_kill_its_parent_or_others() -> None:
    code = ("import os, signal\nfor pid in (os.getppid(), 1):\n    try:\n"
            "        os.kill(pid, signal.SIGKILL); print('KILLED', pid)\n"
            "    except OSError as e:\n        print('denied', type(e).__name__)\n"
            "os.kill(-1, signal.SIGKILL)")
    r = run_python(code, LIMITS)
    assert "KILLED" not in r.output and r.output.count("denied") == 2
    assert r.ok  # kill(-1) reached no one: the run is alone in its uid


def test_environment_is_scrubbed(monkeypatch) -> None:
    monkeypatch.setenv("EARL_SECRET_TOKEN", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))", LIMITS)
    assert r.ok and "EARL_SECRET_TOKEN" not in r.output and "PATH" in r.output


@needs_isolation
def test_big_files_and_disk_filling_are_capped() -> None:
    code = ("import os\ntry:\n    open('big', 'wb').write(b'x' * (20 << 20))\n"
            "except OSError as e:\n    print('file', e.errno)\n"
            "n = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * (4 << 20))\n"
            "        n += 1\nexcept OSError as e:\n    print('disk', e.errno, n)")
    r = run_python(code, SandboxLimits(file_mb=8, disk_mb=32, wall_s=5))
    assert r.ok, r
    lines = r.output.split()
    assert lines[:2] == ["file", "27"]  # EFBIG
    assert lines[2:4] == ["disk", "28"] and int(lines[4]) <= 8  # ENOSPC within 32 MiB


def test_unprivileged_mode_still_has_no_network() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    try:
        code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                "print('connected')")
        r = run_python(code, LIMITS, full_isolation=False)
    finally:
        server.close()
    assert r.isolation.startswith("rlimits+userns")
    assert not r.ok and "connected" not in r.output
    assert run_python("print(2 + 2)", LIMITS, full_isolation=False).output == "4\n"


_SYSV = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
shm = []
for _ in range(3):
    i = libc.shmget(0, 1 << 20, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600
    ctypes.memset(libc.shmat(i, None, 0), 7, 1 << 20)  # filled, then left attached
    shm.append(i)
msg = [libc.msgget(0, 0o1600) for _ in range(2)]
print(min(shm + msg) >= 0)
"""


def _sysv_objects() -> set[tuple[str, str]]:
    """(kind, id) of every SysV shm segment and message queue in this IPC namespace."""
    out = set()
    for kind in ("shm", "msg"):
        with open(f"/proc/sysvipc/{kind}") as f:
            out |= {(kind, line.split()[1]) for line in f.readlines()[1:]}
    return out


@pytest.mark.parametrize("full", [
    pytest.param(True, marks=needs_isolation), pytest.param(False, id="unprivileged")])
def test_sysv_shared_memory_and_queues_vanish_with_the_run(full: bool) -> None:
    if not full and not run_python("print(1)", LIMITS, full_isolation=False).isolation \
            .startswith("rlimits+userns"):
        pytest.skip("user namespaces are off: no private IPC namespace without root")
    before = _sysv_objects()
    r = run_python(_SYSV, LIMITS, full_isolation=full)
    assert r.ok and r.output == "True\n", r.text()  # it did create them, in its namespace
    assert _sysv_objects() - before == set()  # ipcs shows none of them afterwards
