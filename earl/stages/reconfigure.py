"""Live reconfiguration of stage actors: re-create a group with a new parallel layout.

`reconfigure_trainer` saves the trainer group's state with a resharding checkpoint (torch
distributed checkpoint: every rank writes its shards), stops the group, spawns the same
`TrainerConfig` with the new layout (``dp`` replicas x ``tp`` ranks), loads the checkpoint
into the new shards (parameters *and* Adam moments, schedule and step: not reset) and, when
given a rollout group, re-pushes the weights at the current policy version.
`reconfigure_rollout` does the same for the vLLM replicas: a new tensor-parallel degree or
replica count, then the trainer pushes the current weights into them; replicas that keep their
TP and slots keep their processes (`in_place`: the group is resized, their engines rebuilt only
if the config changed). `reconfigure_reference` moves the reference's ranks: the columns they
added to the dock are retracted and scored again by the new ranks (the reference is frozen, so
the values are the same), so no sample is lost.

Both report seconds by phase (`ReconfigTimes`). Samples in flight stay in the dock: the dock
index and warehouses are other actors, untouched here. This module does not decide *when* to
reconfigure (the parallelism selector does) and does not drain producers: the caller stops
calling the old group first.

Example:
    >>> trainer, times = await reconfigure_trainer(rt, trainer, Layout(dp=1, tp=2),
    ...                                            checkpoint_dir=out / "reshard", rollout=rollout)
    >>> times.total_s, times.save_s, times.load_s
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from earl.runtime import ActorGroup, RestartPolicy, Runtime
from earl.runtime.dock import Dock, shard_name
from earl.runtime.layout import Layout
from earl.stages.reference import ReferenceActor, ReferenceConfig
from earl.stages.rollout import RolloutActor
from earl.stages.trainer import TrainerActor
from earl.stages.vllm_engine import EngineConfig

__all__ = ["ReconfigTimes", "reconfigure_reference", "reconfigure_rollout",
           "reconfigure_trainer"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReconfigTimes:
    """Seconds spent in each phase of one reconfiguration (0 for a phase that did not run)."""

    save_s: float = 0.0
    stop_s: float = 0.0
    spawn_s: float = 0.0
    rebuild_s: float = 0.0  # an engine rebuilt inside its warm process (no stop, no spawn)
    load_s: float = 0.0
    push_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.save_s + self.stop_s + self.spawn_s + self.rebuild_s + self.load_s
                + self.push_s)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "total_s": self.total_s}


async def reconfigure_trainer(
    rt: Runtime, group: ActorGroup[TrainerActor], new_layout: Layout, *,
    checkpoint_dir: str | Path, env: dict[str, str] | None = None,
    rollout: ActorGroup[RolloutActor] | None = None, version: int | None = None,
    slot: Any = None, **changes: Any,
) -> tuple[ActorGroup[TrainerActor], ReconfigTimes]:
    """Re-create the trainer `group` with `new_layout`, its state resharded, not reset.

    Args:
        rt: the runtime that spawned `group`.
        group: the live trainer group (nothing else may be calling it).
        new_layout: ``dp`` x ``tp`` of the new group (``pp`` and ``cp`` must be 1). With
            ``tp > 1`` and ``dp > 1`` the data-parallel mode becomes FSDP2.
        checkpoint_dir: where the resharding checkpoint is written (kept afterwards).
        env: environment of the new actor processes.
        rollout: push the weights to this rollout group once loaded (phase ``push_s``).
        version: the policy version to tag that push with (default: the trainer's step).
        slot: the new ranks' device slots (`Runtime.spawn`'s ``slot=``: one per rank).
        changes: other `TrainerConfig` fields to change (e.g. ``micro_batch_tokens``, the
            micro-batch token budget the dispatcher plans with).

    Returns:
        (the new group, under the same name; seconds by phase).

    Raises:
        ValueError: a layout the torch trainer cannot run.
    """
    if new_layout.pp != 1 or new_layout.cp != 1:
        raise ValueError(f"reconfigure_trainer: layout {new_layout} has pp/cp > 1; the torch "
                         "trainer runs dp x tp only")
    cfg = await group[0].trainer_config.call_one()
    parallel = "fsdp" if new_layout.tp > 1 and new_layout.dp > 1 else cfg.parallel
    path = str(checkpoint_dir)
    t0 = time.perf_counter()
    await group.save_checkpoint.call(path)
    t1 = time.perf_counter()
    await group.close.call()
    await rt.stop(group)
    t2 = time.perf_counter()
    dist_url = None
    if new_layout.world_size > 1:  # rank 0's host (under Ray, maybe another node than ours)
        host, port = await rt.free_address(group.name, new_layout.world_size)
        dist_url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    new_cfg = dataclasses.replace(cfg, tp=new_layout.tp, parallel=parallel, dist_url=dist_url,
                                  **changes)
    new = await rt.spawn(group.name, TrainerActor, new_cfg, n=new_layout.world_size, env=env,
                         slot=slot)
    t3 = time.perf_counter()
    steps = await new.load_checkpoint.call(path)
    t4 = time.perf_counter()
    t5 = t4
    if rollout is not None:
        await new.push_weights.call(rollout, steps[0] if version is None else version)
        t5 = time.perf_counter()
    return new, ReconfigTimes(save_s=t1 - t0, stop_s=t2 - t1, spawn_s=t3 - t2, load_s=t4 - t3,
                              push_s=t5 - t4)


async def reconfigure_reference(
    rt: Runtime, group: ActorGroup[ReferenceActor], dock: Dock, *, ranks: int,
    env: dict[str, str] | None = None, slot: Any = None, restart: RestartPolicy | None = None,
) -> tuple[ActorGroup[ReferenceActor], ReconfigTimes]:
    """Re-create the reference `group` with `ranks` ranks in new slots; nothing is lost.

    Each rank's ``serve_dock`` loop is stopped (its lease in progress finishes), the
    ``ref_logprobs`` it added to the dock are retracted (`Dock.retract_shard`: the samples
    wait for the "reference" stage again) and the group is stopped; the new ranks load the same
    frozen model. The caller serves the dock with the new group afterwards, and no trainer
    lease may be in flight (move between steps).

    Returns:
        (the new group, under the same name; seconds by phase: ``stop_s`` drains, retracts
        and stops, ``spawn_s`` starts the new ranks with their model loaded).
    """
    if ranks < 1:
        raise ValueError(f"reconfigure_reference: ranks must be >= 1, got {ranks}")
    t0 = time.perf_counter()
    await group.stop_serving.call()
    for rank in range(len(group)):
        await dock.retract_shard(shard_name(group.name, rank), "reference")
    cfg = ReferenceConfig(**await group[0].config.call_one())
    index = await group[0].index.call_one()
    await rt.stop(group)
    t1 = time.perf_counter()
    new = await rt.spawn(group.name, ReferenceActor, cfg, index, n=ranks, env=env, slot=slot,
                         restart=restart)
    return new, ReconfigTimes(stop_s=t1 - t0, spawn_s=time.perf_counter() - t1)


async def reconfigure_rollout(
    rt: Runtime, group: ActorGroup[RolloutActor], *, tensor_parallel_size: int,
    replicas: int | None = None, trainer: ActorGroup[TrainerActor] | None = None,
    version: int | None = None, env: dict[str, str] | None = None,
    slot: Any = None, restart: RestartPolicy | None = None, in_place: bool = False,
    **changes: Any,
) -> tuple[ActorGroup[RolloutActor], ReconfigTimes]:
    """Re-create the rollout `group` with a new TP degree (and replica count), then have
    `trainer` push the current weights into it at the current policy version.

    With `in_place` the replicas that stay keep their processes (same TP, same slots): the
    group is resized (`Runtime.resize`: replicas beyond `replicas` stop, phase ``stop_s``; new
    ones start in `slot`, phase ``spawn_s``, while the kept ones rebuild their engines inside
    their warm processes if the config changed, `RolloutActor.rebuild`, phase ``rebuild_s``),
    and the runtime restarts a replica with the new config from then on.

    Args:
        rt: the runtime that spawned `group`.
        group: the live rollout group (in-flight requests on it are aborted: let the agents'
            sessions finish first, or retry them on the new group).
        tensor_parallel_size: vLLM workers per replica.
        replicas: replica count (default: unchanged).
        trainer: the trainer group whose weights the new replicas load (phase ``push_s``);
            without it the replicas serve the weights in their config's model folder.
        version: the policy version to tag the weights with (default: the trainer's step,
            else the old replicas' version).
        env: environment of the new actor processes.
        slot: the new replicas' device slots (`Runtime.spawn`'s ``slot=``: one per replica;
            with `in_place`, one per replica added).
        restart: the new group's restart policy (a run passes its healer's: the replicas it
            re-creates are restarted after a death like the ones it spawned).
        in_place: keep the live processes of the replicas that stay (`env` and `restart` stay
            the group's; `tensor_parallel_size` must not change).
        changes: other `EngineConfig` fields to change (e.g. ``kv_cache_gb``, ``max_model_len``).

    Returns:
        (the new group, under the same name; seconds by phase, ``save_s`` and ``load_s`` 0).
    """
    cfg = await group[0].engine_config.call_one()
    new_cfg = dataclasses.replace(cfg, tensor_parallel_size=tensor_parallel_size, **changes)
    n = len(group) if replicas is None else replicas
    if version is None:
        version = (await trainer[0].version.call_one() if trainer is not None
                   else await group[0].policy_version.call_one())
    t0 = time.perf_counter()
    if in_place:
        if tensor_parallel_size != cfg.tensor_parallel_size:
            raise ValueError(f"reconfigure_rollout(in_place=True) keeps the replicas' TP "
                             f"{cfg.tensor_parallel_size}; TP {tensor_parallel_size} needs new "
                             "processes (in_place=False)")
        new, times = await _resize_in_place(rt, group, n, cfg, new_cfg, version, slot)
    else:
        await group.close.call()
        await rt.stop(group)
        t1 = time.perf_counter()
        new = await rt.spawn(group.name, RolloutActor, new_cfg, version, n=n, env=env,
                             slot=slot, restart=restart)
        times = {"stop_s": t1 - t0, "spawn_s": time.perf_counter() - t1}
    t2 = time.perf_counter()
    if trainer is not None:
        await trainer.push_weights.call(new, version)
    return new, ReconfigTimes(**times, push_s=time.perf_counter() - t2)


async def _resize_in_place(rt: Runtime, group: ActorGroup[RolloutActor], n: int,
                           cfg: EngineConfig, new_cfg: EngineConfig, version: int, slot: Any
                           ) -> tuple[ActorGroup[RolloutActor], dict[str, float]]:
    """`group` with `n` replicas in `new_cfg`: the kept ones rebuilt where the config changed,
    the added ones started meanwhile; seconds by phase."""
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    if n < len(group):
        group = await rt.resize(group, n)
        times["stop_s"] = time.perf_counter() - t0
    rt.restart_with(group, new_cfg, version)  # restarts and added replicas run the new config

    async def rebuild() -> None:
        if new_cfg != cfg:
            t = time.perf_counter()
            await group.rebuild.call(new_cfg, version)
            times["rebuild_s"] = time.perf_counter() - t

    async def grow() -> ActorGroup[RolloutActor]:
        if n <= len(group):
            return group
        t = time.perf_counter()
        grown = await rt.resize(group, n, slot=slot)
        times["spawn_s"] = time.perf_counter() - t
        return grown

    _, out = await asyncio.gather(rebuild(), grow())
    return out, times
