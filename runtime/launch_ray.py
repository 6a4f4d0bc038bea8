"""The "ray" launcher: Ray only places and keeps processes; earl does all the talking.

Each actor group gets a Ray placement group with one bundle per rank; in each bundle a small
Ray actor (`_Keeper`) starts the real actor process (`python -m earl.runtime.host`), relays the
bootstrap handshake, and reports when the process exits. So a job can span Ray nodes, while every
call goes over earl's own sockets (TCP, every frame HMAC'd with the run's secret, which reaches
the process in its bootstrap spec through Ray's own channel), never through Ray. The actor
process dies with its keeper (PR_SET_PDEATHSIG), and keepers die with the driver (Ray owns them).

Where: a group's bundles may ask for a little of a Ray custom resource (`resources`: group name
-> resource, e.g. the `earl_host_b` a node was started with), which puts them on that node, and
for GPUs (`gpus`: group name -> GPUs per rank; Ray then sets CUDA_VISIBLE_DEVICES for the
keeper, which its actor process inherits). Each actor process binds its RPC server on its Ray
node's address (not loopback: peers may be on other nodes) and gets it as $EARL_NODE_ADDRESS
(`earl.runtime.locality.node_address`). `free_address` reserves a free port on the node that
holds one rank's bundle (a process group's rendezvous).

Ray is imported only when this launcher is used.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

from earl.runtime.errors import ActorDied, ActorError
from earl.runtime.launch import ActorSpec, pack_msg, recv_msg_blocking
from earl.runtime.launch_local import exit_reason
from earl.runtime.locality import ENV_ADDRESS

RESOURCE_PER_RANK = 0.01  # of a group's custom resource: enough to pin it to the node


def _tcp_bind(ip: str) -> str:
    return f"tcp:[{ip}]:0" if ":" in ip else f"tcp:{ip}:0"


def _node_ip() -> str:
    import ray

    return str(ray.util.get_node_ip_address())


def _free_port_here() -> tuple[str, int]:
    """Runs on the node of a bundle: a port free there right now, on the node's address."""
    ip = _node_ip()
    with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as s:
        s.bind((ip, 0))
        return ip, int(s.getsockname()[1])


class _Keeper:
    """Runs on a Ray worker: owns one actor process (created with max_concurrency > 1)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None

    def start(self, spec: ActorSpec, env: dict[str, str]) -> list[Any]:
        # peers may be on other nodes: bind on this node's address, and tell the process
        ip = _node_ip()
        spec = dataclasses.replace(spec, bind=_tcp_bind(ip), host=ip)
        parent, child = socket.socketpair()
        full_env = dict(os.environ)
        full_env.update(env)
        full_env[ENV_ADDRESS] = ip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "earl.runtime.host", str(child.fileno()), str(os.getpid())],
            pass_fds=(child.fileno(),), env=full_env, stdin=subprocess.DEVNULL)
        child.close()
        self.sock = parent
        parent.sendall(pack_msg(spec))
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
        address: passed to `ray.init` if Ray is not initialised yet (None: $RAY_ADDRESS, else
            start a local Ray).
        num_cpus: CPUs reserved per actor in its bundle.
        resources: group name -> a Ray custom resource its bundles ask a little of (so Ray
            places them on a node that has it); groups not named go where Ray puts them.
        gpus: group name -> GPUs per rank (each rank's bundle asks for them).
    """

    def __init__(self, address: str | None = None, num_cpus: float = 1.0, *,
                 resources: Mapping[str, str] | None = None,
                 gpus: Mapping[str, float] | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._ray = ray
        self._pg_factory = placement_group
        self._owns_ray = False
        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
            self._owns_ray = True
        self.num_cpus = num_cpus
        self.resources = dict(resources or {})
        self.gpus = dict(gpus or {})
        self.node_address = _node_ip()  # the driver's node: where its own servers bind
        self._keeper_cls = ray.remote(num_cpus=0, max_concurrency=4)(  # type: ignore[call-overload]
            _Keeper)
        self._pgs: dict[str, tuple[int, Any]] = {}  # group -> (ranks, placement group)
        self._keepers: list[Any] = []

    def bundle(self, name: str) -> dict[str, float]:
        """What each rank of group `name` reserves."""
        b = {"CPU": self.num_cpus}
        if self.gpus.get(name):
            b["GPU"] = self.gpus[name]
        if name in self.resources:
            b[self.resources[name]] = RESOURCE_PER_RANK
        return b

    async def _placement(self, name: str, world: int) -> Any:
        """The placement group of group `name` at `world` ranks. A group re-spawned at another
        size (a new layout) gets a new one; the old one is released (its ranks must be stopped
        by then)."""
        from ray.util.placement_group import remove_placement_group

        held = self._pgs.get(name)
        if held is not None and held[0] != world:
            remove_placement_group(held[1])
            held = None
        if held is None:
            held = self._pgs[name] = (world, self._pg_factory(
                [self.bundle(name)] * world, strategy="PACK", name=f"earl-{name}"))
        await held[1].ready()
        return held[1]

    def _in_bundle(self, pg: Any, rank: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=pg,
                                                placement_group_bundle_index=rank)

    async def free_address(self, name: str, world: int, rank: int = 0) -> tuple[str, int]:
        """(node address, port free there now) of the node that holds rank `rank` of group
        `name` (its placement group is reserved now, and used by the group's launch)."""
        pg = await self._placement(name, world)
        task = self._ray.remote(num_cpus=0)(_free_port_here)
        host, port = await task.options(scheduling_strategy=self._in_bundle(pg, rank)).remote()
        return str(host), int(port)

    async def launch(self, spec: ActorSpec, env: dict[str, str] | None) -> RayProcess:
        label = f"{spec.name}[{spec.rank}]"
        pg = await self._placement(spec.name, spec.world_size)
        keeper = self._keeper_cls.options(num_gpus=self.gpus.get(spec.name, 0),
                                          scheduling_strategy=self._in_bundle(pg, spec.rank)
                                          ).remote()
        self._keepers.append(keeper)
        reply = await keeper.start.remote(spec, dict(env or {}))
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
        for _, pg in self._pgs.values():
            remove_placement_group(pg)
        self._keepers.clear()
        self._pgs.clear()
        if self._owns_ray:
            self._ray.shutdown()
