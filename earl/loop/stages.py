"""The run's stages, each one declaration: its name, how a death of one of its ranks heals,
how its group is built (`build`) and what a restarted rank gets back (`rebuild`).

A stage's config section is its part of `RunConfig` (its actor config comes from
`earl.loop.stage_configs`); its restart policy comes from the supervisor that adopts it
(`earl.loop.supervisor.Supervisor.adopt`). `STAGES` lists them in spawn order: the trainer
ranks, the dock's index, the reference; then the rollout replicas (with `--selector on` the
selector's first plan decides their window, layout and slots); then the producers (agent
coroutines and the dock's warehouse shards). Adding a stage is a class here, its entry in
`STAGES` and its config section.

Not here: the attempt that builds them and the loop's parts over them (`earl.loop.spawn`), the
actors themselves (`earl.stages`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from earl.loop.devices import placed
from earl.loop.ledger import LedgerDock
from earl.loop.stage_configs import engine_config, reference_config, trainer_config

if TYPE_CHECKING:
    from earl.loop.actors import Actors
    from earl.loop.job import Job
    from earl.loop.schedule import Selection
    from earl.runtime import ActorGroup
    from earl.stages.producer import ProducerActor
    from earl.stages.rollout import RolloutActor
    from earl.stages.vllm_engine import EngineConfig

__all__ = ["STAGES", "Building", "Stage", "spawn_dock", "spawn_producers", "spawn_replicas"]


@dataclass(slots=True)
class Building:
    """What an attempt's stages built so far: the live groups, and the selector's (or
    colocation's) turns if the rollout stage set them up."""

    job: Job
    actors: Actors
    version: int
    selection: Selection | None = None


class Stage:
    """One stage: `name` is its actor group's, `heals` says how a death of one of its ranks
    heals ("in_place": restarted and `rebuild`; "rewind": the run resumes from its last
    checkpoint)."""

    name: ClassVar[str]
    heals: ClassVar[str]

    async def build(self, b: Building) -> None:
        """Spawn the stage's group for the attempt `b` builds, and put it in `b.actors`."""
        raise NotImplementedError

    async def rebuild(self, job: Job, rank: int) -> None:
        """Give restarted rank `rank` what the run needs it to hold again (the attempt in
        force is `job.attempt`)."""

    def ranks(self, actors: Actors) -> int:
        """How many ranks the stage's group has now (0: not running)."""
        return 0


class Trainer(Stage):
    name, heals = "trainer", "rewind"  # it holds the optimizer: no other process has it

    async def build(self, b: Building) -> None:
        from earl.stages.trainer import TrainerActor

        job = b.job
        cfg, pl = job.cfg, job.cfg.placement
        dist_url = None
        if pl.trainer > 1:  # the rendezvous on rank 0's host (under Ray, maybe another node)
            host, port = await job.rt.free_address("trainer", pl.trainer)
            dist_url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        tcfg = trainer_config(cfg, model=str(job.start), dist_url=dist_url,
                              record_dir=str(job.out / "trained") if cfg.record_trained else "")
        slot = placed(job.slots, job.roles["trainer"], pl.trainer, "trainer")
        group = await job.rt.spawn("trainer", TrainerActor, tcfg, pl.backend, n=pl.trainer,
                                   env=job.env, slot=slot,
                                   restart=job.supervisor.adopt(self.name, self.heals))
        b.actors.use_trainer(group, pl.micro_batch_tokens)


class DockIndex(Stage):
    name, heals = "dock", "rewind"  # it holds the leases

    async def build(self, b: Building) -> None:
        job, cfg = b.job, b.job.cfg
        stages = ["reference", "train"] if job.n_reference > 0 else ["train"]
        per_batch = cfg.batch_size + cfg.algorithm.self_imitation
        capacity = (cfg.max_policy_lag + 2) * per_batch
        if cfg.partial_rollouts != "off":  # the groups out, one step's more, each with its
            per_step = cfg.batch_size // cfg.group_size  # own self-imitation rows
            capacity = (cfg.groups_out + per_step) * (cfg.group_size + cfg.algorithm.self_imitation)
        # one index rank per producer: each owns the groups whose ids hash to it, so
        # registrations spread; a step's lease is merged from them (`Dock.take`). The
        # staleness gate bounds what is in flight, so each rank may hold all of it.
        index = await spawn_dock(job, stages, capacity, cfg.placement.producers,
                                 restart=job.supervisor.adopt(self.name, self.heals))
        if cfg.placement.producers > 1:
            job.log(f"dock: index sharded over {cfg.placement.producers} ranks (one per "
                    "producer)")
        b.actors.use_dock(LedgerDock(index, job.supervisor.ledger))


class Reference(Stage):
    name, heals = "reference", "in_place"

    async def build(self, b: Building) -> None:
        """The reference actors, or none without a KL term."""
        from earl.stages.reference import ReferenceActor

        job = b.job
        if job.n_reference == 0:
            return
        rcfg = reference_config(job.cfg, model=str(job.start))
        b.actors.use_reference(await job.rt.spawn(
            "reference", ReferenceActor, rcfg, n=job.n_reference, env=job.env,
            restart=job.supervisor.adopt(self.name, self.heals),
            slot=placed(job.slots, job.roles["reference"], job.n_reference,
                        "reference")))

    async def rebuild(self, job: Job, rank: int) -> None:
        # its ref_logprobs are forgotten and scored again by the new process (they were added
        # under the reference's stage); only groups it held unnamed columns of are lost
        await job.attempt.production.drop_shard(f"reference:{rank}", f"reference[{rank}]")

    def ranks(self, actors: Actors) -> int:
        return len(actors.reference) if actors.reference is not None else 0


class Rollout(Stage):
    name, heals = "rollout", "in_place"

    async def build(self, b: Building) -> None:
        """The vLLM replicas, as placed or by the selector's first plan; they serve the
        trained weights on a resumed run, the warm-started ones otherwise."""
        job, actors, version = b.job, b.actors, b.version
        restart = job.supervisor.adopt(self.name, self.heals)
        if not job.cfg.selector.on:
            await actors.use_rollout(await spawn_replicas(job, version))
            if job.cfg.placement.colocate:  # the stages take turns on shared devices
                from earl.loop.colocation import Colocation

                b.selection = Colocation(actors, job.tracer)
            return
        from earl.loop.selection_actors import selection_for_run
        from earl.stages.rollout import RolloutActor

        selection, reconfigurer = selection_for_run(job, actors)

        async def spawn(setting: Any) -> None:
            changes, n, slot = reconfigurer.rollout_spawn(setting)
            ecfg = replace(_engine_config(job, version), **changes)
            await actors.use_rollout(await job.rt.spawn(
                "rollout", RolloutActor, ecfg, version, n=n, env=job.env, slot=slot,
                restart=restart))
            reconfigurer.measure_rollout(setting, n, ecfg.kv_cache_gb)

        await selection.start(version, spawn)
        b.selection = selection

    async def rebuild(self, job: Job, rank: int) -> None:
        """A restarted replica gets the current weights at the current version."""
        await job.attempt.actors.use_rollout(await job.rt.lookup("rollout"))
        await job.attempt.training.repush(rank)

    def ranks(self, actors: Actors) -> int:
        return len(actors.rollout)


class Producer(Stage):
    name, heals = "producer", "in_place"

    async def build(self, b: Building) -> None:
        b.actors.use_producers(await spawn_producers(
            b.job, b.version, restart=b.job.supervisor.adopt(self.name, self.heals)))

    async def rebuild(self, job: Job, rank: int) -> None:
        """Its policy version, its critic from the checkpoint in force, its shard's lost
        groups played again."""
        await job.attempt.production.rebuild(rank, _last_producer_state(job.out, rank))

    def ranks(self, actors: Actors) -> int:
        return len(actors.producers)


STAGES: tuple[Stage, ...] = (Trainer(), DockIndex(), Reference(), Rollout(), Producer())


def _last_producer_state(out: Path, rank: int) -> str | None:
    """The file of producer `rank`'s critic in the checkpoint in force (None: no checkpoint
    yet, or none of this rank)."""
    from earl.loop.checkpoint import MANIFEST

    manifest = out / "checkpoint" / MANIFEST
    if not manifest.is_file():
        return None
    folder = out / "checkpoint" / json.loads(manifest.read_text())["folder"]
    path = folder / "producers" / f"{rank}.json"
    return str(path) if path.is_file() else None


# ---- spawning, shared with `earl eval` (`earl.loop.spawn.evaluating`) ---------------------
async def spawn_dock(job: Job, stages: list[str], capacity: int, n: int = 1, *,
                     restart: Any = None) -> ActorGroup[Any]:
    """The dock's index ranks; returns the group."""
    from earl.runtime.dock import IndexActor

    return await job.rt.spawn("dock", IndexActor, stages=stages, capacity=capacity,
                              env=job.env, n=n, restart=restart)


async def spawn_replicas(job: Job, version: int) -> ActorGroup[RolloutActor]:
    """The vLLM replicas as the placement says (no selector), serving policy `version`."""
    from earl.stages.rollout import RolloutActor

    pl = job.cfg.placement
    ecfg = _engine_config(job, version)
    per = pl.devices_per_replica() if pl.device == "cpu" else 1  # GPU slots: their GPUs
    n, slot = pl.rollout, placed(job.slots, job.roles["rollout"], pl.rollout, "rollout", per)
    if pl.device == "cuda" and slot:  # vLLM's share of each GPU: the slot's budget
        ecfg = replace(ecfg, gpu_memory_mib=slot[0].memory_mib or 0)
    return await job.rt.spawn("rollout", RolloutActor, ecfg, version, n=n, env=job.env,
                              slot=slot, restart=job.supervisor.policy("rollout"))


def _engine_config(job: Job, version: int) -> EngineConfig:
    """A replica's config: it serves the trained weights on a resumed run (`version` > 0),
    the starting policy (`job.start`) otherwise."""
    serve = job.weights if (job.weights / "config.json").is_file() and version else job.start
    return engine_config(job.cfg, model=str(serve),
                         max_model_len=job.cfg.placement.context_window or job.max_model_len)


async def spawn_producers(job: Job, version: int, *, restart: Any = None
                          ) -> ActorGroup[ProducerActor]:
    from earl.recipe import critic_ref
    from earl.resolve import absolute_ref
    from earl.stages.compute import fields_of
    from earl.stages.producer import ProducerActor, ProducerConfig
    from earl.stages.producer_settings import ProducerSettings

    cfg, recipe = job.cfg, job.recipe
    critic = recipe.critic if cfg.algorithm.critic == "recipe" else None  # resolve checked
    settings = fields_of(ProducerSettings, cfg) | {  # resolved: the recipe's agent and cap
        "agent": job.agent, "max_tokens": recipe.max_tokens,
        "reward": absolute_ref(cfg.reward) if cfg.reward else ""}
    pcfg = ProducerConfig(**settings, critic=critic_ref(critic) if critic else "",
                          model=str(job.start), max_total_tokens=recipe.max_total_tokens,
                          context_window=cfg.placement.context_window or job.max_model_len,
                          dump=str(job.out / "trajectories.jsonl") if cfg.dump_trajectories
                          else "", algorithm=cfg.algorithm, failed_reward=recipe.failed_reward,
                          dump_max_bytes=int(cfg.dump_max_mb * 2**20 / cfg.placement.producers))
    return await job.rt.spawn("producer", ProducerActor, pcfg, version,
                              n=cfg.placement.producers, env=job.env, restart=restart)
