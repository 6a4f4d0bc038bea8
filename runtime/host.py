"""Entry point of an actor process: `python -m earl.runtime.host FD PARENT_PID [MODULES]`.

With MODULES (comma-separated) it is a *warm* host: it imports them first, at idle CPU priority,
and only then waits for a spec, so the actor it becomes later skips those imports (vLLM's alone
is ~8 s); its spec's `env` (the slot's and the caller's variables) is applied when it arrives.
Reads its `ActorSpec` from the bootstrap socket FD, arms parent-death protection
(PR_SET_PDEATHSIG=SIGKILL, plus EOF on FD), builds the actor inside a uvloop event loop with its
own `Runtime` (so the actor can `context().lookup()` and `spawn()`), serves its endpoints, says
READY, and exits when FD closes or on SIGTERM. Started with `PYTHONTRACEMALLOC` set, it writes
a tracemalloc snapshot to `/tmp/earl-tracemalloc-<pid>-<n>.snap` on each SIGUSR2 (a leak hunt:
compare two with `tracemalloc.Snapshot.load(a).compare_to(...)`). If `__init__` or `setup` raises, the traceback
goes back to the spawner as FAILED. Not imported by anything else.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import sys
import traceback
import types
from typing import Any

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the bootstrap socket's EOF still stops us
    if parent_pid and os.getppid() != parent_pid:
        os._exit(3)  # the parent died before prctl took effect


def _load_class(module: str, qualname: str, main_file: str | None) -> type:
    if module == "__main__":
        if main_file is None:
            raise ValueError("actor class defined in an interactive __main__ cannot be started:"
                             " move it into a module")
        import runpy

        mod = types.ModuleType("__mp_main__")
        mod.__dict__.update(runpy.run_path(main_file, run_name="__mp_main__"))
        sys.modules["__mp_main__"] = sys.modules["__main__"] = mod
        obj: Any = mod
    else:
        obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _preload(modules: list[str]) -> None:
    """Import `modules` at idle priority (SCHED_IDLE: the run's actors keep the cores), then
    return every thread to normal priority. A module that fails to import is left to fail
    again, with its traceback, when the actor needs it."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    from earl.runtime.cgroups import normal_priority

    normal_priority(os.getpid())


def _apply_env(env: dict[str, str]) -> None:
    """The spec's environment, for a host started before its slot was known: variables that
    libraries read at import time are re-applied where they allow it (torch's thread count)."""
    os.environ.update(env)
    torch = sys.modules.get("torch")
    if torch is not None and env.get("OMP_NUM_THREADS", "").isdigit():
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _send(sock: socket.socket, msg: Any) -> None:
    from earl.runtime.launch import pack_msg

    sock.setblocking(True)
    sock.sendall(pack_msg(msg))
    sock.setblocking(False)


def _snapshots_on_sigusr2(loop: asyncio.AbstractEventLoop) -> None:
    """With tracemalloc tracing (`PYTHONTRACEMALLOC`), SIGUSR2 dumps a snapshot."""
    import itertools
    import tracemalloc

    if not tracemalloc.is_tracing():
        return
    count = itertools.count(1)

    def dump() -> None:
        tracemalloc.take_snapshot().dump(f"/tmp/earl-tracemalloc-{os.getpid()}-{next(count)}.snap")

    loop.add_signal_handler(signal.SIGUSR2, dump)


async def _serve(spec: Any, sock: socket.socket) -> int:
    from earl.runtime import registry
    from earl.runtime.actor import Actor
    from earl.runtime.config import RuntimeConfig
    from earl.runtime.launch import unpack_msg
    from earl.runtime.runtime import Runtime
    from earl.runtime.server import Server

    registry.install(spec.refs, spec.roots)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    _snapshots_on_sigusr2(loop)
    config = RuntimeConfig(host=spec.host, tcp=spec.tcp, secret=spec.secret,
                           max_message_bytes=spec.max_message_bytes, run_dir=spec.run_dir)
    label = f"{spec.name}[{spec.rank}]"
    async with Runtime(config, _directory=spec.directory) as rt:
        try:
            cls = _load_class(spec.cls_module, spec.cls_qualname, spec.main_file)
            if not (isinstance(cls, type) and issubclass(cls, Actor)):
                raise TypeError(f"{spec.cls_qualname} is not an Actor subclass")
            actor: Actor = cls.__new__(cls)  # type: ignore[call-overload]
            actor.name, actor.rank, actor.world_size = spec.name, spec.rank, spec.world_size
            args, kwargs = unpack_msg(spec.call)
            actor.__init__(*args, **kwargs)
            await actor.setup()
            server = Server(actor, label, spawn=rt.task, max_bytes=spec.max_message_bytes,
                            secret=spec.secret)
            address = await server.start(spec.bind)
        except Exception as e:  # noqa: BLE001
            _send(sock, ["failed", f"{type(e).__module__}.{type(e).__qualname__}", str(e),
                         "".join(traceback.format_exception(e))])
            return 1
        _send(sock, ["ready", address, os.getpid()])
        eof: asyncio.Future[None] = loop.create_future()

        def on_readable() -> None:  # EOF (or stray bytes) on the liveness line: stop
            if not eof.done():
                eof.set_result(None)

        loop.add_reader(sock.fileno(), on_readable)
        stopped = rt.task(stop.wait())
        await asyncio.wait([eof, stopped], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        loop.remove_reader(sock.fileno())
        server.close()
        if spec.bind.startswith("unix:"):
            try:
                os.unlink(spec.bind[5:])
            except OSError:
                pass
    return 0


def _name_process(name: str) -> None:
    """Shows the actor in `ps -o comm`/`top` (Linux keeps 15 bytes) instead of "python"."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:  # not Linux, or /proc is read-only: cosmetic only
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fd, parent_pid = int(argv[0]), int(argv[1]) if len(argv) > 1 else 0
    _die_with_parent(parent_pid)
    if len(argv) > 2 and argv[2]:
        _preload(argv[2].split(","))
    # Ctrl-C in a terminal reaches the whole process group: the driver decides, not us (we stop
    # when it closes our liveness line or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s "
                        f"[pid {os.getpid()}] %(message)s")
    sock = socket.socket(fileno=fd)
    from earl.runtime.launch import recv_msg_blocking

    try:
        spec = recv_msg_blocking(sock)
    except EOFError:
        return 2
    _apply_env(spec.env)
    sys.path[:] = spec.sys_path + [p for p in sys.path if p not in spec.sys_path]
    _name_process(f"{spec.name}{spec.rank}")
    import uvloop

    async def serve_then_exit() -> int:
        code = 1
        try:
            code = await _serve(spec, sock)
        except BaseException:  # noqa: BLE001 - report it, then leave like any other exit
            traceback.print_exc()
        finally:
            _exit_now(code)
        return code  # pragma: no cover - _exit_now does not return

    return uvloop.run(serve_then_exit())


def _exit_now(code: int) -> None:
    """Leave without the interpreter's slow teardown: joining worker threads (a transport
    thread blocked on a socket read would hold the process until the supervisor's SIGKILL)
    and finalizing torch/vLLM modules took 1-5 s per actor. Everything the actor owns is
    closed by now; atexit handlers (cleanup of shm segments, run dirs) still run, but without
    garbage collection: vLLM's engine finalizer collects twice (0.8 s of CPU on the tiny model,
    1.8 s on a half-core device, most of a dropped replica's stop), freeing memory that
    `os._exit` hands back to the kernel anyway."""
    import atexit
    import gc

    gc.disable()
    gc.collect = lambda generation=2: 0  # type: ignore[assignment]  # nothing left to free
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
