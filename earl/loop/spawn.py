"""Spawn one attempt of a run: each stage's group (`earl.loop.stages`, in spawn order), then
the loop's parts over them; and `evaluating`, what a greedy evaluation of a saved policy needs
(`earl eval`).

Not here: the loop that drives the parts (`earl.loop.main`), how each stage is built and
rebuilt (`earl.loop.stages`), the actors themselves (`earl.stages`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from earl.loop.actors import Actors
from earl.loop.evaluation import ActorEvaluation
from earl.loop.job import Attempt, Job
from earl.loop.production import ActorProduction
from earl.loop.schedule import AsSpawned
from earl.loop.stages import STAGES, Building, spawn_dock, spawn_producers, spawn_replicas
from earl.loop.training import ActorTraining

if TYPE_CHECKING:
    from earl.runtime import ActorGroup
    from earl.stages.producer import ProducerActor

__all__ = ["evaluating", "spawn_attempt"]


async def spawn_attempt(job: Job, version: int) -> Attempt:
    """Spawn every stage of `job` at policy `version`; returns the attempt."""
    cfg, pl = job.cfg, job.cfg.placement
    warm = cfg.selector.warm_hosts if cfg.selector.warm_hosts >= 0 else \
        max(pl.devices - 1, 2)
    if cfg.selector.on and warm:  # first: they import while the run starts
        from earl.stages.rollout import RolloutActor
        from earl.stages.trainer import TrainerActor

        for cls in (RolloutActor, TrainerActor):  # a re-layout's ranks skip their imports
            job.rt.keep_warm(cls, warm)
    b = Building(job=job, actors=Actors(), version=version)
    with job.tracer.span("spawn_actors", actor="driver"):
        for stage in STAGES:
            await stage.build(b)
    actors, sup = b.actors, job.supervisor
    columns = ["input_ids", "loss_mask", "advantages", "rollout_logprobs"]
    if job.n_reference > 0:
        columns.append("ref_logprobs")
    production = ActorProduction(actors.producers, job.recipe.tasks,
                                 groups_per_batch=cfg.batch_size // cfg.group_size,
                                 group_size=cfg.group_size, shared=job.recipe.shared_group_task,
                                 over_sample=cfg.over_sample_groups, tracer=job.tracer,
                                 supervisor=sup, dock=actors.dock)
    training = ActorTraining(actors, columns, supervisor=sup, production=production,
                             tracer=job.tracer,
                             weights_transport=pl.weights_transport or "auto",  # type: ignore[arg-type]
                             weight_update=cfg.weight_update,  # type: ignore[arg-type]
                             max_policy_lag=cfg.max_policy_lag)
    return Attempt(actors=actors, production=production, training=training,
                   evaluation=_evaluation(job, actors.producers),
                   selection=b.selection or AsSpawned())


@contextlib.asynccontextmanager
async def evaluating(job: Job) -> AsyncIterator[ActorEvaluation]:
    """While the body runs, the recipe's greedy evaluation of the policy `job.start` (`earl
    eval`): the rollout replicas serve it as the placement says, the producers play the eval,
    and a dock index stands by (producers register their shards with it; nothing is put).
    No trainer or reference is spawned.

    Raises:
        ValueError: the recipe has nothing to evaluate on (no eval tasks).
    """
    if not job.recipe.eval:
        raise ValueError(f"recipe {job.recipe.name!r} has no eval tasks to evaluate on; pass "
                         "--eval-tasks FILE.jsonl")
    await spawn_dock(job, ["train"], 1)
    job.supervisor.adopt("rollout", "in_place")
    rollout = await spawn_replicas(job, 0)
    evaluation = _evaluation(job, await spawn_producers(
        job, 0, restart=job.supervisor.adopt("producer", "in_place")), healed=False)
    assert evaluation is not None  # the recipe has an eval
    try:
        yield evaluation
    finally:
        await rollout.close.call()


def _evaluation(job: Job, producers: ActorGroup[ProducerActor], *, healed: bool = True
                ) -> ActorEvaluation | None:
    """The recipe's greedy evaluation on `producers` (None: the recipe has no eval); with
    `healed`, run again after a producer's death once the supervisor healed it."""
    cfg = job.cfg
    if not job.recipe.eval:
        return None
    return ActorEvaluation(producers, job.recipe, size=cfg.eval_games or cfg.DEFAULT_EVAL_GAMES,
                           supervisor=job.supervisor if healed else None)
