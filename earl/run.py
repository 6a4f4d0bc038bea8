"""`earl train` and `earl.train(...)`: one general RL run, wired to actors.

This module resolves what to train (a shipped recipe, or a user's agent + tasks), spawns the
actors (each its own process): vLLM `RolloutActor`s, `ProducerActor`s that run the agent
coroutines and keep their experience in their own dock shards, a `ReferenceActor` that scores
the dock continuously, the `TrainerActor` ranks, the dock's `IndexActor`; and hands them to
`earl.loop.schedule.Schedule`. One sample's path: agent coroutine (producer) -> producer's
warehouse shard -> reference adds "ref_logprobs" on its shard -> trainer fetches straight
from both -> weights back to the rollout actors. The driver carries metadata only.

This module does not define losses (earl.algorithms), the loop's schedule (earl.loop) or the
CLI (earl.commands.train).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from earl.config import RunConfig, lr_scale, to_dict
from earl.loop.schedule import LoopState, StepRecord
from earl.recipe import Recipe
from earl.resolve import absolute_ref, model_folder, resolve_recipe

__all__ = ["RunResult", "run", "train"]


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What `train` returns (and `earl train --json` prints)."""

    eval: dict[str, float]
    eval_start: dict[str, float]
    wall_minutes: float
    steps: int
    policy_version: int
    episodes: int
    recipe: str = ""
    target_key: str = "reward"
    evals: list[dict[str, float]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    stopped: str = ""
    selected_step: int = -1

    def to_json(self) -> dict[str, object]:
        return {"recipe": self.recipe, "eval": self.eval, "eval_start": self.eval_start,
                "target_key": self.target_key, "wall_minutes": round(self.wall_minutes, 3),
                "steps": self.steps, "policy_version": self.policy_version,
                "episodes": self.episodes, "games": self.episodes, "stopped": self.stopped,
                "selected_step": self.selected_step, "failed_episodes": self.failures,
                "evals": self.evals, **self.files}


def process_seconds() -> float:
    """Wall seconds since this process started (imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def train(config: RunConfig | str | dict[str, object] | None = None, *,
          agent: Callable[..., Any] | None = None, tasks: Iterable[object] | None = None,
          resume: bool = False, trace: bool = False,
          log: Callable[[str], None] = print, **overrides: object) -> RunResult:
    """Train from Python; returns what `earl train --json` prints.

    Args:
        config: a RunConfig, a YAML path, or a dict of fields (None: the defaults).
        agent: an `async def agent(rollout, sample) -> float` defined at module level.
        tasks: training samples (any iterable of JSON-like values), with `agent`.
        overrides: RunConfig fields, e.g. `steps=20`, `algorithm={"lr": 1e-4}`.

    Example:
        >>> result = earl.train(agent=my_agent, tasks=problems, steps=50, output_dir="runs/a")
    """
    from earl.config import _merge, from_dict, read_yaml, validate
    from earl.recipe import load_recipe

    if isinstance(config, RunConfig):
        data: dict[str, object] = to_dict(config)
    elif isinstance(config, str):
        data = read_yaml(config)
    else:
        data = dict(config or {})
    data = _merge(data, dict(overrides))
    if agent is not None and (data.get("agent") or data.get("tasks")):
        raise ValueError("pass the agent either as agent= or as the agent/tasks config fields")
    defaults = {} if agent is not None or data.get("agent") or isinstance(config, RunConfig) \
        else load_recipe(str(data.get("recipe", "tictactoe"))).config
    cfg = from_dict(RunConfig, _merge(dict(defaults), data))
    validate(cfg)
    if agent is not None and tasks is None:
        raise ValueError("agent= needs tasks=: an iterable of samples")
    return asyncio.run(run(cfg, agent=agent, tasks=tasks, resume=resume, trace=trace, log=log))


async def run(cfg: RunConfig, *, agent: Callable[..., Any] | None = None,
              tasks: Iterable[object] | None = None, resume: bool = False,
              trace: bool = False, log: Callable[[str], None] = print) -> RunResult:
    """Run the whole job; returns the evaluations and the paths of every output file."""
    from earl.runtime import Runtime, RuntimeConfig, registry

    recipe, ref = resolve_recipe(cfg, agent=agent, tasks=tasks)
    # Actors write checkpoints and weights only under roots the run allows: its output folder.
    registry.allow_root(Path(cfg.output_dir).resolve())
    rt_cfg = RuntimeConfig(launcher=cfg.placement.launcher) \
        if cfg.placement.launcher != "local" else None
    async with Runtime(rt_cfg) as rt:
        job = _Job(cfg, recipe, ref, rt, log=log, trace=trace)
        from earl.loop.healing import run_job

        return await run_job(job, resume)


class _Job:
    """One run's actors and parts; `run` goes start-up -> schedule -> final eval -> files."""

    def __init__(self, cfg: RunConfig, recipe: Recipe, ref: str, rt: Any, *,
                 log: Callable[[str], None], trace: bool) -> None:
        from earl.observe import Metrics, Tracer

        self.cfg, self.recipe, self.ref, self.rt, self.log = cfg, recipe, ref, rt, log
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tracer = Tracer(trace)
        self.trace = trace
        self.metrics: Metrics | None = None
        self.env = {"OMP_NUM_THREADS": str(cfg.placement.threads_per_actor),
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_VERBOSITY": "error"}
        self.start = self.out / "weights_start"   # the warm-started policy: KL anchor
        self.weights = self.out / "weights"       # the trained policy, written at the end
        self.best_dir = self.out / "weights_best"
        self.wall_before = 0.0
        from earl.loop.healing import Healer, HealingConfig

        self.healer = Healer(HealingConfig(max_restarts=cfg.max_restarts), log=log,
                             tracer=self.tracer)
        self.pool: Any = None  # SlotPool when placement.slot_memory_mib > 0
        # --selector on: the Selection, its ActorReconfigurer and SlotMemory (with a pool)
        self.selection: Any = None
        self.reconfigurer: Any = None
        self.slot_memory: Any = None

    def elapsed(self) -> float:
        return self.wall_before + process_seconds()

    async def run(self, resume: bool) -> RunResult:
        from earl.loop.checkpoint import CheckpointStore, trim_logs
        from earl.observe import Metrics

        cfg, out = self.cfg, self.out
        from earl.loop.healing_parts import SafeCheckpoints

        store = SafeCheckpoints(CheckpointStore(
            out / "checkpoint", save_trainer=self._save_trainer,
            producer_states=self._producer_states, wall=self.elapsed), self.healer)
        state, trainer_ckpt = LoopState(), ""
        producer_states: list[dict[str, object]] = []
        if resume:
            state, trainer_ckpt, producer_states = store.load()
            self.wall_before = state.wall_before
            trim_logs(out, state.step)
        (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.metrics = Metrics(out, append=resume)
        base = model_folder(cfg, out)
        if not resume:
            await self._warm_start(base)
        self.state = state
        self.healer.version = state.step
        await self._spawn(state.step)
        if resume:
            got = await self.trainer.load_checkpoint.call(trainer_ckpt)
            if any(int(g) != state.step for g in got):
                from earl.loop.checkpoint import CheckpointError

                raise CheckpointError(f"--resume: the trainer checkpoint is of step {got[0]}, "
                                      f"the manifest says {state.step}")
            await self.production.load_states(producer_states)
            await self.trainer[0].save_hf.call_one(str(self.weights))
            await self.rollout.update_weights_from_path.call(str(self.weights), state.step,
                                                            "drain")
            self.log(f"resumed from step {state.step} ({out / 'checkpoint'})")
        reference = self.reference

        async def serve() -> None:  # the reference scores the dock until told to stop
            if reference is not None:
                await self.healer.serve_reference(
                    self.rt, lambda: reference.serve_dock.call(256, "reference", True))

        pl = self.cfg.placement
        async with asyncio.TaskGroup() as tg:
            tg.create_task(serve(), name="reference")
            tg.create_task(self.healer.watch(self.rt, {
                "rollout": pl.rollout, "producer": pl.producers, "reference": self.n_reference}),
                name="healer")
            try:
                result = await self._train(state, store)
            finally:
                self.healer.close()
                if reference is not None:
                    await self.healer.stop_reference(reference.stop_serving.call)
        if self.pool is not None:
            self.pool.close()  # removes the cgroups; processes still in them move to the parent
        return result

    async def _train(self, state: LoopState, store: Any) -> RunResult:
        from earl.loop.schedule import Schedule, ScheduleConfig

        cfg, recipe = self.cfg, self.recipe
        if self.evaluation is not None and not state.eval_start:
            with self.tracer.span("eval", actor="driver", split="start"):
                state.eval_start = await self.evaluation.evaluate("start", state.step)
            self.log(f"eval at start: {_fmt(state.eval_start, recipe.target_key)}")
        sched = Schedule(
            ScheduleConfig(steps=cfg.steps, max_policy_lag=cfg.max_policy_lag,
                           time_limit_s=cfg.time_limit_minutes * 60,
                           eval_every=cfg.eval_every if self.evaluation is not None else 0,
                           checkpoint_every=cfg.checkpoint_every, target=cfg.target,
                           target_key=recipe.target_key),
            production=self.production, training=self.training, evaluation=self.evaluation,
            checkpoints=store, state=state, lr_scale=lambda p: lr_scale(cfg.algorithm, p),
            observe=self._observe, on_eval=self._on_eval, clock=self.elapsed,
            selection=self.selection)
        self._last_t = time.perf_counter()
        stopped = await sched.run()
        await self.trainer[0].save_hf.call_one(str(self.weights))
        selected = state.step
        if cfg.select_best and state.best[0] >= 0 and state.best[0] != state.step:
            await self.rollout.update_weights_from_path.call(str(self.best_dir), state.best[0],
                                                            "drain")
            await self.production.pin_version(state.best[0])
            selected = state.best[0]
            self.log(f"final policy: step {selected} (best validation {recipe.target_key} "
                     f"{state.best[1]:.3f})")
        final: dict[str, float] = {}
        if self.evaluation is not None:
            with self.tracer.span("eval", actor="driver", split="final"):
                final = await self.evaluation.evaluate("final", state.step)
        await self.rollout.close.call()
        return self._result(state, final, stopped, selected)

    def _result(self, state: LoopState, final: dict[str, float], stopped: str,
                selected: int) -> RunResult:
        from earl.observe import read_metrics, write_plots

        assert self.metrics is not None
        self.metrics.close()
        out = self.out
        files = {"metrics": str(self.metrics.path), "checkpoint": str(out / "checkpoint"),
                 "weights": str(self.weights), "config": str(out / "config.json")}
        files.update({f"plot_{k}": v for k, v in write_plots(
            read_metrics(self.metrics.path), state.evals + [dict(final, minutes=self.elapsed() / 60)],
            out, key=self.recipe.target_key, title=self.recipe.name).items()})
        files["plot"] = files["plot_reward"]
        if self.cfg.dump_trajectories:
            files["trajectories"] = str(out / "trajectories.jsonl")
        if self.trace:
            files["trace"] = str(self.tracer.write(out / "trace.json"))
        if self.cfg.select_best and state.best[0] >= 0:
            files["weights_selected"] = str(self.best_dir)
        result = RunResult(eval=final, eval_start=state.eval_start, recipe=self.recipe.name,
                           target_key=self.recipe.target_key, wall_minutes=0.0,
                           steps=state.step, policy_version=state.step, episodes=state.episodes,
                           evals=state.evals, failures=state.failures, files=files,
                           stopped=stopped, selected_step=selected)
        result.wall_minutes = self.elapsed() / 60
        (out / "result.json").write_text(json.dumps(result.to_json(), indent=2))
        return result

    async def _warm_start(self, base: str) -> None:
        """Supervised warm start in a short-lived `Learner` actor; writes `weights_start`."""
        import shutil

        from transformers import AutoTokenizer

        from earl.agents.chat import ChatCodec
        from earl.learner import Learner

        w, cfg = self.cfg.warm_start, self.cfg
        source = self.recipe.warm_start
        if w.steps == 0 or (source is None and not w.data):
            if self.start.exists():
                shutil.rmtree(self.start)
            shutil.copytree(base, self.start)
            return
        t0 = time.perf_counter()
        with self.tracer.span("warm_start", actor="trainer", steps=w.steps):
            codec = ChatCodec(AutoTokenizer.from_pretrained(base))
            if w.data:
                from earl.loop.transcripts import transcript_targets

                ids, tgts = transcript_targets(codec, w.data)
            else:
                assert source is not None
                ids, tgts = await source(codec, max(4 * w.batch_size, 512), cfg.seed)
            learner = await self.rt.spawn("warmstart", Learner, base, seed=cfg.seed,
                                          threads=cfg.placement.threads_per_actor, env=self.env)
            losses = await learner[0].warm_start.call_one(ids, tgts, w.steps, w.batch_size, w.lr)
            await learner[0].save_weights.call_one(str(self.start))
            await self.rt.stop(learner)
        self.log(f"warm start: {w.steps} steps on {len(ids)} transcripts, loss "
                 f"{losses[0]:.2f} -> {losses[-1]:.2f} ({time.perf_counter() - t0:.0f} s)")

    async def _spawn(self, version: int) -> None:
        from earl.algorithms.objective import LossConfig
        from earl.runtime.dock import Dock, IndexActor
        from earl.stages.reference import ReferenceActor, ReferenceConfig
        from earl.stages.trainer import TrainerActor, free_dist_url
        from earl.stages.trainer_torch import TrainerConfig

        cfg, a, pl, rt, env = self.cfg, self.cfg.algorithm, self.cfg.placement, self.rt, self.env
        with self.tracer.span("spawn_actors", actor="driver"):
            loss = LossConfig(clip_low=a.clip, clip_high=a.clip, kl_coef=a.kl_coef,
                              entropy_coef=a.entropy_coef, agg="token-mean",
                              off_policy=a.off_policy)  # type: ignore[arg-type]
            tcfg = TrainerConfig(model=str(self.start), lr=a.lr, betas=(0.9, 0.99),
                                 grad_clip=a.max_grad_norm, threads=pl.threads_per_actor,
                                 seed=cfg.seed, device=pl.device, temperature=a.temperature,
                                 micro_batch_tokens=pl.micro_batch_tokens, loss=loss,
                                 dist_url=free_dist_url() if pl.trainer > 1 else None)
            self.trainer = await rt.spawn("trainer", TrainerActor, tcfg, n=pl.trainer, env=env,
                                          slot=self._slot("trainer", pl.trainer))
            n_ref = self.n_reference
            stages = ["reference", "train"] if n_ref > 0 else ["train"]
            samples_per_batch = cfg.batch_size + a.self_imitation
            await rt.spawn("dock", IndexActor, stages=stages,
                           capacity=(cfg.max_policy_lag + 2) * samples_per_batch, env=env)
            self.reference = None
            if n_ref > 0:
                rcfg = ReferenceConfig(model=str(self.start), threads=pl.threads_per_actor,
                                       temperature=a.temperature)
                self.reference = await rt.spawn("reference", ReferenceActor, rcfg,
                                                n=n_ref, env=env,
                                                restart=self.healer.config.policy("reference"))
            dock = Dock(await rt.lookup("dock"))
            if cfg.selector == "on":  # its first plan sets up the rollout replicas it spawns
                from earl.loop.selection_actors import selection_for_run

                self.selection = await selection_for_run(self, dock)
                await self.selection.start(version, lambda s: self._spawn_rest(version, dock, s))
            else:
                await self._spawn_rest(version, dock, None)

    async def _spawn_rest(self, version: int, dock: Any, setting: Any) -> None:
        """Spawns the rollout replicas (with the selector's `setting`, else as configured), the
        producers, and the loop's parts over the actors."""
        from earl.loop.parts import ActorEvaluation, ActorProduction, ActorTraining
        from earl.recipe import critic_ref
        from earl.stages.advantages import AdvantageConfig
        from earl.stages.producer import ProducerActor, ProducerConfig
        from earl.stages.rollout import RolloutActor
        from earl.stages.vllm_engine import EngineConfig

        cfg, a, pl, rt, env = self.cfg, self.cfg.algorithm, self.cfg.placement, self.rt, self.env
        serve = self.weights if (self.weights / "config.json").is_file() and version else \
            self.start
        ecfg = EngineConfig(model=str(serve),
                            max_model_len=pl.context_window or cfg.model.max_model_len,
                            threads=pl.threads_per_actor, seed=cfg.seed,
                            kv_cache_gb=pl.kv_cache_gb, dtype="float32")
        if setting is not None:
            changes, n, slot = self.reconfigurer.rollout_spawn(setting)
            ecfg = replace(ecfg, **changes)
        else:
            n, slot = pl.rollout, self._slot("rollout", pl.rollout)
        self.rollout = await rt.spawn("rollout", RolloutActor, ecfg, version, n=n, env=env,
                                      slot=slot, restart=self.healer.config.policy("rollout"))
        if setting is not None and self.pool is not None:
            self.slot_memory.measure(setting.rollout_slots[:n], ecfg.kv_cache_gb * 1024)
        adv = AdvantageConfig(name=a.name, gamma=a.gamma, normalize_std=a.normalize_std,
                              self_imitation=a.self_imitation,
                              failed_reward=self.recipe.failed_reward)
        critic = self.recipe.critic if a.critic == "recipe" else None  # resolve_recipe checked
        pcfg = ProducerConfig(agent=self.ref, critic=critic_ref(critic) if critic else "",
                              model=str(self.start), rollout="rollout",
                              max_tokens=self.recipe.max_tokens, temperature=a.temperature,
                              max_total_tokens=self.recipe.max_total_tokens,
                              reward=absolute_ref(cfg.reward) if cfg.reward else "",
                              tool_timeout_s=cfg.tool_timeout_s,
                              dump=str(self.out / "trajectories.jsonl")
                              if cfg.dump_trajectories else "", advantage=adv)
        self.producers = await rt.spawn("producer", ProducerActor, pcfg, version,
                                        n=pl.producers, env=env,
                                        restart=self.healer.config.policy("producer"))
        columns = ["input_ids", "loss_mask", "advantages", "rollout_logprobs"]
        if self.n_reference > 0:
            columns.append("ref_logprobs")
        self.production = ActorProduction(self.producers, self.recipe.tasks,
                                          groups_per_batch=cfg.batch_size // cfg.group_size,
                                          group_size=cfg.group_size,
                                          shared=self.recipe.shared_group_task,
                                          over_sample=cfg.over_sample_groups,
                                          tracer=self.tracer)
        self.training = ActorTraining(self.trainer, self.rollout, dock, columns, self.tracer)
        self.evaluation = ActorEvaluation(self.producers, self.recipe, size=cfg.eval_games) \
            if self.recipe.eval else None
        from earl.loop.healing_parts import install

        install(self)  # restarted actors are rebuilt, lost groups re-played (earl.loop.healing)

    def _slot(self, actor: str, n: int) -> Any:
        """The device slots of `actor`'s `n` ranks (placement.slot_memory_mib), or None."""
        from earl.loop.selection_actors import run_slots

        if self.cfg.placement.slot_memory_mib <= 0:
            return None
        if self.pool is None:
            self.pool = run_slots(self.cfg.placement)
        return [self.pool.assign(f"{actor}{r}", actor) for r in range(n)]

    @property
    def n_reference(self) -> int:
        """Reference actors: only when a KL term reads their log-probs."""
        return self.cfg.placement.reference if self.cfg.algorithm.kl_coef > 0 else 0

    async def _save_trainer(self, folder: str) -> None:
        with self.tracer.span("checkpoint", actor="trainer"):
            await self.trainer.save_checkpoint.call(folder)

    async def _producer_states(self, batch: int | None) -> list[dict[str, object]]:
        return await self.production.states(batch)

    async def _on_eval(self, ev: dict[str, float]) -> None:
        """Log a validation eval; keep the weights of the best one (`select_best`)."""
        self.log(f"eval @ step {int(ev['step'])}: {_fmt(ev, self.recipe.target_key)}")
        if self.cfg.select_best and self.state.best[0] == int(ev["step"]):
            await self.trainer[0].save_hf.call_one(str(self.best_dir))

    _reference_s = 0.0  # reference busy seconds during the last step

    async def _reference_busy(self) -> None:
        if self.reference is not None:
            total = sum(await self.reference.busy_seconds.call())
            self._reference_s, self._reference_total = total - self._reference_total, total

    _reference_total = 0.0

    async def _observe(self, r: StepRecord) -> None:
        from earl.observe import progress_line

        await self._reference_busy()
        assert self.metrics is not None
        eps = r.result.episodes
        n = max(len(eps), 1)
        tokens = sum(e.tokens for e in eps)
        generated = sum(e.generated for e in eps)
        stale = (sum((r.version - 1) * e.generated - e.version_sum for e in eps) / generated
                 if generated else 0.0)
        rec: dict[str, float | int | str] = {
            **{f"train/{k}": v for k, v in r.train.items()}, "step": r.version,
            "steps": self.cfg.steps, "episodes": len(eps),
            "reward": float(np.mean([0.0 if e.reward is None else e.reward for e in eps]))
            if eps else 0.0,
            "failed_rate": sum(e.failed for e in eps) / n,
            "truncated_rate": sum(e.truncated for e in eps) / n,
            "tokens_per_s": tokens / max(r.step_s, 1e-6), "staleness": stale,
            "ctx_mean": tokens / n, "ctx_max": max((e.tokens for e in eps), default=0),
            "turns_mean": sum(e.turns for e in eps) / n,
            "groups_cut": len(r.result.cut),
            "step_s": r.step_s, "rollout_s": r.result.seconds, "lr_scale": r.lr_scale,
            **self.training.seconds, "reference_s": self._reference_s,
            "wall_s": self.elapsed()}
        rec.update(_info_rates(eps))
        rec.update(self.healer.metrics())  # restarts/<actor>, rewinds
        self.metrics.log(rec)
        self.log(progress_line(rec))


def _info_rates(eps: list[Any]) -> dict[str, float]:
    """Means of numeric `info` values and rates of string ones (`info/outcome=win`)."""
    out: dict[str, float] = {}
    n = max(len(eps), 1)
    for e in eps:
        for k, v in e.info.items():
            if k == "seed":
                continue
            if isinstance(v, str):
                out[f"info/{k}={v}"] = out.get(f"info/{k}={v}", 0.0) + 1 / n
            else:
                out[f"info/{k}"] = out.get(f"info/{k}", 0.0) + float(v) / n
    return out


def _fmt(ev: dict[str, float], key: str) -> str:
    shown = {k: v for k, v in ev.items() if k not in ("step", "minutes", "seconds")}
    head = f"{key} {ev.get(key, float('nan')):.3f}"
    rest = ", ".join(f"{k} {v:.3f}" for k, v in shown.items() if k != key)
    return f"{head} ({rest})" if rest else head
