"""Run untrusted Python code in a contained child process (the `python` tool's backend).

Each run gets: its own session/process group; rlimits on CPU time, address space, file size,
open files and processes; a private temp dir as cwd; a scrubbed environment; its own IPC
namespace wherever the kernel allows one (so SysV shared memory and message queues it creates
vanish with its last process instead of outliving it in the host's namespace); and, where the OS
allows (root, as in our containers), new mount and network namespaces, a chroot holding only
the read-only interpreter and system libraries plus the temp dir, and a fresh unprivileged uid
that is unique to the run (so RLIMIT_NPROC bounds fork bombs and every leftover process is
killed by uid), its dir being a size-capped tmpfs. Without root a run still gets a user+network
namespace where the kernel allows it, but no chroot, private uid or process cap (fork bombs
and reads outside its dir are then not contained). A wall-clock timeout kills the whole run's
process group. Output is capped. Failures are reported in `SandboxResult`, never raised.
This is not a VM: it trusts the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

__all__ = ["SandboxLimits", "SandboxResult", "isolation_available", "run_python"]

_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
_UID_BASE = 1_000_000  # run uid = base + child pid: unique among live runs, never a real user
_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/work", "TMPDIR": "/work", "LANG": "C.UTF-8",
        "PYTHONIOENCODING": "utf-8", "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass(kw_only=True, slots=True)
class SandboxLimits:
    """Resource limits of one run.

    Args:
        wall_s: wall-clock timeout; the whole run is killed after it.
        cpu_s: CPU seconds per process (RLIMIT_CPU).
        memory_mb: address space per process (RLIMIT_AS).
        max_procs: processes the run may have at once (needs the uid isolation).
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
    error: str | None  # "timeout", "exit 1", "killed by SIGXCPU", "output limit", ...
    truncated: bool
    elapsed_s: float
    isolation: str  # "chroot+netns+ipcns+uid" (root) or "rlimits+userns" (best effort otherwise)

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
        os._exit(0 if _libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC) == 0
                 else 1)
    return os.waitpid(pid, 0)[1] == 0


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bind(libc: ctypes.CDLL, src: str, dst: str, writable: bool = False) -> None:
    _check(libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None), f"bind {src}")
    if not writable:
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_REC
        _check(libc.mount(None, dst.encode(), None, flags, None), f"remount ro {dst}")


def _system_dirs() -> list[str]:
    """Read-only dirs the interpreter needs: /usr, /lib*, /bin and the Python install."""
    dirs = [d for d in ("/usr", "/lib", "/lib64", "/bin") if os.path.exists(d)]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return dirs


def _build_root(root: str, work: str) -> None:
    """Lay out the chroot skeleton (as the parent, before forking)."""
    for d in _system_dirs():
        target = root + d
        if os.path.islink(d):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.symlink(os.readlink(d), target)
        else:
            os.makedirs(target, exist_ok=True)
    os.makedirs(root + "/dev", exist_ok=True)
    open(root + "/dev/null", "w").close()
    os.makedirs(root + "/work", exist_ok=True)
    os.chmod(root, 0o755)


def _preexec(limits: SandboxLimits, root: str | None, work: str) -> None:
    """Runs in the child between fork and exec: namespaces, chroot, uid, rlimits."""
    mb = 1 << 20
    if root is not None:
        libc = _libc()
        _check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare")
        _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
        for d in _system_dirs():
            if not os.path.islink(d):
                _bind(libc, d, root + d)
        _bind(libc, "/dev/null", root + "/dev/null", writable=True)
        uid = _UID_BASE + os.getpid()
        # The run's cwd is a size-capped tmpfs, so it cannot fill the host's disk.
        opts = f"size={limits.disk_mb}m,mode=0700,uid={uid},gid={uid}".encode()
        _check(libc.mount(b"tmpfs", (root + "/work").encode(), b"tmpfs", 0, opts), "mount tmpfs")
        shutil.copyfile(os.path.join(work, "main.py"), root + "/work/main.py")
        os.chroot(root)
        os.chdir("/work")
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_procs, limits.max_procs))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:  # unprivileged: a user namespace still buys empty network and IPC namespaces
        # best effort: fails where user namespaces are off
        _libc().unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC)
    # Die with the worker that started us (set after setuid, which clears it).
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_mb * mb, limits.file_mb * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_uid(uid: int) -> None:
    """Kill every process owned by `uid` (escaped grandchildren included)."""
    pid = os.fork()
    if pid == 0:  # a child that becomes `uid` may signal exactly that uid's processes
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def _kill(proc: subprocess.Popen[bytes], uid: int | None) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is not None:
        _kill_uid(uid)


def run_python(code: str, limits: SandboxLimits | None = None, *,
               full_isolation: bool | None = None) -> SandboxResult:
    """Run `code` with the sandboxed interpreter; return its (capped) output and status.

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
    base = tempfile.mkdtemp(prefix=f"earl-sandbox-{os.getpid()}-")  # pid: see runtime.cleanup
    work = os.path.join(base, "work")
    os.makedirs(work)
    root = os.path.join(base, "root") if isolated else None
    if root is not None:
        _build_root(root, work)
    with open(os.path.join(work, "main.py"), "w", encoding="utf-8") as f:
        f.write(code)
    exe = os.path.realpath(sys.executable)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [exe, "-I", "-S", "main.py"], cwd=work, env=dict(_ENV, HOME=work, TMPDIR=work)
        if root is None else _ENV, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
        preexec_fn=lambda: _preexec(limits, root, work))  # noqa: PLW1509 - workers are single-threaded
    uid = _UID_BASE + proc.pid if root is not None else None
    out, size, error, truncated = bytearray(), 0, None, False
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = t0 + limits.wall_s
    cap = limits.output_chars * 4  # bytes; the char cap is applied after decoding
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                error = f"timeout after {limits.wall_s:g} s"
                break
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            size += len(chunk)
            out += chunk[: max(0, cap - len(out))]
            if size > cap:
                error, truncated = "output limit exceeded", True
                break
        _kill(proc, uid)  # the main process may be done; its children may not
        rc = proc.wait()
    finally:
        sel.close()
        proc.stdout.close()
        shutil.rmtree(base, ignore_errors=True)
    text = out.decode("utf-8", errors="replace")
    if len(text) > limits.output_chars:
        text, truncated = text[: limits.output_chars], True
        error = error or "output limit exceeded"
    if error is None and rc != 0:
        error = (f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit status {rc}")
        if rc in (-signal.SIGXCPU, -signal.SIGKILL) and time.monotonic() - t0 < limits.wall_s:
            error += f" (CPU limit {limits.cpu_s} s)"
    return SandboxResult(ok=error is None, output=text, returncode=rc, error=error,
                         truncated=truncated, elapsed_s=time.monotonic() - t0,
                         isolation="chroot+netns+ipcns+uid" if root
                         else "rlimits+userns" if _userns_available() else "rlimits")
