"""The "local" launcher: each actor is a child process of this one, on this host.

Death is seen through a pidfd (Linux) the moment the process exits, so supervisors react within
milliseconds; the bootstrap socket is the child's parent-death line (plus PR_SET_PDEATHSIG set
by the host), so children never outlive this process, even when it is SIGKILLed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys

from earl.runtime.cgroups import normal_priority
from earl.runtime.errors import ActorDied, ActorError
from earl.runtime.launch import ActorSpec, pack_msg, recv_msg
from earl.runtime.slots import SlotBinding, bind_process


def exit_reason(returncode: int | None) -> str:
    if returncode is None:
        return "process stopped answering"
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with code {returncode}"


class LocalProcess:
    """A child actor process started by `LocalLauncher`."""

    def __init__(self, proc: subprocess.Popen[bytes], sock: socket.socket, label: str) -> None:
        self.proc = proc
        self.sock = sock
        self.label = label
        self.pid = proc.pid
        self.address = ""
        self._exited: asyncio.Future[str] | None = None
        self.binding: SlotBinding | None = None

    async def handshake(self, spec: ActorSpec) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, pack_msg(spec))
        try:
            reply = await recv_msg(self.sock)
        except EOFError:
            rc = await asyncio.to_thread(self.proc.wait)
            raise ActorDied(self.label, f"process {self._reason(rc)} before it was ready") from None
        if reply[0] == "ready":
            self.address = reply[1]
            return
        typ, msg, tb = reply[1:]
        raise ActorError(self.label, typ, f"actor failed to start: {msg}", tb)

    def _reason(self, rc: int) -> str:
        oom = self.binding.exit_reason(rc) if self.binding else None
        return oom or exit_reason(rc)

    def _watch(self) -> asyncio.Future[str]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[str] = loop.create_future()
        if self.proc.poll() is not None:  # already exited and reaped (e.g. by `kill`)
            fut.set_result(self._reason(self.proc.returncode))
            return fut
        try:
            fd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):  # no pidfd: the liveness socket, or a thread
            fd = -1
        watched = fd if fd >= 0 else self.sock.fileno()
        if watched < 0:  # no pidfd and the socket is already closed: wait in a thread
            def reaped(w: asyncio.Future[int]) -> None:
                if not fut.done():
                    fut.set_result(self._reason(w.result()))

            loop.run_in_executor(None, self.proc.wait).add_done_callback(reaped)
            return fut

        def done(*_: object) -> None:
            loop.remove_reader(watched)
            if fd >= 0:
                os.close(fd)
            if not fut.done():
                fut.set_result(self._reason(self.proc.wait()))

        loop.add_reader(watched, done)
        return fut

    async def wait_exit(self) -> str:
        if self._exited is None:
            self._exited = self._watch()
        return await asyncio.shield(self._exited)

    def stop(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


class LocalLauncher:
    """Starts actor processes as children of this process; their output goes to `log` (a
    file, appended to) when given.

    `keep_warm(cls, n, preload)` keeps `n` hosts of an actor class started ahead, their heavy
    imports done: the next `launch` of that class takes one (into its slot, with the spec's
    environment) and a replacement starts in the background. A re-layout that starts a vLLM
    replica or a trainer rank then skips the interpreter start and the imports.
    """

    def __init__(self, log: str | None = None) -> None:
        self.log = log
        self._warm: dict[str, list[tuple[subprocess.Popen[bytes], socket.socket]]] = {}
        self._want: dict[str, tuple[int, tuple[str, ...]]] = {}

    def keep_warm(self, key: str, n: int, preload: tuple[str, ...]) -> None:
        """Keep `n` hosts for actor class `key` ("module:qualname") with `preload` imported."""
        self._want[key] = (n, preload)
        pool = self._warm.setdefault(key, [])
        while len(pool) < n:
            pool.append(self._start(preload, dict(os.environ)))
        while len(pool) > n:
            proc, sock = pool.pop()
            sock.close()
            proc.kill()
            proc.wait(5)  # SIGKILL: gone in milliseconds

    def warm(self, key: str) -> list[int]:
        """The pids of the hosts kept for `key` right now."""
        return [proc.pid for proc, _ in self._warm.get(key, [])]

    def _start(self, preload: tuple[str, ...], env: dict[str, str]
               ) -> tuple[subprocess.Popen[bytes], socket.socket]:
        parent, child = socket.socketpair()
        out = open(self.log, "ab") if self.log else None  # noqa: SIM115 - the child's
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "earl.runtime.host", str(child.fileno()), str(os.getpid()),
                 ",".join(preload)],
                pass_fds=(child.fileno(),), env=env, stdin=subprocess.DEVNULL,
                stdout=out, stderr=out)
        finally:
            child.close()
            if out is not None:
                out.close()  # the child holds its own copy
        parent.setblocking(False)
        return proc, parent

    def _take(self, key: str) -> tuple[subprocess.Popen[bytes], socket.socket] | None:
        pool = self._warm.get(key, [])
        while pool:
            proc, sock = pool.pop(0)
            if proc.poll() is None:
                if len(pool) < self._want[key][0]:
                    pool.append(self._start(self._want[key][1], dict(os.environ)))  # refill
                normal_priority(proc.pid)  # it may still be importing, at idle priority
                return proc, sock
            sock.close()
        return None

    async def launch(self, spec: ActorSpec, env: dict[str, str] | None) -> LocalProcess:
        extra = {**spec.env, **(spec.slot.env() if spec.slot else {}), **(env or {})}
        spec = dataclasses.replace(spec, env=extra)  # a warm host applies it on arrival
        started = self._take(f"{spec.cls_module}:{spec.cls_qualname}")
        proc, parent = started or self._start((), {**os.environ, **extra})
        carried = _anon_mib(proc.pid) if started else 0.0
        handle = LocalProcess(proc, parent, f"{spec.name}[{spec.rank}]")
        try:
            if spec.slot is not None:  # before the spec is sent: the actor has loaded nothing
                handle.binding = bind_process(spec.slot, proc.pid, carried)
            await handle.handshake(spec)
        except BaseException:
            handle.kill()
            handle.stop()
            await asyncio.shield(handle.wait_exit())  # reaped before we report the failure
            raise
        return handle

    async def close(self) -> None:
        for pool in self._warm.values():
            for proc, sock in pool:
                sock.close()  # EOF: the host stops waiting for a spec
                proc.kill()
                await asyncio.to_thread(proc.wait)
        self._warm.clear()


def _anon_mib(pid: int) -> float:
    """The process's anonymous memory (what its imports charged to this cgroup), MiB."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0
