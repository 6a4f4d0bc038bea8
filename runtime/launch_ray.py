"""The "ray" launcher: Ray only places and keeps processes; earl does all the talking.

Each actor group gets a Ray placement group with one bundle per rank; in each bundle a small
Ray actor (`_Keeper`) starts the real actor process (`python -m earl.runtime.host`), relays the
bootstrap handshake, and reports when the process exits. So a job can span Ray nodes, while every
call goes over earl's own sockets (TCP, every frame HMAC'd with the run's secret, which reaches
the process in its bootstrap spec through Ray's own channel), never through Ray. The actor
process dies with its keeper (PR_SET_PDEATHSIG), and keepers die with the driver (Ray owns them).

Ray is imported only when this launcher is used.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from typing import Any

from earl.runtime.errors import ActorDied, ActorError
from earl.runtime.launch import ActorSpec, pack_msg, recv_msg_blocking
from earl.runtime.launch_local import exit_reason


class _Keeper:
    """Runs on a Ray worker: owns one actor process (created with max_concurrency > 1)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None

    def start(self, spec_msg: bytes, env: dict[str, str]) -> list[Any]:
        parent, child = socket.socketpair()
        full_env = dict(os.environ)
        full_env.update(env)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "earl.runtime.host", str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),), env=full_env, stdin=subprocess.DEVNULL)
        child.close()
        self.sock = parent
        parent.sendall(spec_msg)
        try:
            reply = recv_msg_blocking(parent)
        except EOFError:
            return ["died", exit_reason(self.proc.wait())]
        return list(reply) + ([self.proc.pid] if reply[0] == "ready" else [])

    def wait(self) -> str:
        assert self.proc is not None
        return exit_reason(self.proc.wait())

    def stop(self, grace_s: float = 5.0) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.proc is not None:
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class RayProcess:
    """Driver-side handle of an actor process kept by a `_Keeper`."""

    def __init__(self, keeper: Any, address: str, pid: int) -> None:
        self.keeper = keeper
        self.address = address
        self.pid = pid
        self._exit: Any = None

    async def wait_exit(self) -> str:
        import ray

        if self._exit is None:
            self._exit = self.keeper.wait.remote()
        try:
            return str(await asyncio.shield(self._exit))
        except ray.exceptions.RayError as e:
            return f"its Ray keeper died ({type(e).__name__})"

    def stop(self) -> None:
        self.keeper.stop.remote()

    def kill(self) -> None:
        import ray

        ray.kill(self.keeper)


class RayLauncher:
    """Places each actor process in a Ray placement group bundle (one bundle per rank).

    Args:
        address: passed to `ray.init` if Ray is not initialised yet (None: start a local Ray).
        num_cpus: CPUs reserved per actor in its bundle.
    """

    def __init__(self, address: str | None = None, num_cpus: float = 1.0) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._ray = ray
        self._pg_factory = placement_group
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        self.num_cpus = num_cpus
        self._keeper_cls = ray.remote(num_cpus=0, max_concurrency=4)(  # type: ignore[call-overload]
            _Keeper)
        self._pgs: dict[str, Any] = {}
        self._keepers: list[Any] = []

    async def _placement(self, name: str, world: int) -> Any:
        pg = self._pgs.get(name)
        if pg is None:
            pg = self._pgs[name] = self._pg_factory(
                [{"CPU": self.num_cpus}] * world, strategy="PACK", name=f"earl-{name}")
        await pg.ready()
        return pg

    async def launch(self, spec: ActorSpec, env: dict[str, str] | None) -> RayProcess:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        label = f"{spec.name}[{spec.rank}]"
        pg = await self._placement(spec.name, spec.world_size)
        keeper = self._keeper_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=spec.rank)).remote()
        self._keepers.append(keeper)
        reply = await keeper.start.remote(pack_msg(spec), dict(env or {}))
        if reply[0] == "ready":
            return RayProcess(keeper, reply[1], reply[3])
        self._ray.kill(keeper)
        if reply[0] == "died":
            raise ActorDied(label, f"process {reply[1]} before it was ready")
        raise ActorError(label, reply[1], f"actor failed to start: {reply[2]}", reply[3])

    async def close(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for keeper in self._keepers:
            try:
                self._ray.kill(keeper)
            except Exception:  # noqa: BLE001, S110 (already dead)
                pass
        for pg in self._pgs.values():
            remove_placement_group(pg)
        self._keepers.clear()
        self._pgs.clear()
        if self._owns_ray:
            self._ray.shutdown()
