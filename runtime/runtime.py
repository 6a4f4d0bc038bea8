"""`Runtime`: spawns actor groups, finds them by name, and owns every background task.

The driver's `async with Runtime() as rt:` is the root: it holds the address directory and
serves it on a socket in its run directory. Every actor process runs its own attached `Runtime`
(pointing at the root's directory), available as `earl.runtime.context()`, so actors can look up
and spawn other actors. All background work (request handlers, supervisors, deferred connects)
runs in the runtime's task group; leaving the `async with` stops every group this runtime
spawned and leaves no processes behind.

Over TCP every frame is authenticated (HMAC-SHA256), loopback included: unless
`RuntimeConfig.secret` is set, the root runtime draws a fresh per-run secret and hands it to
every actor it spawns (in the bootstrap spec, never over TCP), along with the references and
path roots the driver registered in `earl.runtime.registry`. The root also removes its run dir
on exit and sweeps what killed runs left behind (`earl.runtime.cleanup`) when it starts and ends.
Under the ray launcher the root serves on its Ray node's address, not loopback (actors on other
nodes dial it), and each actor on its own node's (`earl.runtime.launch_ray`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import re
import shutil
import socket
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self, TypeVar

from earl.runtime import cleanup, registry
from earl.runtime.actor import Actor, ActorGroup, _current
from earl.runtime.config import RestartPolicy, RuntimeConfig
from earl.runtime.conn import Connection, Pool
from earl.runtime.directory import DEAD, UP, Directory, GroupRecord
from earl.runtime.endpoint import endpoints_of
from earl.runtime.errors import ActorDied
from earl.runtime.frames import Kind, log
from earl.runtime.launch import ActorSpec, Launcher, pack_call
from earl.runtime.server import Server
from earl.runtime.slots import Slot, per_rank
from earl.runtime.supervisor import GroupSupervisor
from earl.runtime.transport.auth import set_run_secret
from earl.runtime.wire import encode

A = TypeVar("A", bound=Actor)
T = TypeVar("T")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BROKEN_GRACE_S = 0.5  # a dying process closes its sockets a moment before it is reaped


def make_launcher(name: str, ray_address: str | None = None,
                  actor_log: str | None = None, config: RuntimeConfig | None = None) -> Launcher:
    """The launcher named `name` ("local" or "ray"); Ray is imported only for "ray".
    `actor_log`: the file local actors' stdout and stderr go to (None: this process').
    `config`: where the ray launcher places groups (`ray_resources`, `ray_gpus`)."""
    if name == "local":
        from earl.runtime.launch_local import LocalLauncher

        return LocalLauncher(actor_log)
    if name == "ray":
        from earl.runtime.launch_ray import RayLauncher

        return RayLauncher(address=ray_address,
                           resources=config.ray_resources if config else None,
                           gpus=config.ray_gpus if config else None)
    raise ValueError(f"unknown launcher {name!r}: use 'local' or 'ray'")


@dataclass(frozen=True, slots=True)
class RuntimeStatistics:
    """A snapshot of one runtime (see `Runtime.statistics`)."""

    groups: int  # groups this runtime spawned and supervises
    actors: int  # their live processes
    restarts: int  # restarts performed so far
    connections: int  # open client connections
    pending_calls: int  # calls sent and not answered yet
    background_tasks: int


class Runtime:
    """Spawns and finds actors. Use as `async with Runtime() as rt:`.

    Args:
        config: where and how actors run (default `RuntimeConfig()`: local child processes,
            unix sockets).
        launcher: shortcut for `config.launcher`.
    """

    def __init__(self, config: RuntimeConfig | None = None, *, launcher: str | None = None,
                 _directory: str | None = None) -> None:
        config = config or RuntimeConfig()
        if launcher is not None:
            config.launcher = launcher
            config.__post_init__()
        self.config = config
        self.host = config.host  # what TCP servers bind (under Ray: the driver's node address)
        self.directory_address = _directory
        self.directory: Directory | None = None
        self.secret = config.secret_bytes
        if self.secret is None and config.use_tcp:
            if _directory is not None:
                raise ValueError("an attached runtime over TCP needs the run's secret")
            self.secret = os.urandom(32)  # per run; actors get it in their bootstrap spec
        self.pool = Pool(max_bytes=config.max_message_bytes, secret=self.secret)
        self.pool.on_broken = self._broken
        if self.secret is not None:  # data-plane receivers bound off loopback use it too
            set_run_secret(self.secret)
        self.run_dir = ""
        self._own_run_dir = False
        self._tg: asyncio.TaskGroup | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._groups: dict[str, GroupSupervisor] = {}
        self._launcher: Launcher | None = None
        self._dir_server: Server | None = None
        self._seq = itertools.count()

    # ---- lifetime ----------------------------------------------------------------------
    async def __aenter__(self) -> Self:
        cfg = self.config
        if self.directory_address is None:  # the root: sweep what SIGKILLed runs left
            cleanup.sweep()
        if cfg.run_dir is None:
            self.run_dir = tempfile.mkdtemp(prefix=cleanup.run_dir_prefix(),
                                            dir="/tmp" if os.path.isdir("/tmp") else None)
            self._own_run_dir = True
        else:
            self.run_dir = cfg.run_dir
            os.makedirs(self.run_dir, exist_ok=True)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        if self.directory_address is None:
            if cfg.launcher == "ray":  # actors on other nodes must reach the directory
                self._launcher = self._make_launcher()
                node = getattr(self._launcher, "node_address", self.host)
                self.host = node if self.host in ("127.0.0.1", "localhost", "::1") else self.host
            self.directory = Directory()
            self._dir_server = Server(self.directory, "directory", spawn=self.task,
                                      max_bytes=cfg.max_message_bytes, secret=self.secret)
            self.directory_address = await self._dir_server.start(self._bind("directory"))
        _current.append(self)
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        try:
            await self.shutdown()
        finally:
            if self in _current:
                _current.remove(self)
            assert self._tg is not None
            if et is not None and not issubclass(et, asyncio.CancelledError):
                et = exc = tb = None  # let the body's own exception propagate unwrapped
            await self._tg.__aexit__(et, exc, tb)
            if self._own_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            if self._dir_server is not None:  # the root: its actors are gone now
                cleanup.sweep()

    async def shutdown(self) -> None:
        """Stop every group this runtime spawned, close sockets, cancel background tasks."""
        groups, self._groups = list(self._groups.values()), {}
        await asyncio.gather(*(g.stop() for g in groups))
        if self._launcher is not None:
            await self._launcher.close()
        if self._dir_server is not None:
            self._dir_server.close()
        self.pool.close()
        for task in list(self._tasks):
            task.cancel()

    def task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """Run `coro` in this runtime's task group (cancelled at shutdown)."""
        assert self._tg is not None, "Runtime used outside `async with`"
        t = self._tg.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    def statistics(self) -> RuntimeStatistics:
        sups = list(self._groups.values())
        return RuntimeStatistics(
            groups=len(sups), actors=sum(h is not None for s in sups for h in s.handles),
            restarts=sum(sum(s.restarts) for s in sups), connections=len(self.pool.conns),
            pending_calls=sum(len(c.pending) for c in self.pool.conns.values()),
            background_tasks=len(self._tasks))

    # ---- addresses ---------------------------------------------------------------------
    def _make_launcher(self) -> Launcher:
        return make_launcher(self.config.launcher, self.config.ray_address,
                             self.config.actor_log, self.config)

    async def free_address(self, name: str, n: int, rank: int = 0) -> tuple[str, int]:
        """(address, port free there right now) on the host where rank `rank` of the group
        `name` of `n` ranks will run (spawn it next): a rendezvous point for its ranks, e.g. a
        torch process group's. Under Ray that is the node of the rank's bundle."""
        if self._launcher is None:
            self._launcher = self._make_launcher()
        reserve = getattr(self._launcher, "free_address", None)
        if reserve is not None:
            host, port = await reserve(name, n, rank)
            return str(host), int(port)
        with socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET) as s:
            s.bind((self.host, 0))
            return self.host, int(s.getsockname()[1])

    def _bind(self, name: str, rank: int = 0) -> str:
        if self.config.use_tcp:
            return f"tcp:[{self.host}]:0" if ":" in self.host else f"tcp:{self.host}:0"
        return self.socket_path(name, rank)

    def socket_path(self, name: str, rank: int) -> str:
        path = os.path.join(self.run_dir, f"{name[:40]}-{rank}-{os.getpid()}-{next(self._seq)}.s")
        if len(path) > 100:
            path = os.path.join(self.run_dir, f"{os.getpid()}-{next(self._seq)}.s")
        return "unix:" + path

    # ---- directory ---------------------------------------------------------------------
    async def dir_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call the directory (in-process at the root, over RPC elsewhere)."""
        if self.directory is not None:
            return await getattr(self.directory, method)(*args, **kwargs)
        assert self.directory_address is not None
        conn = await self.pool.get(self.directory_address, "directory")
        body, bufs = encode([method, list(args), kwargs])
        return await conn.request(Kind.CALL, body, bufs)

    async def lookup(self, name: str, *, timeout: float = 0.0) -> ActorGroup[Any]:
        """The group called `name`, waiting up to `timeout` s for it to appear.

        Raises:
            KeyError: no such group.
        """
        rec: GroupRecord | None = await self.dir_call("lookup", name, timeout)
        if rec is None:
            raise KeyError(f"no actor group named {name!r}; known: "
                           f"{', '.join(await self.dir_call('names')) or '(none)'}")
        n = len(rec.addresses)
        return ActorGroup(rec.name, rec.cls_name, dict(rec.endpoints), list(rec.addresses),
                          list(range(n)), n)

    # ---- spawning ----------------------------------------------------------------------
    async def spawn(self, name: str, cls: type[A], *args: Any, n: int = 1,
                    env: dict[str, str] | None = None, restart: RestartPolicy | None = None,
                    slot: Slot | list[Slot] | None = None, **kwargs: Any) -> ActorGroup[A]:
        """Start `n` processes, each running `cls(*args, **kwargs)`, as group `name`.

        Returns once every actor has run `__init__` and `setup` and is serving. `slot`: the
        device slot (one per rank) each process and its children run in (local launcher).

        Raises:
            TypeError: `cls` is not an Actor subclass, or an argument cannot travel.
            ValueError: bad `name`/`n`, or the name is taken.
            ActorError: an actor's `__init__` or `setup` raised (remote traceback attached).
        """
        if not (isinstance(cls, type) and issubclass(cls, Actor)):
            raise TypeError(f"spawn needs an Actor subclass, got {cls!r}")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"actor group name must match {_NAME.pattern}, got {name!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n (number of actors) must be an int >= 1, got {n!r}")
        if "<locals>" in cls.__qualname__:
            raise ValueError(f"actor class {cls.__qualname__} is defined inside a function: "
                             "define it at module top level so the actor process can import it")
        old: GroupRecord | None = await self.dir_call("lookup", name)
        if old is not None and any(s != DEAD for s in old.status):
            raise ValueError(f"an actor group named {name!r} already exists: stop it or pick "
                             "another name")
        slots = per_rank(slot, n)
        if slot is not None and self.config.launcher != "local":
            raise ValueError("slot= needs the local launcher (a slot is a cgroup on this host)")
        call = pack_call(args, kwargs)  # fails here, not in the child, if an argument can't travel
        if self._launcher is None:
            self._launcher = self._make_launcher()
        main_file = None
        if cls.__module__ in ("__main__", "__mp_main__"):
            main_file = getattr(sys.modules["__main__"], "__file__", None)
        cfg = self.config
        specs = [ActorSpec(
            name=name, rank=r, world_size=n, cls_module=cls.__module__,
            cls_qualname=cls.__qualname__, main_file=main_file, call=call,
            bind=self._bind(name, r), directory=self.directory_address or "",
            run_dir=self.run_dir, host=self.host, tcp=cfg.use_tcp, secret=self.secret,
            max_message_bytes=cfg.max_message_bytes, sys_path=list(sys.path), slot=slots[r],
            refs=registry.registered(), roots=registry.allowed_roots())
            for r in range(n)]
        sup = GroupSupervisor(self, self._launcher, specs, env, restart or RestartPolicy())
        self._groups[name] = sup
        try:
            await sup.start()
        except BaseException:
            self._groups.pop(name, None)
            raise
        eps = {k: v.is_stream for k, v in endpoints_of(cls).items()}
        handles = sup.handles
        rec = GroupRecord(name=name, cls_name=cls.__qualname__, endpoints=eps,
                          addresses=[h.address for h in handles if h is not None],
                          pids=[h.pid for h in handles if h is not None],
                          status=[UP] * n, restarts=[0] * n)
        await self.dir_call("publish", rec)
        group: ActorGroup[A] = ActorGroup(name, cls.__qualname__, eps, list(rec.addresses),
                                          list(range(n)), n)
        conns = await asyncio.gather(*(self.pool.get(a, group.label(i))
                                       for i, a in enumerate(group.addresses)))
        group._conns[:] = conns
        return group

    async def resize(self, group: ActorGroup[A], n: int, *,
                     slot: Slot | list[Slot] | None = None) -> ActorGroup[A]:
        """`group` with `n` ranks: ranks below `n` go on as they are (their processes,
        state and connections), ranks from `n` on are stopped, and new ranks start from the
        group's current spec (`restart_with` included) in `slot` (one per new rank). For
        groups whose ranks are independent replicas (rollout engines, reward servers): a rank's
        `world_size` is the group's size when it started, and nothing re-forms a collective.

        Returns the new handle (same name); the old handle's kept ranks stay usable.

        Raises:
            KeyError: this runtime did not spawn a live group of that name.
            ValueError: `n` < 1, or `slot` does not give one slot per new rank.
        """
        sup = self._groups.get(group.name)
        if sup is None:
            raise KeyError(f"this runtime did not spawn a live group named {group.name!r}")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n (number of actors) must be an int >= 1, got {n!r}")
        old = len(sup.specs)
        if n > old:
            slots = per_rank(slot, n - old)
            await sup.grow([dataclasses.replace(sup.specs[0], rank=r, world_size=n,
                                                bind=self._bind(group.name, r),
                                                slot=slots[r - old])
                            for r in range(old, n)])
        elif n < old:
            if slot is not None:
                raise ValueError(f"resize {group.name!r} {old} -> {n} starts no rank: slot= "
                                 "must be None")
            await sup.shrink(n)
        new = sup.handles[min(n, old):]
        await self.dir_call("resize", group.name, n, [h.address for h in new if h is not None],
                            [h.pid for h in new if h is not None])
        out: ActorGroup[A] = ActorGroup(group.name, group.cls_name, group.endpoints,
                                        [*group.addresses[:min(n, old)],
                                         *(h.address for h in new if h is not None)],
                                        list(range(n)), n)
        out._conns[:min(n, old)] = group._conns[:min(n, old)]
        conns = await asyncio.gather(*(self.pool.get(out.addresses[i], out.label(i))
                                       for i in range(min(n, old), n)))
        out._conns[min(n, old):] = conns
        return out

    def keep_warm(self, cls: type[Actor], n: int = 1) -> bool:
        """Keep `n` processes for `cls` started ahead, with its module and `cls.preload`
        imported, so the next `spawn` of `cls` skips the interpreter start and the imports (a
        re-layout's new vLLM replica or trainer rank). n=0 stops keeping them. Local launcher
        only; returns whether the launcher keeps them."""
        if self._launcher is None:
            self._launcher = self._make_launcher()
        keep = getattr(self._launcher, "keep_warm", None)
        if keep is None:
            return False
        keep(f"{cls.__module__}:{cls.__qualname__}", n, (cls.__module__, *cls.preload))
        return True

    def restart_with(self, group: ActorGroup[Any] | str, *args: Any, **kwargs: Any) -> None:
        """From now on, a restarted rank of `group` starts with these constructor arguments
        (for an actor that rebuilt itself in place, e.g. a rollout replica now serving another
        config: its restart must not bring back the old one)."""
        name = group if isinstance(group, str) else group.name
        sup = self._groups.get(name)
        if sup is None:
            raise KeyError(f"this runtime did not spawn a live group named {name!r}")
        call = pack_call(args, kwargs)
        sup.specs = [dataclasses.replace(s, call=call) for s in sup.specs]

    async def stop(self, group: ActorGroup[Any] | str) -> None:
        """Stop a group this runtime spawned and remove it from the directory."""
        name = group if isinstance(group, str) else group.name
        sup = self._groups.pop(name, None)
        if sup is None:
            raise KeyError(f"this runtime did not spawn a live group named {name!r}")
        await sup.stop()
        await self.dir_call("remove", name)

    def _broken(self, address: str) -> None:
        """The connection to `address` was lost with calls in flight. If that is one of this
        runtime's actors and its process still runs a moment later (a real death closes the
        line first and is reported by the supervisor), the replies it owes are gone: it is
        killed and restarted like any dead actor, never silently reconnected to."""
        owner = next(((name, rank, h.pid) for name, sup in self._groups.items()
                      for rank, h in enumerate(sup.handles)
                      if h is not None and h.address == address), None)
        if owner is not None:
            asyncio.get_running_loop().call_later(BROKEN_GRACE_S, self._kill_broken, *owner)

    def _kill_broken(self, name: str, rank: int, pid: int) -> None:
        if name in self._groups and self.kill(name, rank, pid):
            log.warning("lost the connection to %s[%d] with calls in flight; killed pid %s, it "
                        "restarts under its policy", name, rank, pid)

    def kill(self, name: str, rank: int, pid: int) -> bool:
        """SIGKILL `name[rank]` if it is still process `pid`: a process the caller can no
        longer trust (e.g. its connection was lost with calls in flight) is treated as dead,
        and restarted under its group's policy like any other death.

        Returns:
            False when that process is already gone or was replaced (nothing to do).

        Raises:
            KeyError: this runtime did not spawn a live group named `name`.
        """
        sup = self._groups.get(name)
        if sup is None:
            raise KeyError(f"this runtime did not spawn a live group named {name!r}")
        return sup.kill(rank, pid)

    async def wait_status(self, group: ActorGroup[Any] | str, status: str = UP, *,
                          min_restarts: int = 0, timeout: float = 60.0) -> None:
        """Wait until every rank of `group` (a name: all ranks; a handle: its ranks) is in
        `status` ("up", "restarting" or "dead") after at least `min_restarts` restarts.

        Use after a failure to wait for the restart instead of polling:
        `await rt.wait_status(g[0], "up", min_restarts=1)`.

        Raises:
            KeyError: no such group.
            TimeoutError: not reached within `timeout` seconds.
        """
        name = group if isinstance(group, str) else group.name
        rec: GroupRecord | None = await self.dir_call("lookup", name)
        if rec is None:
            raise KeyError(f"no actor group named {name!r}")
        ranks = range(len(rec.status)) if isinstance(group, str) else group.ranks
        for rank in ranks:
            if not await self.dir_call("wait_status", name, rank, status, timeout,
                                       min_restarts):
                raise TimeoutError(f"{name}[{rank}] not {status!r} after {min_restarts} "
                                   f"restart(s) within {timeout}s")

    # ---- request plumbing for handles --------------------------------------------------
    async def resolve(self, g: ActorGroup[Any], i: int) -> Connection:
        """A live connection to member `i` of `g`, following restarts via the directory.

        Raises:
            ActorDied: the actor is dead or restarting.
        """
        addr = g.addresses[i]
        conn = self.pool.get_nowait(addr)
        if conn is None and addr in self.pool.dead:
            rec: GroupRecord | None = await self.dir_call("lookup", g.name)
            rank = g.ranks[i]
            if rec is None or rank >= len(rec.status):
                raise ActorDied(g.label(i), f"group {g.name!r} no longer exists")
            if rec.status[rank] != UP:
                raise ActorDied(g.label(i), rec.reasons[rank] or rec.status[rank])
            if rec.addresses[rank] == addr:
                self.pool.dead.pop(addr, None)  # same process, lost connection: retry once
            g.addresses[i] = addr = rec.addresses[rank]
        if conn is None:
            conn = await self.pool.get(addr, g.label(i))
        g._conns[i] = conn
        return conn

    def send_later(self, g: ActorGroup[Any], i: int, kind: int, body: bytes,
                   bufs: list[Any]) -> asyncio.Future[Any]:
        """Connect to member `i` first (not connected yet, or restarted), then send."""
        outer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

        async def run() -> None:
            try:
                conn = await self.resolve(g, i)
                result = await conn.request(kind, body, bufs)
            except asyncio.CancelledError:
                if not outer.done():
                    outer.set_exception(ActorDied(g.label(i), "runtime shut down"))
                raise
            except Exception as e:  # noqa: BLE001
                if not outer.done():
                    outer.set_exception(e)
                return
            if not outer.done():
                outer.set_result(result)

        self.task(run())
        return outer
