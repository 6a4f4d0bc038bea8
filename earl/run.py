"""The asynchronous RL pipeline behind `earl train`: rollout -> reward/advantage -> trainer ->
weights back to rollout, with a bounded policy lag.

Actors (each its own process, joined by the actor runtime): `RolloutActor` (vLLM on CPU, from
`earl.runtime.rollout`), `ReferenceActor`, `TrainerActor`, the transfer dock (`IndexActor` plus
a `WarehouseActor` shard), and a short-lived warm-start `Learner` (`earl.learner`). The driver
runs the agent coroutines (`earl.agents`), which call the rollout actor through `RolloutClient`.
One sample's path: agent coroutine -> rollout actor (tokens) -> driver (advantages) -> dock
shard -> reference (adds "ref_logprobs" on its own shard) -> trainer, which fetches the
columns straight from both shards -> weights back to the rollout actor. The driver carries
only metadata after the put.

Rollout never waits for training except at the staleness bound: batch `b` may start once the
rollout holds policy version `>= b - max_policy_lag` (0 = synchronous baseline). Each batch is
`batch_size / group_size` groups; a group is `group_size` games from one seed. The reward stage
computes per-move advantages (`earl.algorithms.per_turn_advantages`) once a batch is complete.
With a lag >= 1 the driver looks one batch ahead: batch `b + 1` goes through the critic, the
dock and the reference while the trainer works on batch `b`.

This module does not define losses (earl.algorithms), models (earl.models) or the CLI.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from earl.config import RunConfig, lr_scale, to_dict
from earl.critic import TabularCritic
from earl.experience import batch_columns, warm_start_data
from earl.observe import Metrics, Tracer, TrajectoryDump, progress_line, read_metrics, write_plots
from earl.trajectory import Trajectory

TRAIN_SEED = 10_000  # training game seeds: TRAIN_SEED + group cursor (even = agent opens)


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What `train` returns (and `earl train --json` prints)."""

    eval: dict[str, float | int]
    wall_minutes: float
    steps: int
    policy_version: int
    games: int
    evals: list[dict[str, float]] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)
    stopped: str = ""
    selected_step: int = -1

    def to_json(self) -> dict[str, object]:
        return {"eval": self.eval, "wall_minutes": round(self.wall_minutes, 3),
                "steps": self.steps, "policy_version": self.policy_version, "games": self.games,
                "stopped": self.stopped, "selected_step": self.selected_step,
                "evals": self.evals, **self.files}


def model_folder(cfg: RunConfig, out: Path) -> str:
    """The starting model: `model.path`, or a seeded tiny char-level model built once."""
    if cfg.model.path:
        return cfg.model.path
    from earl.models.tiny import build_tiny_model

    m = cfg.model
    path = out / f"tiny_h{m.hidden}_l{m.layers}_s{m.seed}_hd32"
    if not (path / "config.json").is_file():
        # A larger init scale than HF's 0.02 shortens the warm start's copy-the-digit plateau.
        heads = max(m.hidden // 32, 1)  # vLLM's CPU attention needs head_dim >= 32
        build_tiny_model(path, seed=m.seed, hidden=m.hidden, layers=m.layers, heads=heads,
                         kv_heads=heads,
                         intermediate=3 * m.hidden, max_positions=max(m.max_model_len, 512),
                         init_std=0.1)
    return str(path)


@dataclass(slots=True)
class Prepared:
    """A batch whose samples are in the dock, scored by the reference, ready to train on."""

    trajs: list[Trajectory]
    first_adv: list[float]
    samples: int


class _State:
    """Driver-side run state that a checkpoint restores (the dock cursor is `step`)."""

    def __init__(self) -> None:
        self.step = 0            # batches consumed by the trainer == policy version
        self.games = 0
        self.wall_before = 0.0   # wall seconds of earlier (interrupted) segments
        self.evals: list[dict[str, float]] = []
        self.critic: TabularCritic | None = None
        self.best: tuple[int, float] = (-1, -1.0)  # (step, validation win+draw)

    def to_dict(self) -> dict[str, object]:
        return {"step": self.step, "games": self.games, "wall_before": self.wall_before,
                "evals": self.evals, "best": list(self.best)}


async def train(cfg: RunConfig, *, resume: bool = False, trace: bool = False,
                log: Callable[[str], None] = print) -> RunResult:
    """Run the whole job; returns the final evaluation and the paths of every output file."""
    from transformers import AutoTokenizer

    from earl.agents.chat import ChatCodec
    from earl.agents.rollout import RolloutConfig, run_agent
    from earl.engine import SamplingParams
    from earl.eval import EVAL_SEED, evaluate, make_agent
    from earl.runtime import Runtime
    from earl.runtime.dock import IndexActor, WarehouseActor
    from earl.runtime.reference import ReferenceActor
    from earl.runtime.rollout import RolloutActor, RolloutClient
    from earl.runtime.trainer import TrainerActor, free_dist_url
    from earl.runtime.vllm_engine import EngineConfig

    t_start = time.perf_counter()
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt_dir = out / "checkpoint"
    state_path = ckpt_dir / "state.json"
    state = _State()
    if resume:
        if not state_path.is_file():
            raise ValueError(f"--resume: no checkpoint in {str(ckpt_dir)!r}; run without "
                             "--resume first (or point --output-dir at that run)")
        saved = json.loads(state_path.read_text())
        state.step, state.games = int(saved["step"]), int(saved["games"])
        state.wall_before, state.evals = float(saved["wall_before"]), list(saved["evals"])
        state.best = (int(saved["best"][0]), float(saved["best"][1]))
    ckpt_dir.mkdir(exist_ok=True)
    critic = TabularCritic(alpha=cfg.algorithm.critic_alpha, lam=cfg.algorithm.critic_lambda,
                           q_weight=cfg.algorithm.critic_q_weight) \
        if cfg.algorithm.critic == "tabular" else None
    if resume and critic is not None and (ckpt_dir / "critic.json").is_file():
        critic.load_state_dict(json.loads((ckpt_dir / "critic.json").read_text()))
    state.critic = critic
    (out / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    a, pl = cfg.algorithm, cfg.placement
    tracer = Tracer(trace)
    metrics = Metrics(out, append=resume)
    dump = TrajectoryDump(out, append=resume) if cfg.dump_trajectories else None
    base = model_folder(cfg, out)
    codec = ChatCodec(AutoTokenizer.from_pretrained(base))
    env = {"OMP_NUM_THREADS": str(pl.threads_per_actor), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    loss = {"clip_low": a.clip, "clip_high": a.clip, "kl_coef": a.kl_coef,
            "entropy_coef": a.entropy_coef, "agg": "token-mean"}
    weights = out / "weights"       # the trained policy (HF folder), written at the end
    start = out / "weights_start"   # the warm-started policy: trainer start, KL reference
    best_dir = out / "weights_best"  # the policy with the best validation eval so far
    elapsed = lambda: state.wall_before + time.perf_counter() - t_start
    budget_s = cfg.time_limit_minutes * 60

    async with Runtime() as rt:
        if not resume:
            await _warm_start(rt, cfg, codec, base, start, env, tracer, log, elapsed)
        with tracer.span("spawn_actors", actor="driver"):
            tcfg = {"model": str(start), "lr": a.lr, "betas": (0.9, 0.99),
                    "grad_clip": a.max_grad_norm, "threads": pl.threads_per_actor,
                    "seed": cfg.seed, "device": pl.device, "temperature": a.temperature,
                    "micro_batch_tokens": 1 << 16, "loss": loss,
                    "dist_url": free_dist_url() if pl.trainer > 1 else None}
            trainer = await rt.spawn("trainer", TrainerActor, tcfg, n=pl.trainer, env=env)
            serve = start  # the folder the rollout engine loads first
            if resume:
                await trainer.load_checkpoint.call(str(ckpt_dir / "trainer"))
                serve = Path(await trainer[0].save_hf.call_one(str(weights)))
                log(f"resumed from step {state.step} ({ckpt_dir})")
            # The transfer dock: the driver's samples go to a warehouse shard, the reference
            # adds "ref_logprobs" on its own shard, the trainer fetches straight from both.
            stages = ["reference", "train"] if pl.reference > 0 else ["train"]
            await rt.spawn("dock", IndexActor, stages=stages,
                           capacity=2 * (cfg.batch_size + a.self_imitation), env=env)
            warehouse = await rt.spawn("rollout-dock", WarehouseActor, "dock", env=env)
            train_columns = ["input_ids", "loss_mask", "advantages", "rollout_logprobs"]
            if pl.reference > 0:
                train_columns.append("ref_logprobs")
            reference = None
            if pl.reference > 0:
                rfcfg = {"model": str(start), "threads": pl.threads_per_actor, "temperature": a.temperature}
                reference = await rt.spawn("reference", ReferenceActor, rfcfg,
                                           n=pl.reference, env=env)
            ecfg = EngineConfig(model=str(serve), max_model_len=cfg.model.max_model_len,
                                threads=pl.threads_per_actor, seed=cfg.seed, kv_cache_gb=0.25,
                                dtype="float32")
            rollout = await rt.spawn("rollout", RolloutActor, to_dict(ecfg), state.step,
                                     n=pl.rollout, env=env)
        engine = RolloutClient(rollout)
        engine.note_version(state.step)
        agent = make_agent(a.reward_win, a.reward_draw, a.reward_loss)
        rcfg = RolloutConfig(sampling=SamplingParams(max_tokens=4, temperature=a.temperature,
                                                     stop_token_ids=codec.stop_ids))
        version = state.step
        version_changed = asyncio.Condition()
        groups_per_batch = cfg.batch_size // cfg.group_size
        batches: dict[int, asyncio.Future[list[Trajectory]]] = {}
        loop = asyncio.get_running_loop()
        producing: list[asyncio.Task[None]] = []

        def batch_future(b: int) -> asyncio.Future[list[Trajectory]]:
            return batches.setdefault(b, loop.create_future())

        async def play_group(b: int, g: int) -> list[Trajectory]:
            cursor = b * groups_per_batch + g
            t0 = time.perf_counter()
            # GRPO groups share a prompt (seed); with the critic every game gets its own seed.
            seeds = [TRAIN_SEED + cursor if critic is None else
                     TRAIN_SEED + cursor * cfg.group_size + i for i in range(cfg.group_size)]
            trajs = await asyncio.gather(*(
                run_agent(agent, seeds[i], engine=engine, codec=codec, config=rcfg,
                          sample_id=f"s{cursor}-{i}", group_id=f"g{cursor}")
                for i in range(cfg.group_size)))
            for t, seed in zip(trajs, seeds, strict=True):
                engine.end_session(t.sample_id)
                t.info["seed"] = seed
            tracer.add("group", actor=f"rollout-agents-{g % 4}", start=t0,
                       end=time.perf_counter(), batch=b)
            return list(trajs)

        rollout_s: dict[int, float] = {}  # batch -> seconds its games took to play

        async def produce_batch(b: int) -> None:
            t0 = time.perf_counter()
            groups = await asyncio.gather(*(play_group(b, g) for g in range(groups_per_batch)))
            tracer.add(f"batch {b}", actor="rollout", start=t0, end=time.perf_counter())
            rollout_s[b] = time.perf_counter() - t0
            batch_future(b).set_result([t for grp in groups for t in grp])

        async def producer(tg: asyncio.TaskGroup, stop: asyncio.Event) -> None:
            for b in range(state.step, cfg.steps):
                def may_start(b: int = b) -> bool:  # the staleness bound, or shutting down
                    return version >= b - cfg.max_policy_lag or stop.is_set()

                async with version_changed:
                    await version_changed.wait_for(may_start)
                if stop.is_set():
                    return
                producing.append(tg.create_task(produce_batch(b)))

        async def run_eval(games: int, seed: int) -> dict[str, float]:
            t0 = time.perf_counter()
            with tracer.span("eval", actor="driver", games=games):
                res = await evaluate(engine, codec, games=games, seed=seed)
            d = res.to_dict()
            d.update(minutes=elapsed() / 60, step=float(version),
                     seconds=round(time.perf_counter() - t0, 3))
            return d

        async def prepare(b: int, ahead: bool = False) -> Prepared:
            """Batch `b`'s games -> critic + advantages -> dock -> reference scores."""
            trajs = await batch_future(b)
            batches.pop(b)
            cols, first_adv, sources = batch_columns(trajs, cfg, critic)
            with tracer.span("dock_put", actor="driver", step=b + 1, ahead=ahead):
                n = await _put_batch(warehouse, b, trajs, cols, sources)
            if reference is not None:
                with tracer.span("reference", actor="reference", step=b + 1):
                    await reference.score_dock.choose(n, "reference", trained_only=True)
            return Prepared(trajs, first_adv, n)

        def look_ahead(b: int) -> bool:
            """Prepare batch `b + 1` while `b` trains? Only when the staleness bound lets its
            games exist already, and not across a checkpoint (whose critic must be step b's)."""
            return cfg.max_policy_lag >= 1 and b + 1 < cfg.steps and \
                (b + 1) % cfg.checkpoint_every != 0

        last_t = time.perf_counter()

        async def learn(b: int, p: Prepared) -> None:
            """Train on batch `b`, push the weights, log the step."""
            nonlocal version, last_t
            scale = lr_scale(a, max(elapsed() / budget_s, (b + 1) / cfg.steps))
            with tracer.span("train_step", actor="trainer", step=b + 1):
                m = await _train(trainer, p.samples, train_columns, scale)
            with tracer.span("push_weights", actor="trainer", version=b + 1):
                await trainer.push_weights.call(rollout, b + 1)
            async with version_changed:
                version = b + 1
                engine.note_version(version)
                version_changed.notify_all()
            trajs = p.trajs
            state.step, state.games = version, state.games + len(trajs)
            now = time.perf_counter()
            gen_lags = [version - 1 - v for t in trajs for v, mk in
                        zip(t.versions, t.loss_mask, strict=True) if mk]
            outcomes = [str(t.info.get("outcome", "loss")) for t in trajs]
            lens = [len(t.token_ids) for t in trajs]
            rec: dict[str, float | int | str] = {
                **{f"train/{k}": v for k, v in m.items()}, "step": version, "steps": cfg.steps,
                "games": state.games,
                "reward": float(np.mean([t.reward or 0.0 for t in trajs])),
                "win_rate": outcomes.count("win") / len(trajs),
                "draw_rate": outcomes.count("draw") / len(trajs),
                "illegal_rate": float(np.mean([int(t.info.get("illegal", 0)) for t in trajs])),
                "tokens_per_s": sum(lens) / max(now - last_t, 1e-6),
                "staleness": float(np.mean(gen_lags)) if gen_lags else 0.0,
                "ctx_mean": float(np.mean(lens)), "ctx_max": max(lens),
                "step_s": now - last_t, "rollout_s": rollout_s.pop(b, 0.0),
                "wall_s": elapsed()}
            last_t = now
            metrics.log(rec)
            log(progress_line(rec))
            if dump is not None:
                dump.write(version, trajs, p.first_adv)

        stopped = "steps"
        async with asyncio.TaskGroup() as tg:
            stop = asyncio.Event()
            prod = tg.create_task(producer(tg, stop))
            ready: Prepared | None = None
            for b in range(state.step, cfg.steps):
                p = ready if ready is not None else await prepare(b)
                # Look-ahead: batch b+1 goes through critic, dock and reference while b trains.
                ahead = tg.create_task(prepare(b + 1, ahead=True)) if look_ahead(b) else None
                await learn(b, p)
                do_eval = cfg.eval_every > 0 and version % cfg.eval_every == 0
                if do_eval:
                    ev = await run_eval(cfg.eval_games, EVAL_SEED + 2_000_000 * version)
                    state.evals.append(ev)
                    log(f"eval @ step {version}: win+draw {ev['win_draw_rate']:.3f} "
                        f"(win {ev['win_rate']:.3f}, illegal {ev['illegal_rate']:.3f})")
                    if cfg.select_best and ev["win_draw_rate"] > state.best[1]:
                        await trainer[0].save_hf.call_one(str(best_dir))
                        state.best = (version, ev["win_draw_rate"])
                if version % cfg.checkpoint_every == 0 or version == cfg.steps:
                    with tracer.span("checkpoint", actor="trainer"):
                        await _checkpoint(trainer, ckpt_dir, state, elapsed())
                if do_eval and cfg.target_win_draw and \
                        state.evals[-1]["win_draw_rate"] >= cfg.target_win_draw:
                    stopped = "target"
                elif elapsed() > budget_s:
                    stopped = "time_limit"
                ready = await ahead if ahead is not None else None
                if stopped != "steps":
                    if ready is not None:  # its games are in the critic: train on them too
                        await learn(b + 1, ready)
                    break
            stop.set()
            async with version_changed:
                version_changed.notify_all()
            await prod
            for task in producing:  # rollouts of batches that will not be trained on
                task.cancel()
        if stopped != "steps":
            with tracer.span("checkpoint", actor="trainer"):
                await _checkpoint(trainer, ckpt_dir, state, elapsed())
        await trainer[0].save_hf.call_one(str(weights))
        if cfg.select_best and state.best[0] >= 0 and cfg.eval_every > 0:
            # Model selection on the validation evals (their own seeds); the reported eval
            # below uses fresh seeds, so selection does not inflate it.
            if not state.evals or int(state.evals[-1]["step"]) != version:
                ev = await run_eval(cfg.eval_games, EVAL_SEED + 2_000_000 * version)
                state.evals.append(ev)
                if ev["win_draw_rate"] > state.best[1]:
                    await trainer[0].save_hf.call_one(str(best_dir))
                    state.best = (version, ev["win_draw_rate"])
            if state.best[0] != version:
                await rollout.update_weights_from_path.call(str(best_dir), state.best[0],
                                                            "drain")
                log(f"final policy: step {state.best[0]} (best validation win+draw "
                    f"{state.best[1]:.3f})")
        final = await run_eval(cfg.eval_games, EVAL_SEED)
        await rollout.close.call()
    metrics.close()
    if dump is not None:
        dump.close()
    wall = elapsed()
    files = {"metrics": str(metrics.path), "checkpoint": str(ckpt_dir / "trainer"),
             "weights": str(weights), "config": str(out / "config.json")}
    files.update({f"plot_{k}": v for k, v in
                  write_plots(read_metrics(metrics.path), state.evals + [final], out).items()})
    files["plot"] = files["plot_reward"]
    if dump is not None:
        files["trajectories"] = str(dump.path)
    if trace:
        files["trace"] = str(tracer.write(out / "trace.json"))
    if cfg.select_best and state.best[0] >= 0:
        files["weights_selected"] = str(best_dir)
    result = RunResult(selected_step=state.best[0] if cfg.select_best else state.step,
                       eval={k: final[k] for k in ("games", "win_rate", "draw_rate",
                                                    "loss_rate", "illegal_rate",
                                                    "win_draw_rate", "first_win_draw",
                                                    "second_win_draw")},
                       wall_minutes=wall / 60, steps=state.step, policy_version=state.step,
                       games=state.games, evals=state.evals, files=files, stopped=stopped)
    (out / "result.json").write_text(json.dumps(result.to_json(), indent=2))
    return result


async def _warm_start(rt, cfg: RunConfig, codec, base: str, start: Path,
                      env: dict[str, str], tracer: Tracer, log: Callable[[str], None],
                      elapsed: Callable[[], float]) -> None:
    """Supervised warm start in a short-lived `Learner` actor; writes the HF folder `start`
    (the RL trainer's starting point and the reference's KL anchor)."""
    from earl.learner import Learner

    w = cfg.warm_start
    if w.steps == 0:  # no warm start: the RL trainer starts from the model as it is
        import shutil

        if start.exists():
            shutil.rmtree(start)
        shutil.copytree(base, start)
        return
    with tracer.span("warm_start", actor="trainer", steps=w.steps):
        learner = await rt.spawn("warmstart", Learner, base, seed=cfg.seed,
                                 threads=cfg.placement.threads_per_actor, env=env)
        ids, tgts = await warm_start_data(codec, max(4 * w.batch_size, 512), cfg.seed)
        losses = await learner[0].warm_start.call_one(ids, tgts, w.steps, w.batch_size, w.lr)
        log(f"warm start: {w.steps} steps on random legal games, loss "
            f"{losses[0]:.2f} -> {losses[-1]:.2f} ({elapsed():.0f} s)")
        await learner[0].save_weights.call_one(str(start))
        await rt.stop(learner)


async def _put_batch(warehouse, b: int, trajs: list[Trajectory],
                     cols: dict[str, list[np.ndarray]], sources: list[int]) -> int:
    """Put batch `b`'s samples in the dock (whole groups: a game's group, with the
    self-imitation samples made from its games); returns how many."""
    sizes: dict[str, int] = {}
    for i in sources:
        sizes[trajs[i].group_id] = sizes.get(trajs[i].group_id, 0) + 1
    await asyncio.gather(*(
        warehouse[0].put.call_one(f"b{b:06d}-{j:04d}", {k: v[j] for k, v in cols.items()},
                                  trajs[i].group_id, sizes[trajs[i].group_id])
        for j, i in enumerate(sources)))
    return len(sources)


async def _train(trainer, n: int, columns: list[str], scale: float) -> dict[str, float]:
    """One optimizer step (LR times `scale`) on the `n` oldest ready samples in the dock; with
    several trainer ranks each leases its share."""
    world = len(trainer)
    shares = [n // world + (r < n % world) for r in range(world)]
    results = await asyncio.gather(*(
        trainer[r].train_from_dock.call_one(shares[r], columns, whole_groups=world == 1,
                                            lr_scale=scale)
        for r in range(world)))
    return results[0]


async def _checkpoint(trainer, ckpt_dir: Path, state: _State, wall: float) -> None:
    """Trainer state first, then the driver state that points at it (atomic renames)."""
    await trainer.save_checkpoint.call(str(ckpt_dir / "trainer"))
    if state.critic is not None:
        tmp = ckpt_dir / "critic.json.tmp"
        tmp.write_text(json.dumps(state.critic.state_dict()))
        tmp.replace(ckpt_dir / "critic.json")
    d = state.to_dict()
    d["wall_before"] = wall
    tmp = ckpt_dir / "state.json.tmp"
    tmp.write_text(json.dumps(d))
    tmp.replace(ckpt_dir / "state.json")
