"""The RL loop of `earl train`, top down: the run (`run_job`), each of its attempts
(`train_attempt`): start -> spawn -> schedule -> final eval -> result.

`run_job` runs attempts under the run's supervisor, which starts another from the last
checkpoint after a trainer or dock death or a stall (`earl.loop.supervisor`). One attempt:

1. load the checkpoint (on a resume) or warm-start the policy (`earl.loop.warm_start`);
2. spawn the actors and the loop's parts (`Job.spawn`, `earl.loop.spawn`);
3. evaluate the starting policy;
4. run the schedule (`earl.loop.schedule.Schedule`): produce batch b (agents play, experience
   lands in the producers' dock shards) while earlier batches are prepared (the reference
   scores the dock) and trained (the trainer fetches straight from the shards), push the
   weights, evaluate and checkpoint when due;
5. pick the final policy (`select_best`), evaluate it, write `result.json`.

The reference scores the dock and the supervisor rebuilds restarted ranks for the whole
attempt (`serving`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from earl.loop.checkpoint import trim_logs
from earl.loop.schedule import LoopState, Schedule
from earl.loop.spawn import spawn_attempt
from earl.loop.stages import STAGES
from earl.loop.step_log import StepLog
from earl.loop.watchdog import Watchdog
from earl.resolve import model_folder
from earl.stages.optim import lr_scale

if TYPE_CHECKING:
    from earl.loop.job import Job
    from earl.loop.result import RunResult

__all__ = ["run_job", "train_attempt"]


async def run_job(job: Job, resume: bool) -> RunResult:
    """Run `job` (from its last checkpoint with `resume`): its attempts under its supervisor.

    Raises:
        HealingError: past the rewind limit (`earl.loop.supervisor.Supervisor.supervise`).
    """
    if not resume:
        job.supervisor.ledger.reset()
    try:
        return await job.supervisor.supervise(
            lambda resume: train_attempt(job, resume), resume, stop=job.stop_actors,
            checkpoint_step=job.checkpoints().step_in_force)
    finally:
        job.close()


async def train_attempt(job: Job, resume: bool) -> RunResult:
    """Run `job` from its start, or from its last checkpoint with `resume`."""
    from earl.loop.result import write_result
    from earl.loop.warm_start import warm_start

    cfg, recipe, store = job.cfg, job.recipe, job.checkpoints()
    state, trainer_ckpt, producers = store.load() if resume else (LoopState(), "", "")
    trim_logs(job.out, state.step)  # the logged steps not kept: all of them on a fresh start
    job.begin(state, resume=resume)
    if not resume:
        await warm_start(job, model_folder(cfg, job.out))
    parts = await spawn_attempt(job, state.step)
    job.use_attempt(parts)
    if resume:
        await restore(job, trainer_ckpt, producers)
    async with serving(job):
        if parts.evaluation is not None and not state.eval_start:
            state.eval_start = await evaluate(job, "start")
        schedule = Schedule(
            cfg, production=parts.production, training=parts.training,
            evaluation=parts.evaluation, checkpoints=store, state=state,
            target_key=recipe.target_key,
            lr_scale=lambda p: lr_scale(cfg.optim, p), observe=StepLog(job),
            on_eval=lambda ev: keep_best(job, ev), clock=job.elapsed,
            selection=parts.selection, watchdog=watchdog(job))
        stopped = await schedule.run()
        await parts.actors.trainer.save_hf.call(str(job.weights))  # a collective under TP/FSDP
        async with parts.selection.using():  # colocated: the rollout's turn
            selected = await select_final(job)
            final = await evaluate(job, "final") if parts.evaluation is not None else {}
        await parts.actors.rollout.close.call()
    return write_result(job, state, final, stopped, selected)


def watchdog(job: Job) -> Watchdog:
    """The attempt's stall limit (`stall_s`, `stall_steps`): the supervisor's events count as
    progress, and a stall names the rebuilds in progress and what the dock holds."""
    sup, dock = job.supervisor, job.attempt.actors.dock

    async def dock_state() -> str:
        st = await dock.statistics()
        return (f"the dock holds {st.samples} of {st.capacity} samples (with each column: "
                f"{st.ready}; leased {st.leased}; lost, not yet re-played {st.lost}; "
                f"waiting: {st.waiting_producers} puts, {st.waiting_consumers} takes)")

    return Watchdog(stall_s=job.cfg.stall_s, stall_steps=job.cfg.stall_steps,
                    activity=lambda: sup.active_at, healing=lambda: sup.rebuilding,
                    diagnose=dock_state)


async def restore(job: Job, trainer_ckpt: str, producers: str) -> None:
    """A resumed attempt: the trainer's and producers' state, the rollout's weights."""
    from earl.loop.checkpoint import CheckpointError

    actors, step = job.attempt.actors, job.state.step
    got = await actors.trainer.load_checkpoint.call(trainer_ckpt)
    if any(int(g) != step for g in got):
        raise CheckpointError(f"--resume: the trainer checkpoint is of step {got[0]}, "
                              f"the manifest says {step}")
    await job.attempt.production.load_states(producers)  # each reads its own file
    await actors.trainer.save_hf.call(str(job.weights))  # every rank: TP/FSDP gather
    await actors.rollout.update_weights_from_path.call(str(job.weights), step, "drain")
    job.log(f"resumed from step {step} ({job.out / 'checkpoint'})")


@contextlib.asynccontextmanager
async def serving(job: Job) -> AsyncIterator[None]:
    """While the body runs: the reference scores the dock (its group as it is now: a move by
    the selector stops one group's loop and re-creates it), the supervisor rebuilds restarted
    ranks of the stages healed in place."""
    actors, sup = job.attempt.actors, job.supervisor

    async def serve() -> None:
        while (group := actors.reference) is not None and not sup.stopping:
            await sup.serve("reference", functools.partial(
                group.serve_dock.call, 256, "reference", True))
            await actors.reference_replaced(group, lambda: sup.stopping)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve(), name="reference")
        # the groups as spawned (the selector's first plan may differ from the placement)
        healed = {s.name: s for s in STAGES if s.heals == "in_place"}
        tg.create_task(sup.watch({name: s.ranks(actors) for name, s in healed.items()},
                                 lambda name, rank: healed[name].rebuild(job, rank)),
                       name="supervisor")
        try:
            yield
        finally:
            sup.close()
            if (reference := actors.reference) is not None:
                # bounded: after a stall the reference may be the stuck part (its process
                # is stopped with the others next)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(60.0):
                        await sup.stop_serving(reference.stop_serving.call)


async def evaluate(job: Job, split: str) -> dict[str, float]:
    evaluation = job.attempt.evaluation
    assert evaluation is not None
    with job.tracer.span("eval", actor="driver", split=split):
        ev = await evaluation.evaluate(split, job.state.step)
    if split == "start":
        job.log(f"eval at start: {fmt(ev, job.recipe.target_key)}")
    return ev


async def keep_best(job: Job, ev: dict[str, float]) -> None:
    """Log a validation eval; keep the weights of the best one (`select_best`)."""
    job.log(f"eval @ step {int(ev['step'])}: {fmt(ev, job.recipe.target_key)}")
    if job.cfg.select_best and job.state.best[0] == int(ev["step"]):
        await job.attempt.actors.trainer.save_hf.call(str(job.best_dir))  # every rank joins


async def select_final(job: Job) -> int:
    """With `select_best`, serve the best validated step's weights; returns the final step."""
    state, parts = job.state, job.attempt
    if not job.cfg.select_best or state.best[0] < 0 or state.best[0] == state.step:
        return state.step
    await parts.actors.rollout.update_weights_from_path.call(str(job.best_dir), state.best[0],
                                                             "drain")
    await parts.production.pin_version(state.best[0])
    job.log(f"final policy: step {state.best[0]} (best validation {job.recipe.target_key} "
            f"{state.best[1]:.3f})")
    return state.best[0]


def fmt(ev: dict[str, float], key: str) -> str:
    shown = {k: v for k, v in ev.items() if k not in ("step", "minutes", "seconds")}
    head = f"{key} {ev.get(key, float('nan')):.3f}"
    rest = ", ".join(f"{k} {_value(k, v)}" for k, v in shown.items() if k != key)
    return f"{head} ({rest})" if rest else head


def _value(key: str, v: float) -> str:
    return str(int(v)) if key in ("games", "episodes") and float(v).is_integer() else f"{v:.3f}"
