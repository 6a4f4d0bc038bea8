"""Spawn one attempt of a run: its actor groups and the loop's parts over them, in one place.

Order: the trainer ranks, the dock's index, the reference; then (with `--selector on`) the
selector's first plan, which decides the rollout's window, layout and slots; the rollout
replicas; the producers (agent coroutines and the dock's warehouse shards). The parts
(`earl.loop.parts`) are wrapped by healing (`earl.loop.healing_parts.heal`) as they are built.
`evaluating` spawns only what a greedy evaluation of a saved policy needs (`earl eval`).
Stage configs come from `earl.loop.stage_configs` (what `earl train --dry-run` shows too).

Not here: the loop that drives the parts (`earl.loop.main`), the actors themselves
(`earl.stages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from earl.loop.actors import Actors
from earl.loop.healing_parts import (
    HealingEvaluation,
    HealingProduction,
    HealingTraining,
    LedgerDock,
    heal,
)
from earl.loop.parts import ActorEvaluation, ActorProduction, ActorTraining
from earl.loop.stage_configs import engine_config, reference_config, trainer_config

if TYPE_CHECKING:
    from earl.loop.job import Job
    from earl.loop.schedule import Selection
    from earl.loop.selection import Setting
    from earl.loop.selection_actors import ActorReconfigurer
    from earl.runtime import ActorGroup
    from earl.stages.producer import ProducerActor
    from earl.stages.rollout import RolloutActor
    from earl.stages.vllm_engine import EngineConfig

__all__ = ["Attempt", "evaluating", "spawn_attempt"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """An attempt's live actors and the loop's parts over them."""

    actors: Actors
    production: HealingProduction
    training: HealingTraining
    evaluation: HealingEvaluation | None
    selection: Selection | None  # the selector's, or colocation's turns (earl.loop.colocation)
    reconfigurer: ActorReconfigurer | None


async def spawn_attempt(job: Job, version: int) -> Attempt:
    """Spawn every actor group of `job` at policy `version`; returns the attempt."""
    from earl.runtime.dock import IndexActor

    cfg, pl = job.cfg, job.cfg.placement
    warm = cfg.selector.warm_hosts if cfg.selector.warm_hosts >= 0 else \
        max(pl.devices - 1, 2)
    if cfg.selector.on and warm:  # first: they import while the run starts
        from earl.stages.rollout import RolloutActor
        from earl.stages.trainer import TrainerActor

        for cls in (RolloutActor, TrainerActor):  # a re-layout's ranks skip their imports
            job.rt.keep_warm(cls, warm)
    with job.tracer.span("spawn_actors", actor="driver"):
        trainer = await spawn_trainer(job)
        stages = ["reference", "train"] if job.n_reference > 0 else ["train"]
        per_batch = cfg.batch_size + cfg.algorithm.self_imitation
        capacity = (cfg.max_policy_lag + 2) * per_batch
        if cfg.partial_rollouts != "off":  # the groups out, one step's more, each with its
            per_step = cfg.batch_size // cfg.group_size  # own self-imitation rows
            out = cfg.max_concurrent_groups or (cfg.max_policy_lag + 1) * per_step
            capacity = (out + per_step) * (cfg.group_size + cfg.algorithm.self_imitation)
        # one index rank per producer: each owns the groups whose ids hash to it, so
        # registrations spread; a step's lease is merged from them (`Dock.take`). The
        # staleness gate bounds what is in flight, so each rank may hold all of it.
        await job.rt.spawn("dock", IndexActor, stages=stages, capacity=capacity, env=job.env,
                           n=pl.producers)
        if pl.producers > 1:
            job.log(f"dock: index sharded over {pl.producers} ranks (one per producer)")
        dock = LedgerDock(await job.rt.lookup("dock"), job.healer)
        actors = Actors(trainer=trainer, dock=dock, reference=await spawn_reference(job),
                        micro_batch_tokens=pl.micro_batch_tokens)
        selection: Selection | None = None
        reconfigurer = None
        if cfg.selector.on:  # its first plan sets up the rollout replicas
            from earl.loop.selection_actors import selection_for_run

            selection, reconfigurer = selection_for_run(job, actors)
            await selection.start(version, lambda s: spawn_rollout(job, actors, version, s,
                                                                   reconfigurer))
        else:
            await spawn_rollout(job, actors, version, None, None)
            if pl.colocate:  # the stages take turns on shared devices
                from earl.loop.colocation import Colocation

                selection = Colocation(actors, job.tracer)
        actors.use_producers(await spawn_producers(job, version))
    columns = ["input_ids", "loss_mask", "advantages", "rollout_logprobs"]
    if job.n_reference > 0:
        columns.append("ref_logprobs")
    production = ActorProduction(actors.producers, job.recipe.tasks,
                                 groups_per_batch=cfg.batch_size // cfg.group_size,
                                 group_size=cfg.group_size, shared=job.recipe.shared_group_task,
                                 over_sample=cfg.over_sample_groups, tracer=job.tracer)
    evaluation = _evaluation(job, actors.producers)
    training = ActorTraining(actors, columns, job.tracer,
                             weights_transport=pl.weights_transport or "auto",  # type: ignore[arg-type]
                             )
    parts = heal(production, training, evaluation,
                 healer=job.healer, rt=job.rt, out=job.out)
    return Attempt(actors=actors, production=parts.production, training=parts.training,
                   evaluation=parts.evaluation, selection=selection, reconfigurer=reconfigurer)


@contextlib.asynccontextmanager
async def evaluating(job: Job) -> AsyncIterator[ActorEvaluation]:
    """While the body runs, the recipe's greedy evaluation of the policy `job.start` (`earl
    eval`): the rollout replicas serve it as the placement says, the producers play the eval,
    and a dock index stands by (producers register their shards with it; nothing is put).
    No trainer or reference is spawned.

    Raises:
        ValueError: the recipe has nothing to evaluate on (no eval tasks).
    """
    from earl.runtime.dock import IndexActor

    if not job.recipe.eval:
        raise ValueError(f"recipe {job.recipe.name!r} has no eval tasks to evaluate on; pass "
                         "--eval-tasks FILE.jsonl")
    await job.rt.spawn("dock", IndexActor, stages=["train"], capacity=1, env=job.env)
    rollout = await spawn_replicas(job, 0)
    evaluation = _evaluation(job, await spawn_producers(job, 0))
    assert evaluation is not None  # the recipe has an eval
    try:
        yield evaluation
    finally:
        await rollout.close.call()


def _evaluation(job: Job, producers: ActorGroup[ProducerActor]) -> ActorEvaluation | None:
    """The recipe's greedy evaluation on `producers` (None: the recipe has no eval)."""
    cfg = job.cfg
    if not job.recipe.eval:
        return None
    return ActorEvaluation(producers, job.recipe, size=cfg.eval_games or cfg.DEFAULT_EVAL_GAMES)


def _slots(job: Job, actor: str, n: int, per_rank: int = 1) -> Any:
    """The device slots of `actor`'s `n` ranks, or None without slots; a rank of
    `per_rank` devices gets them joined into one slot."""
    if job.slots is None:
        return None
    names = job.roles[actor]
    return [job.slots.join(names[r * per_rank:(r + 1) * per_rank], actor) for r in range(n)]


async def spawn_trainer(job: Job) -> Any:
    from earl.stages.trainer import TrainerActor

    cfg, pl = job.cfg, job.cfg.placement
    dist_url = None
    if pl.trainer > 1:  # the rendezvous on rank 0's host (under Ray, maybe another node)
        host, port = await job.rt.free_address("trainer", pl.trainer)
        dist_url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    tcfg = trainer_config(cfg, model=str(job.start), dist_url=dist_url,
                          record_dir=str(job.out / "trained") if cfg.record_trained else "")
    return await job.rt.spawn("trainer", TrainerActor, tcfg, pl.backend, n=pl.trainer,
                              env=job.env, slot=_slots(job, "trainer", pl.trainer))


async def spawn_reference(job: Job) -> Any:
    """The reference actors, or None without a KL term."""
    from earl.stages.reference import ReferenceActor

    if job.n_reference == 0:
        return None
    rcfg = reference_config(job.cfg, model=str(job.start))
    return await job.rt.spawn("reference", ReferenceActor, rcfg, n=job.n_reference,
                              env=job.env, restart=job.healer.policy("reference"),
                              slot=_slots(job, "reference", job.n_reference))


async def spawn_rollout(job: Job, actors: Actors, version: int, setting: Setting | None,
                        reconfigurer: ActorReconfigurer | None) -> None:
    """The vLLM replicas, as configured or with the selector's `setting`; they serve the
    trained weights on a resumed run, the warm-started ones otherwise."""
    if setting is None or reconfigurer is None:
        await actors.use_rollout(await spawn_replicas(job, version))
        return
    from earl.stages.rollout import RolloutActor

    changes, n, slot = reconfigurer.rollout_spawn(setting)
    ecfg = replace(_engine_config(job, version), **changes)
    await actors.use_rollout(await job.rt.spawn("rollout", RolloutActor, ecfg, version, n=n,
                                                env=job.env, slot=slot,
                                                restart=job.healer.policy("rollout")))
    reconfigurer.measure_rollout(setting, n, ecfg.kv_cache_gb)


async def spawn_replicas(job: Job, version: int) -> ActorGroup[RolloutActor]:
    """The vLLM replicas as the placement says (no selector), serving policy `version`."""
    from earl.stages.rollout import RolloutActor

    pl = job.cfg.placement
    ecfg = _engine_config(job, version)
    per = pl.devices_per_replica() if pl.device == "cpu" else 1  # GPU slots: their GPUs
    n, slot = pl.rollout, _slots(job, "rollout", pl.rollout, per)
    if pl.device == "cuda" and slot:  # vLLM's share of each GPU: the slot's budget
        ecfg = replace(ecfg, gpu_memory_mib=slot[0].memory_mib or 0)
    return await job.rt.spawn("rollout", RolloutActor, ecfg, version, n=n, env=job.env,
                              slot=slot, restart=job.healer.policy("rollout"))


def _engine_config(job: Job, version: int) -> EngineConfig:
    """A replica's config: it serves the trained weights on a resumed run (`version` > 0),
    the starting policy (`job.start`) otherwise."""
    serve = job.weights if (job.weights / "config.json").is_file() and version else job.start
    return engine_config(job.cfg, model=str(serve),
                         max_model_len=job.cfg.placement.context_window or job.max_model_len)


async def spawn_producers(job: Job, version: int) -> Any:
    from earl.recipe import critic_ref
    from earl.resolve import absolute_ref
    from earl.stages.producer import ProducerActor, ProducerConfig

    cfg, recipe = job.cfg, job.recipe
    critic = recipe.critic if cfg.algorithm.critic == "recipe" else None  # resolve checked
    pcfg = ProducerConfig(agent=job.agent, critic=critic_ref(critic) if critic else "",
                          model=str(job.start), rollout="rollout",
                          max_tokens=recipe.max_tokens, max_total_tokens=recipe.max_total_tokens,
                          context_window=cfg.placement.context_window or job.max_model_len,
                          reward=absolute_ref(cfg.reward) if cfg.reward else "",
                          tool_timeout_s=cfg.tool_timeout_s,
                          dump=str(job.out / "trajectories.jsonl")
                          if cfg.dump_trajectories else "", dump_share=cfg.dump_share,
                          dump_max_bytes=int(cfg.dump_max_mb * 2**20 / cfg.placement.producers),
                          algorithm=cfg.algorithm,
                          failed_reward=recipe.failed_reward)
    return await job.rt.spawn("producer", ProducerActor, pcfg, version,
                              n=cfg.placement.producers, env=job.env,
                              restart=job.healer.policy("producer"))
