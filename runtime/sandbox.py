"""Run untrusted Python code in a contained child process (the `python` tool's backend).

Each run gets: its own session/process group; rlimits on CPU time, address space, file size,
open files and processes; a private temp dir as cwd; a scrubbed environment; its own IPC
namespace wherever the kernel allows one (so SysV shared memory and message queues it creates
vanish with its last process instead of outliving it in the host's namespace); `no_new_privs`
and a seccomp filter denying the calls that reach past the sandbox (ptrace, mount, namespaces,
bpf, keyrings, kernel modules, ...: `sandbox_seccomp.py`); and, where the OS allows (root, as in
our containers), new mount and network namespaces, a chroot holding only the read-only, nosuid
interpreter and system libraries plus the temp dir, a fresh unprivileged uid that is unique to
the run (so RLIMIT_NPROC bounds fork bombs and every leftover process is killed by uid), its dir
being a size-capped tmpfs, and a memory cgroup that bounds all its processes together. Without
root a run still gets a user+network namespace where the kernel allows it, but no chroot,
private uid, process cap or cgroup (fork bombs, reads outside its dir and memory spread over
many processes are then not contained). A wall-clock timeout kills the whole run. Nothing of a
run outlives its fork server, even when the server is killed (see `sandbox_zygote.py`). Output
is capped. Failures are reported in `SandboxResult`, never raised. This is not a VM: it trusts
the kernel.

Runs are forked by a small fork server per calling process (`sandbox_zygote.py`, started on
first use), not by the caller: a run costs a fork of that interpreter instead of a fork of the
caller and a fresh interpreter. This module is the caller's side: limits, the zygote's
lifetime, reading the output, the result.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from earl.runtime import sandbox_namespaces, sandbox_zygote

__all__ = ["SandboxLimits", "SandboxResult", "close_fork_servers", "isolation_available",
           "run_python"]

_ZYGOTE = str(Path(sandbox_zygote.__file__))
_REPLY_TIMEOUT_S = 10.0  # a zygote's replies take milliseconds; silence this long means stuck
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one run.

    Args:
        wall_s: wall-clock timeout; the whole run is killed after it.
        cpu_s: CPU seconds per process (RLIMIT_CPU).
        memory_mb: memory of the whole run. With root and a cgroup v1 memory controller, a
            cgroup bounds the memory (resident, page cache and its tmpfs files) of all its
            processes together; reaching it kills the run; each process's address space is
            also capped at `memory_mb`, so one greedy process gets a `MemoryError` first.
            With root but no cgroups the budget is split: each process's address space is
            `memory_mb / max_procs` (at least 64 MB) and `max_procs` shrinks so their product
            stays within `memory_mb`. Without root it caps each process's address space only.
        max_procs: processes (and threads) the run may have at once (needs the uid isolation).
        file_mb: largest file it may write.
        disk_mb: total size of its private dir (a tmpfs; with the uid isolation only).
        output_chars: stdout+stderr kept; more is cut and the run is killed.
    """

    wall_s: float = 5.0
    cpu_s: int = 2
    memory_mb: int = 256
    max_procs: int = 16
    file_mb: int = 8
    disk_mb: int = 32
    output_chars: int = 8192

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_mb", "max_procs", "file_mb", "disk_mb",
                     "output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {getattr(self, name)}")


@dataclass(kw_only=True, slots=True)
class SandboxResult:
    """What happened: `ok` is True only for exit status 0 within all limits."""

    ok: bool
    output: str
    returncode: int | None
    error: str | None  # "timeout", "exit 1", "killed by SIGXCPU", "memory limit", ...
    truncated: bool
    elapsed_s: float
    isolation: str  # "chroot+netns+ipcns+uid+seccomp+memcg" (root), "rlimits+userns+seccomp"
    memory_peak_mb: float | None  # the run's processes together at most; None: not measured

    def text(self) -> str:
        """The tool observation: the output plus a one-line error note when it failed."""
        note = f"\n[error: {self.error}]" if self.error else ""
        return (self.output or ("" if self.error else "(no output)")) + note


def isolation_available() -> bool:
    """True where runs get namespaces, chroot and a private uid (we are root on Linux)."""
    return sys.platform == "linux" and os.geteuid() == 0


@functools.cache
def _userns_available() -> bool:
    """Whether an unprivileged user+network namespace can be created here (probed once)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if sandbox_namespaces.unshare_userns() else 1)
    return os.waitpid(pid, 0)[1] == 0


@dataclass(frozen=True, slots=True)
class _RunEnd:
    """The zygote's finish reply: return code, whether the run hit its memory cgroup's limit,
    and its peak memory in MiB (None without a cgroup)."""

    rc: int
    oom: bool
    peak_mb: float | None


class _Zygote:
    """The calling process's handle on one fork server (`sandbox_zygote.py`).

    Requests from many threads are serialized by a lock (each takes well under a millisecond);
    the runs themselves proceed in parallel. Any failure to talk to the zygote retires it
    (killed; its runs die with it) and the next call starts a fresh one.
    """

    def __init__(self, isolated: bool) -> None:
        self.owner = os.getpid()
        self.lock = threading.Lock()
        self.broken = False
        self.root = tempfile.mkdtemp(prefix=f"earl-sandbox-{self.owner}-") if isolated else None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        args = [os.path.realpath(sys.executable), "-I", "-S", _ZYGOTE,
                "--caller", str(self.owner), "--fd", str(theirs.fileno()),
                "--tmp", tempfile.gettempdir()]  # not the runs' TMPDIR (/work in their root)
        if self.root is not None:
            args += ["--root", self.root]
        try:
            self.proc = subprocess.Popen(args, env=_ENV, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                                         start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self.sock.settimeout(_REPLY_TIMEOUT_S)

    def usable(self) -> bool:
        return self.owner == os.getpid() and not self.broken and self.proc.poll() is None

    def start(self, limits: SandboxLimits, code_fd: int, out_fd: int) -> tuple[int, str]:
        """Fork a run reading its program from `code_fd` and writing to `out_fd`; its pid and
        the isolation it gets beyond namespaces ("+seccomp+memcg")."""
        out = self._ask({"op": "start", "limits": {k: getattr(limits, k)
                                                    for k in sandbox_zygote.LIMIT_FIELDS}},
                        [code_fd, out_fd])
        return int(out["pid"]), str(out["features"])

    def finish(self, pid: int) -> _RunEnd:
        """Kill whatever is left of run `pid`, reap it; how it ended."""
        out = self._ask({"op": "finish", "pid": pid}, [])
        peak = out["peak_mb"]
        return _RunEnd(rc=int(out["rc"]), oom=out["oom"] is True,
                       peak_mb=None if peak is None else float(peak))

    def _ask(self, request: dict[str, object], fds: list[int]) -> dict[str, Any]:
        with self.lock:
            try:
                if self.broken:
                    raise ConnectionError("the sandbox zygote was retired")
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
                reply = self.sock.recv(1 << 16)
                if not reply:
                    raise ConnectionError("the sandbox zygote exited")
                out = json.loads(reply)
            except (OSError, ValueError):
                self.broken = True
                self.proc.kill()
                raise
        if "error" in out:
            raise OSError(f"the sandbox zygote refused {request['op']}: {out['error']}")
        return out

    def close(self) -> None:
        """Stop the zygote (it kills its runs) and remove its root dir."""
        self.sock.close()
        try:
            self.proc.wait(timeout=_REPLY_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


_zygotes: dict[bool, _Zygote] = {}
_zygotes_lock = threading.Lock()


def _zygote(isolated: bool) -> _Zygote:
    """This process's zygote for `isolated`: started on first use, and again after a fork
    (a child never uses its parent's) or after the last one died."""
    with _zygotes_lock:
        z = _zygotes.get(isolated)
        if z is None or not z.usable():
            if z is not None and z.owner == os.getpid():
                z.close()
            z = _zygotes[isolated] = _Zygote(isolated)
        return z


@atexit.register
def close_fork_servers() -> None:
    """Stop this process's fork servers (and any runs they hold); the next call starts one."""
    with _zygotes_lock:
        for z in _zygotes.values():
            if z.owner == os.getpid():
                z.close()
        _zygotes.clear()


def run_python(code: str, limits: SandboxLimits | None = None, *,
               full_isolation: bool | None = None) -> SandboxResult:
    """Run `code` with the sandboxed interpreter; return its (capped) output and status.

    Safe to call from many threads at once; the runs proceed in parallel.

    Example:
        >>> run_python("print(6 * 7)").output
        '42\\n'
    """
    if not isinstance(code, str):
        raise TypeError(f"code must be a str, got {type(code).__name__}")
    limits = limits or SandboxLimits()
    isolated = isolation_available() if full_isolation is None else full_isolation
    if isolated and not isolation_available():
        raise ValueError("full_isolation=True needs root on Linux; pass None to pick "
                         "what the OS allows")
    mode = ("chroot+netns+ipcns+uid" if isolated
            else "rlimits+userns" if _userns_available() else "rlimits")
    t0 = time.monotonic()
    code_fd = os.memfd_create("earl-sandbox-code", os.MFD_CLOEXEC)
    read_fd, write_fd = os.pipe()
    try:
        os.write(code_fd, code.encode("utf-8"))
        os.lseek(code_fd, 0, os.SEEK_SET)
        zygote = _zygote(isolated)
        pid, features = zygote.start(limits, code_fd, write_fd)
    except OSError as e:
        os.close(read_fd)
        return SandboxResult(ok=False, output="", returncode=None, truncated=False,
                             error=f"sandbox unavailable: {e}", isolation=mode,
                             elapsed_s=time.monotonic() - t0, memory_peak_mb=None)
    finally:
        os.close(code_fd)
        os.close(write_fd)
    mode += features
    out, error, truncated = _read_output(read_fd, limits, t0 + limits.wall_s)
    end: _RunEnd | None
    try:
        end = zygote.finish(pid)  # kills what is left of the run
    except OSError as e:  # the zygote died under the run: what the run left is ours to kill
        sandbox_zygote.kill_run(pid, sandbox_zygote.UID_BASE + pid if isolated else None)
        end, error = None, error or f"sandbox failed: {e}"
    if end is not None and end.oom:
        error = (f"memory limit exceeded: the run's processes together reached "
                 f"memory_mb={limits.memory_mb}")
    text = out.decode("utf-8", errors="replace")
    if len(text) > limits.output_chars:
        text, truncated = text[: limits.output_chars], True
        error = error or "output limit exceeded"
    rc = None if end is None else end.rc
    if error is None and rc != 0:
        assert rc is not None
        error = (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
        if rc in (-signal.SIGXCPU, -signal.SIGKILL) and time.monotonic() - t0 < limits.wall_s:
            error += f" (CPU limit {limits.cpu_s} s)"
    return SandboxResult(ok=error is None, output=text, returncode=rc, error=error,
                         truncated=truncated, elapsed_s=time.monotonic() - t0, isolation=mode,
                         memory_peak_mb=None if end is None else end.peak_mb)


def _read_output(fd: int, limits: SandboxLimits, deadline: float
                 ) -> tuple[bytes, str | None, bool]:
    """Read the run's output until EOF, the deadline or the cap; closes `fd`.
    Returns (output, error, truncated)."""
    out, size = bytearray(), 0
    cap = limits.output_chars * 4  # bytes; the char cap is applied after decoding
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), f"timeout after {limits.wall_s:g} s", False
            if not sel.select(timeout=left):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(out), None, False
            size += len(chunk)
            out += chunk[: max(0, cap - len(out))]
            if size > cap:
                return bytes(out), "output limit exceeded", True
    finally:
        sel.close()
        os.close(fd)
