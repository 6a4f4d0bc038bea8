"""The sandbox's fork server ("zygote"): one small interpreter per caller forks every run.

`earl.runtime.sandbox` starts this file as a script (`python -I -S sandbox_zygote.py`, stdlib
only, nothing of EARL imported) once per calling process and isolation mode, and talks to it
over a private `AF_UNIX` socket pair. Starting a run is then a fork of this small process plus
the run's own namespaces, instead of a fork of the caller (which may map gigabytes) and a fresh
interpreter (~7 ms of CPU before the first line of user code).

With root (`--root DIR`), the zygote first isolates itself once: its own mount and network
namespaces, read-only bind mounts of the interpreter and system libraries under DIR, and a
chroot into DIR. Each run then forks from there and adds what is per run: new mount, network
and IPC namespaces, a size-capped tmpfs at /work owned by a fresh uid (`UID_BASE + pid`) that it
switches to, and rlimits. Without root each run gets a user+network+IPC namespace where the
kernel allows one and a private temp dir, as in `sandbox.py`'s docstring.

The program's source never passes through the zygote: the caller hands over a memfd holding it
and the write end of the output pipe (`SCM_RIGHTS`); the zygote forks, and only the run reads
them. A run holds no descriptor but stdin (/dev/null) and the output pipe, and no memory of the
caller. The zygote exits, killing its runs, when the caller closes the socket or dies.

Protocol, one JSON message per `SOCK_SEQPACKET` packet, one reply each:
    {"op": "start", "limits": {...}}  + fds [code memfd, output pipe]  -> {"pid": P}
    {"op": "finish", "pid": P}        (kill what is left of the run)   -> {"rc": returncode}
    anything else                                                      -> {"error": "..."}
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import resource
import select
import shutil
import signal
import socket
import sys
import tempfile
import traceback

__all__ = ["LIMIT_FIELDS", "UID_BASE", "kill_run", "serve", "unshare_userns"]

UID_BASE = 1_000_000  # run uid = base + run pid: unique among live runs, never a real user
_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWUSER = 0x00020000, 0x40000000, 0x10000000
_CLONE_NEWIPC = 0x08000000
_MS_RDONLY, _MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG = 1
LIMIT_FIELDS = ("cpu_s", "memory_mb", "max_procs", "file_mb", "disk_mb")  # the start request's
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _bind(src: str, dst: str, writable: bool = False) -> None:
    _check(_libc.mount(src.encode(), dst.encode(), None, _MS_BIND | _MS_REC, None),
           f"bind {src}")
    if not writable:
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_REC
        _check(_libc.mount(None, dst.encode(), None, flags, None), f"remount ro {dst}")


def _system_dirs() -> list[str]:
    """Read-only dirs the interpreter needs: /usr, /lib*, /bin and the Python install."""
    dirs = [d for d in ("/usr", "/lib", "/lib64", "/bin") if os.path.exists(d)]
    prefix = os.path.realpath(sys.base_prefix)
    if not any(prefix == d or prefix.startswith(d + "/") for d in dirs):
        dirs.append(prefix)
    return dirs


def _enter_root(root: str) -> None:
    """Isolate the zygote once: private mounts, no network, chroot into `root` holding only
    read-only system dirs, /dev/null and an empty /work."""
    dirs = _system_dirs()
    for d in dirs:
        if os.path.islink(d):
            os.makedirs(os.path.dirname(root + d), exist_ok=True)
            os.symlink(os.readlink(d), root + d)
        else:
            os.makedirs(root + d, exist_ok=True)
    os.makedirs(root + "/dev", exist_ok=True)
    open(root + "/dev/null", "w").close()
    os.makedirs(root + "/work", exist_ok=True)
    os.chmod(root, 0o755)
    _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET), "unshare")
    _check(_libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    for d in dirs:
        if not os.path.islink(d):
            _bind(d, root + d)
    _bind("/dev/null", root + "/dev/null", writable=True)
    os.chroot(root)
    os.chdir("/")


def unshare_userns() -> bool:
    """Move this process into new user, network and IPC namespaces; False where the kernel
    refuses (unprivileged user namespaces off)."""
    return _libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC) == 0


def kill_run(pid: int, uid: int | None) -> None:
    """Kill the run's process group and, with a run uid, every process of that uid."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is None:
        return
    child = os.fork()
    if child == 0:  # a process that becomes `uid` may signal exactly that uid's processes
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def _become_run(limits: dict[str, int], code_fd: int, out_fd: int, work: str | None) -> str:
    """In the forked run: take the pipe as stdout/stderr, drop every other descriptor, enter
    the run's namespaces, dir and uid, set the rlimits. Returns the program's source."""
    os.setsid()
    with os.fdopen(code_fd, "rb") as f:
        source = f.read().decode("utf-8")
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    mb = 1 << 20
    if work is None:
        _check(_libc.unshare(_CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC), "unshare")
        uid = UID_BASE + os.getpid()
        opts = f"size={limits['disk_mb']}m,mode=0700,uid={uid},gid={uid}".encode()
        _check(_libc.mount(b"tmpfs", b"/work", b"tmpfs", 0, opts), "mount tmpfs")
        os.chdir("/work")
        with open("main.py", "w", encoding="utf-8") as f:
            f.write(source)
        resource.setrlimit(resource.RLIMIT_NPROC, (limits["max_procs"], limits["max_procs"]))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:
        os.chdir(work)
        with open("main.py", "w", encoding="utf-8") as f:
            f.write(source)
        os.environ.update(HOME=work, TMPDIR=work)
        unshare_userns()  # best effort: fails where user namespaces are off
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (limits["memory_mb"] * mb, limits["memory_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mb, limits["file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sys.argv = ["main.py"]
    return source


def _run_child(limits: dict[str, int], code_fd: int, out_fd: int, work: str | None) -> str:
    """`_become_run`, or exit 127 with the reason on the run's output: a run that could not be
    isolated must never fall back into the zygote's loop."""
    try:
        return _become_run(limits, code_fd, out_fd, work)
    except BaseException as e:  # noqa: BLE001 - reported on the run's output
        try:  # fd 2 is the output pipe once `_become_run` got that far, else the zygote's
            os.write(2, f"sandbox set-up failed: {e}\n".encode())
        finally:
            os._exit(127)


def _parse_limits(raw: object) -> dict[str, int]:
    if not isinstance(raw, dict):
        raise TypeError("limits must be an object")
    out = {k: raw.get(k) for k in LIMIT_FIELDS}
    bad = [k for k, v in out.items() if not isinstance(v, int) or isinstance(v, bool) or v <= 0]
    if bad:
        raise ValueError(f"limits {bad} must be positive integers")
    return out  # type: ignore[return-value]


def serve(sock: socket.socket, caller: int, isolated: bool) -> str | None:
    """Answer the caller's requests until it goes away. Returns None in the zygote (then it
    exits) and the program's source in a forked run (which then runs it)."""
    runs: dict[int, tuple[int | None, str | None]] = {}  # pid -> (run uid, private dir)
    try:
        while True:
            if not select.select([sock], [], [], 1.0)[0]:
                if os.getppid() != caller:  # the caller died with the socket still shared
                    return None
                continue
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 2)
            except OSError:
                return None
            if not msg:
                return None
            try:
                req = json.loads(msg)
                op = req.get("op") if isinstance(req, dict) else None
                if op == "start":
                    if len(fds) != 2:
                        raise ValueError("start needs two descriptors (code, output)")
                    limits = _parse_limits(req.get("limits"))
                    work = None if isolated else tempfile.mkdtemp(
                        prefix=f"earl-sandbox-{caller}-")
                    pid = os.fork()
                    if pid == 0:
                        runs.clear()
                        code_fd, out_fd = fds
                        fds = []  # the run owns them now
                        return _run_child(limits, code_fd, out_fd, work)
                    runs[pid] = (UID_BASE + pid if isolated else None, work)
                    reply: dict[str, object] = {"pid": pid}
                elif op == "finish":
                    pid = req.get("pid")
                    if pid not in runs:
                        raise ValueError(f"no run with pid {pid!r}")
                    uid, work = runs.pop(pid)
                    kill_run(pid, uid)
                    reply = {"rc": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}
                    if work is not None:
                        shutil.rmtree(work, ignore_errors=True)
                else:
                    raise ValueError(f"unknown op {op!r}")
            except Exception as e:  # noqa: BLE001 - a bad request costs its reply, not the zygote
                reply = {"error": f"{type(e).__name__}: {e}"}
            finally:
                for fd in fds:
                    if fd >= 0:
                        try:
                            os.close(fd)
                        except OSError:
                            pass
            sock.send(json.dumps(reply).encode())
    finally:
        if runs:  # the zygote leaving: nothing it started outlives it
            for pid, (uid, work) in runs.items():
                kill_run(pid, uid)
                os.waitpid(pid, 0)
                if work is not None:
                    shutil.rmtree(work, ignore_errors=True)


def main() -> str | None:
    args = sys.argv[1:]
    caller = int(args[args.index("--caller") + 1])
    root = args[args.index("--root") + 1] if "--root" in args else None
    sock = socket.socket(fileno=int(args[args.index("--fd") + 1]))
    if root is not None:
        _enter_root(root)
    return serve(sock, caller, isolated=root is not None)


def _exit(rc: int) -> None:
    """End a run as the interpreter would (join its threads, run its atexit handlers, flush),
    minus the ~5 ms of tearing the interpreter down, which leaves nothing a run can see."""
    if "threading" in sys.modules:
        sys.modules["threading"]._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            rc = rc or 120  # as Python reports a failed flush at exit
    os._exit(rc)


def _run(source: str) -> None:
    """Run the program as `python main.py` would; never returns."""
    program = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), program)  # noqa: S102 - the sandboxed program
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            _exit(e.code or 0)
        print(e.code, file=sys.stderr)
        _exit(1)
    except BaseException as e:  # noqa: BLE001 - printed without this frame, as Python would
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__
                                  else None)
        _exit(1)
    _exit(0)


if __name__ == "__main__":
    _source = main()
    if _source is not None:
        _run(_source)
