"""The sandbox's second line: whole-run memory, no_new_privs, seccomp, nosuid mounts, and runs
that die with their fork server even when it is SIGKILLed (and its caller too)."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from earl.runtime import sandbox, sandbox_memory, sandbox_reaper, sandbox_zygote
from earl.runtime.sandbox import SandboxLimits, isolation_available, run_python

LIMITS = SandboxLimits(wall_s=10.0, cpu_s=5, memory_mb=256, max_procs=16, output_chars=4000)
needs_isolation = pytest.mark.skipif(not isolation_available(),
                                     reason="namespaces/chroot/uid isolation needs root on Linux")
MODES = [pytest.param(True, id="isolated", marks=needs_isolation),
         pytest.param(False, id="unprivileged")]
_ARCH = platform.machine().lower()
_KEYCTL = {"x86_64": 250, "amd64": 250, "aarch64": 219, "arm64": 219}.get(_ARCH)
needs_filter = pytest.mark.skipif(_KEYCTL is None, reason=f"no seccomp filter on {_ARCH}")


def _memory_cgroup() -> str | None:
    """This process's cgroup v1 memory directory, where runs' groups nest; None without one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f
                        if "memory" in line.split(":")[1].split(","))
    except (OSError, StopIteration):
        return None
    return "/sys/fs/cgroup/memory" + path if os.path.isdir("/sys/fs/cgroup/memory" + path) \
        else None


def _needs_memcg() -> None:
    here = _memory_cgroup()
    if not isolation_available() or here is None or not os.access(here, os.W_OK):
        pytest.skip("whole-run memory limits need root and a cgroup v1 memory controller")


def _poll(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether `condition` became true within `timeout` (kills and exits are asynchronous)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _children(pid: int) -> list[int]:
    try:
        return [c.pid for c in psutil.Process(pid).children()]
    except psutil.NoSuchProcess:
        return []


def _uid_processes(uid: int) -> list[int]:
    """Live (not zombie) processes owned by `uid`."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{entry}").st_uid != uid:
                continue
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    out.append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _memory_groups(prefix: str) -> list[str]:
    here = _memory_cgroup()
    return [] if here is None else [n for n in os.listdir(here) if n.startswith(prefix)]


_CHILDREN_64MB = textwrap.dedent("""
    import os, time
    kids = []
    for _ in range(12):
        pid = os.fork()
        if pid == 0:
            block = bytearray(64 << 20)
            for i in range(0, len(block), 4096):
                block[i] = 1  # touched: resident, not just reserved
            time.sleep(3)
            os._exit(0)
        kids.append(pid)
    print([os.waitpid(k, 0)[1] for k in kids])
""")


def test_memory_limit_holds_for_the_whole_run() -> None:
    _needs_memcg()
    r = run_python(_CHILDREN_64MB, LIMITS)  # 12 x 64 MB = 768 MB, no process over 256 MB
    assert not r.ok and r.error is not None and r.error.startswith("memory limit exceeded"), r
    assert r.memory_peak_mb is not None and r.memory_peak_mb <= LIMITS.memory_mb
    one = run_python("block = bytearray(100 << 20)\nfor i in range(0, len(block), 4096):\n"
                     "    block[i] = 1\nprint('ok')", LIMITS)
    assert one.ok and one.output == "ok\n", one.text()
    assert one.memory_peak_mb is not None and 100 <= one.memory_peak_mb <= LIMITS.memory_mb


def test_without_cgroups_the_memory_budget_is_split_between_processes() -> None:
    for memory_mb, max_procs in [(256, 16), (200, 8), (32, 16), (4096, 8), (64, 1)]:
        per, cap = sandbox_memory.split(memory_mb, max_procs, whole_run=False,
                                               capped=True)
        assert cap is not None and 1 <= cap <= max_procs and per * cap <= memory_mb
        assert per >= min(memory_mb, 64)  # an interpreter still starts
    assert sandbox_memory.split(256, 16, whole_run=True, capped=True) == (256, 16)


_PRIVS = textwrap.dedent("""
    import ctypes
    libc = ctypes.CDLL(None)
    print(libc.prctl(39, 0, 0, 0, 0), libc.prctl(21, 0, 0, 0, 0))  # GET_NO_NEW_PRIVS, _SECCOMP
""")


@needs_filter
@pytest.mark.parametrize("isolated", MODES)
def test_runs_have_no_new_privs_and_a_seccomp_filter(isolated: bool) -> None:
    r = run_python(_PRIVS, LIMITS, full_isolation=isolated)
    assert r.ok and r.output == "1 2\n", r.text()  # no_new_privs set, seccomp mode 2 (filter)
    assert "+seccomp" in r.isolation


@needs_isolation
@needs_filter
def test_the_kernel_reports_no_new_privs_and_seccomp_for_a_live_run() -> None:
    zygote = sandbox._zygote(True).proc.pid

    def status() -> bool:
        for run in _children(zygote):
            try:
                with open(f"/proc/{run}/status") as f:
                    fields = dict(line.split(":\t", 1) for line in f)
            except OSError:  # gone meanwhile
                continue
            if fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2":
                return True
        return False

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_python, "import time\ntime.sleep(3)", LIMITS)
        assert _poll(status)  # /proc/<run>/status: "NoNewPrivs: 1", "Seccomp: 2"
        assert pending.result(timeout=30).ok


_ESCAPES = textwrap.dedent("""
    import ctypes, errno, multiprocessing, os, subprocess, sys, threading
    libc = ctypes.CDLL(None, use_errno=True)

    def in_child(call):  # each probe in a throwaway child: one that works changes nothing
        r, w = os.pipe()
        if os.fork() == 0:
            rc = call()
            os.write(w, (errno.errorcode.get(ctypes.get_errno(), "?") if rc == -1 else "ok")
                     .encode())
            os._exit(0)
        os.close(w)
        out = os.read(r, 100).decode()
        os.wait()
        return out

    print("unshare", in_child(lambda: libc.unshare(0x10000000)))  # CLONE_NEWUSER
    print("ptrace", in_child(lambda: libc.ptrace(0, 0, 0, 0)))  # PTRACE_TRACEME
    print("mount", in_child(lambda: libc.mount(b"none", b"/work", b"tmpfs", 0, None)))
    print("keyctl", in_child(lambda: libc.syscall(KEYCTL, 0, -3, 0)))  # session keyring id
    print("clone_newpid", in_child(lambda: libc.syscall(CLONE, 0x20000000 | 17, 0, 0, 0, 0)))
    t = threading.Thread(target=print, args=("thread works",))
    t.start()
    t.join()
    print(subprocess.run([sys.executable, "-c", "print('subprocess works')"],
                         capture_output=True, text=True).stdout.strip())
    p = multiprocessing.get_context("fork").Process(target=print, args=("fork works",))
    p.start()
    p.join()
""")


@needs_filter
@pytest.mark.parametrize("isolated", MODES)
def test_seccomp_denies_escapes_but_python_still_works(isolated: bool) -> None:
    clone = 56 if _KEYCTL == 250 else 220
    code = f"KEYCTL, CLONE = {_KEYCTL}, {clone}\n" + _ESCAPES
    r = run_python(code, LIMITS, full_isolation=isolated)
    assert r.ok, r.text()
    lines = r.output.splitlines()
    assert lines[:5] == ["unshare EPERM", "ptrace EPERM", "mount EPERM", "keyctl EPERM",
                         "clone_newpid EPERM"], r.output
    assert sorted(lines[5:]) == ["fork works", "subprocess works", "thread works"], r.output


_MOUNT_FLAGS = textwrap.dedent("""
    import os, sys
    for path in ("/usr", "/usr/bin", "/bin", sys.base_prefix, "/work"):
        flags = os.statvfs(path).f_flag
        print(path == "/work" or bool(flags & os.ST_RDONLY), bool(flags & os.ST_NOSUID),
              bool(flags & os.ST_NODEV))
""")


@needs_isolation
def test_system_dirs_and_the_work_dir_are_nosuid_and_nodev() -> None:
    r = run_python(_MOUNT_FLAGS, LIMITS)
    assert r.ok, r.text()
    assert r.output.splitlines() == ["True True True"] * 5  # setuid bits do nothing there


_DAEMON = textwrap.dedent("""
    import os, time
    if os.fork() == 0:  # the classic daemon: setsid, fork again, parent gone
        os.setsid()
        if os.fork() == 0:
            time.sleep(120)
        os._exit(0)
    time.sleep(120)
""")


def _kill_uid_after(uid: int) -> None:
    """Test hygiene: on a failure, what the run left must not outlive the test."""
    if _uid_processes(uid):
        sandbox_reaper.kill_uid(uid)


@needs_isolation
def test_a_killed_zygote_takes_its_runs_setsid_grandchildren_with_it() -> None:
    z = sandbox._zygote(True)
    limits = SandboxLimits(wall_s=60.0, cpu_s=5)  # the caller's timeout is not the rescue
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run_python, _DAEMON, limits)
        assert _poll(lambda: len(_children(z.proc.pid)) == 1)
        uid = sandbox_zygote.UID_BASE + _children(z.proc.pid)[0]
        try:
            assert _poll(lambda: len(_uid_processes(uid)) == 2)  # the run and the daemon
            z.proc.kill()
            assert _poll(lambda: not _uid_processes(uid)), _uid_processes(uid)
            r = pending.result(timeout=30)
        finally:
            _kill_uid_after(uid)
    assert not r.ok and r.error is not None and not r.error.startswith("timeout"), r
    assert _poll(lambda: not _memory_groups(f"earl-sandbox-{z.proc.pid}-"))


@needs_isolation
def test_runs_die_when_the_zygote_and_its_caller_both_die() -> None:
    script = textwrap.dedent(f"""
        import threading, time
        from earl.runtime import sandbox
        from earl.runtime.sandbox import SandboxLimits, run_python
        run_python("pass")
        print(sandbox._zygotes[True].proc.pid, flush=True)
        threading.Thread(target=run_python, daemon=True,
                         args=({_DAEMON!r}, SandboxLimits(wall_s=60.0))).start()
        time.sleep(120)
    """)
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    uid = None
    try:
        assert caller.stdout is not None
        zygote = int(caller.stdout.readline())
        assert _poll(lambda: len(_children(zygote)) == 1)
        uid = sandbox_zygote.UID_BASE + _children(zygote)[0]
        assert _poll(lambda: len(_uid_processes(uid)) == 2)  # the run and the daemon
        os.kill(zygote, signal.SIGKILL)  # first, so the caller has no time to clean up
        caller.send_signal(signal.SIGKILL)
        caller.wait()
        assert _poll(lambda: not _uid_processes(uid)), _uid_processes(uid)
    finally:
        caller.kill()
        caller.wait()
        if uid is not None:
            _kill_uid_after(uid)
