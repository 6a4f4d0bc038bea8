"""The sandbox's fork server ("zygote"): one small interpreter per caller forks every run.

`earl.runtime.sandbox` starts this file as a script (`python -I -S sandbox_zygote.py`, stdlib
only, nothing of EARL imported but its `sandbox_*` siblings) once per calling process and
isolation mode, and talks to it over a private `AF_UNIX` socket pair. Starting a run is then a
fork of this small process plus the run's own namespaces, instead of a fork of the caller (which
may map gigabytes) and a fresh interpreter (~7 ms of CPU before the first line of user code).

With root (`--root DIR`), the zygote first isolates itself once: it opens its pool of memory
cgroups (`sandbox_memory.py`), enters its own mount and network namespaces, bind-mounts the
interpreter and system libraries under DIR read-only, nosuid and nodev, chroots into DIR and
starts its reaper (`sandbox_reaper.py`). Each run then forks from there and adds what is per
run: a memory cgroup of its own, new mount, network and IPC namespaces, a size-capped nosuid
tmpfs at /work owned by a fresh uid (`UID_BASE + pid`) that it switches to, rlimits, a
parent-death signal, and last `no_new_privs` and a seccomp filter (`sandbox_seccomp.py`).
Without root each run gets a user+network+IPC namespace where the kernel allows one, a private
temp dir, `no_new_privs` and the seccomp filter, as in `sandbox.py`'s docstring.

With root nothing of a run outlives the zygote: the zygote kills every run by its uid when the
caller closes the socket or dies; when the zygote itself is killed its runs' first processes get
SIGKILL (parent-death signal) and its reaper kills all else of theirs by uid, whether or not the
caller is still alive. (Without root only a run's process group is killed: a descendant that
calls setsid escapes.) A run whose processes together reach its memory limit is killed as a
whole by the zygote, which the cgroup's OOM eventfd wakes.

The program's source never passes through the zygote: the caller hands over a memfd holding it
and the write end of the output pipe (`SCM_RIGHTS`); the zygote forks, and only the run reads
them. A run holds no descriptor but stdin (/dev/null) and the output pipe, and no memory of the
caller.

Protocol, one JSON message per `SOCK_SEQPACKET` packet, one reply each:
    {"op": "start", "limits": {...}}  + fds [code memfd, output pipe]
        -> {"pid": P, "features": "+seccomp+memcg"}  (what the run gets beyond its namespaces)
    {"op": "finish", "pid": P}        (kill what is left of the run)
        -> {"rc": returncode, "oom": bool, "peak_mb": float or null}
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

if __package__:  # imported by the caller's side
    from earl.runtime import sandbox_memory, sandbox_namespaces, sandbox_reaper, sandbox_seccomp
else:  # the fork server's script, EARL not on its path: its siblings from its own dir
    sys.path.append(os.path.dirname(os.path.abspath(__file__)))
    import sandbox_memory  # type: ignore[no-redef]
    import sandbox_namespaces  # type: ignore[no-redef]
    import sandbox_reaper  # type: ignore[no-redef]
    import sandbox_seccomp  # type: ignore[no-redef]
    sys.path.pop()

__all__ = ["LIMIT_FIELDS", "UID_BASE", "kill_run", "serve"]

UID_BASE = 1_000_000  # run uid = base + run pid: unique among live runs, never a real user
_PR_SET_PDEATHSIG = 1
LIMIT_FIELDS = ("cpu_s", "memory_mb", "max_procs", "file_mb", "disk_mb")  # the start request's
_libc = ctypes.CDLL(None, use_errno=True)


def kill_run(pid: int, uid: int | None) -> None:
    """Kill the run's process group and, with a run uid, every process of that uid."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if uid is not None:
        sandbox_reaper.kill_uid(uid)


class _Setup:
    """What every run of this zygote shares: its cgroup pool, its reaper's pipe, its filter."""

    def __init__(self, isolated: bool, pool: sandbox_memory.Pool | None, reaper_fd: int | None,
                 flt: sandbox_seccomp.Filter | None, tmp: str | None = None) -> None:
        self.isolated, self.pool, self.reaper_fd, self.filter = isolated, pool, reaper_fd, flt
        self.tmp = tmp  # the caller's temp dir: where its sweep finds a run dir left behind
        self.zygote = os.getpid()
        self.features = "+seccomp" * (flt is not None) + "+memcg" * (pool is not None)


def _become_run(setup: _Setup, limits: dict[str, int], code_fd: int, out_fd: int,
                work: str | None, group: sandbox_memory.Group | None) -> str:
    """In the forked run: take the pipe as stdout/stderr, register with the reaper, join the
    cgroup, drop every other descriptor, enter the run's namespaces, dir and uid, set the
    rlimits, the parent-death signal and the filter. Returns the program's source."""
    os.setsid()
    with os.fdopen(code_fd, "rb") as f:
        source = f.read().decode("utf-8")
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    uid = UID_BASE + os.getpid()
    if setup.reaper_fd is not None:
        sandbox_reaper.register(setup.reaper_fd, uid)
    if group is not None:
        assert setup.pool is not None
        setup.pool.join(group)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    mb = 1 << 20
    as_mb, nproc = sandbox_memory.split(limits["memory_mb"], limits["max_procs"],
                                        whole_run=group is not None, capped=work is None)
    if work is None:
        sandbox_namespaces.enter_run(uid, limits["disk_mb"])
        with open("main.py", "w", encoding="utf-8") as f:
            f.write(source)
        assert nproc is not None
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    else:
        os.chdir(work)
        with open("main.py", "w", encoding="utf-8") as f:
            f.write(source)
        os.environ.update(HOME=work, TMPDIR=work)
        sandbox_namespaces.unshare_userns()  # best effort: fails where user namespaces are off
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
    if os.getppid() != setup.zygote:  # the zygote died before the signal was armed
        os._exit(127)
    resource.setrlimit(resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (as_mb * mb, as_mb * mb))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["file_mb"] * mb, limits["file_mb"] * mb))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sandbox_seccomp.install(setup.filter)  # last: the set-up above needs what it denies
    sys.argv = ["main.py"]
    return source


def _run_child(setup: _Setup, limits: dict[str, int], code_fd: int, out_fd: int,
               work: str | None, group: sandbox_memory.Group | None) -> str:
    """`_become_run`, or exit 127 with the reason on the run's output: a run that could not be
    isolated must never fall back into the zygote's loop."""
    try:
        return _become_run(setup, limits, code_fd, out_fd, work, group)
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


class _Run:
    """The zygote's record of one live run."""

    __slots__ = ("group", "oom", "uid", "work")

    def __init__(self, uid: int | None, work: str | None,
                 group: sandbox_memory.Group | None) -> None:
        self.uid, self.work, self.group, self.oom = uid, work, group, False


def _end_run(setup: _Setup, pid: int, run: _Run) -> dict[str, object]:
    """Kill what is left of run `pid`, reap it, hand its cgroup back; the finish reply."""
    os.kill(pid, signal.SIGKILL)  # even if it has not made its own process group yet
    kill_run(pid, None)
    rc = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    pool, group = setup.pool, run.group
    # Every process of the run is in its cgroup: an empty one spares the kill by uid (a fork).
    if run.uid is not None and (pool is None or group is None or not pool.empty(group)):
        sandbox_reaper.kill_uid(run.uid)
    peak = None
    if pool is not None and group is not None:
        peak = round(pool.peak_mb(group), 1)
        pool.release(group)
    if run.work is not None:
        shutil.rmtree(run.work, ignore_errors=True)
    if setup.reaper_fd is not None and run.uid is not None:
        sandbox_reaper.unregister(setup.reaper_fd, run.uid)  # after the reap: in pipe order
    return {"rc": rc, "oom": run.oom, "peak_mb": peak}


def serve(sock: socket.socket, caller: int, setup: _Setup) -> str | None:
    """Answer the caller's requests until it goes away. Returns None in the zygote (then it
    exits) and the program's source in a forked run (which then runs it)."""
    runs: dict[int, _Run] = {}
    try:
        while True:
            oom_fds = {r.group.oom_fd: pid for pid, r in runs.items() if r.group is not None}
            ready = select.select([sock, *oom_fds], [], [], 1.0)[0]
            if not ready and os.getppid() != caller:  # the caller died, the socket shared
                return None
            for fd in ready:
                if fd in oom_fds:  # its processes together hit the limit: kill them all
                    os.eventfd_read(fd)
                    runs[oom_fds[fd]].oom = True
                    kill_run(oom_fds[fd], runs[oom_fds[fd]].uid)
            if sock not in ready:
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
                    work = None if setup.isolated else tempfile.mkdtemp(
                        prefix=f"earl-sandbox-{caller}-", dir=setup.tmp)
                    group = setup.pool.acquire(limits["memory_mb"]) if setup.pool else None
                    try:
                        pid = os.fork()
                    except OSError:
                        if setup.pool is not None and group is not None:
                            setup.pool.release(group)
                        raise
                    if pid == 0:
                        runs.clear()
                        code_fd, out_fd = fds
                        fds = []  # the run owns them now
                        return _run_child(setup, limits, code_fd, out_fd, work, group)
                    runs[pid] = _Run(UID_BASE + pid if setup.isolated else None, work, group)
                    reply: dict[str, object] = {"pid": pid, "features": setup.features}
                elif op == "finish":
                    pid = req.get("pid")
                    if pid not in runs:
                        raise ValueError(f"no run with pid {pid!r}")
                    reply = _end_run(setup, pid, runs.pop(pid))
                else:
                    raise ValueError(f"unknown op {op!r}")
            except BrokenPipeError:  # the reaper is gone: runs can no longer be made to die
                return None  # with us, so we exit and the caller starts a fresh zygote
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
        if os.getpid() == setup.zygote:  # the zygote leaving: nothing it started outlives it
            for pid, run in runs.items():
                try:
                    _end_run(setup, pid, run)
                except BrokenPipeError:  # killed and reaped; only the reaper missed the news
                    pass
            if setup.pool is not None:
                setup.pool.close()


def main() -> str | None:
    args = sys.argv[1:]
    caller = int(args[args.index("--caller") + 1])
    root = args[args.index("--root") + 1] if "--root" in args else None
    tmp = args[args.index("--tmp") + 1] if "--tmp" in args else None
    sock = socket.socket(fileno=int(args[args.index("--fd") + 1]))
    flt, why = sandbox_seccomp.build()
    if flt is None:
        print(f"earl sandbox: {why}; runs get no_new_privs only", file=sys.stderr)
    pool, reaper_fd = None, None
    if root is not None:
        pool, why = sandbox_memory.Pool.open()  # before the chroot hides /sys and /proc
        if pool is None:
            print(f"earl sandbox: {why}; memory_mb is split between a run's processes",
                  file=sys.stderr)
        try:
            sandbox_namespaces.enter_root(root)
            reaper_fd = (sandbox_reaper.start([pool.dir_fd], pool.remove_groups) if pool
                         else sandbox_reaper.start([], None))
        except BaseException:
            if pool is not None:
                pool.close()  # the caller's cgroup keeps no group of ours
            raise
    return serve(sock, caller, _Setup(root is not None, pool, reaper_fd, flt, tmp))


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
