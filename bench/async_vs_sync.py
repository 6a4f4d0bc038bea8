"""Async (max_policy_lag > 0) vs the best synchronous (lag 0) `earl train`: same recipe, model,
seed, steps and budget, each mode repeated, runs interleaved so machine drift hits every mode.

    python bench/async_vs_sync.py --json            # 7 runs of a 4.5-minute loop (~40 min)
    python bench/async_vs_sync.py --json --quick    # 10 steps per run (~10-20 min on 2 cores)
    python bench/async_vs_sync.py --workload agentic --json [--quick]

`--workload agentic` (bench/_agentic_workload.py) is where asynchrony matters for the reason it
matters in practice: multi-turn episodes with heavy-tailed turn counts whose every turn waits on
a tool with real latency (the sandboxed `python` tool, a lognormal-latency lookup). A
synchronous pipeline idles while its slowest trajectories wait; the async run keeps episodes
going across steps with partial rollouts (`earl train`'s default): `--groups` groups out at once
(96 of 4 here: 384 episodes, as bench/peers.py's 48 of 8), `--rollout` replicas (1, as
bench/peers.py), `--lag` 16 (the bound bench/peers.py gives both sides). Quality is the agent's mean reward on held-out tasks
(greedy; the share of turns that answer the task's key, ~0.1 for a guess), `final_quality` in
both objects; `turns_per_trajectory` and `model_tokens_per_trajectory` (over the trained
trajectories of the steady state) say whether both modes did the same work.

The sync baseline gets its best configuration, chosen in the same run. On a waiting-bound
workload concurrency alone can decide the result, so sync is offered concurrency too: play
several batches as one round (`batch_size` x rounds, then one step trains them; tic-tac-toe:
1 and L+1 rounds, agentic: 1, 5, 10, 20, 40 and 80, i.e. 32 to 2,560 episodes in flight). Its stages
do not overlap, so it may use every core: `--sync-threads` per actor (`placement.threads`; 1
and 2, agentic 1) and `--sync-rollout` replicas (agentic 1 and 2). The first round runs every
sync configuration and the fastest is the baseline for the remaining repeats, interleaved with
async (a configuration 10x slower on a loaded machine would otherwise dominate the run time).
The async run uses 1 thread per actor (its stages overlap).

Throughput is steady state: trajectories per second between the run's own per-step log lines,
after the pipeline has filled (async: from the end of step in_flight / batch_size, L+1 with
whole batches: the batches started before the first step was trained are not counted; sync:
from the end of step 1), so start-up, warm start and the final eval are not counted; evals
during the loop are off. Quality comes from the final greedy eval on at least 200 held-out
episodes, the same in every run. Prints one JSON object:

- ``async`` / ``sync_best``: ``trajectories_per_s`` (mean over repeats), ``in_flight``
  (trajectories played at once at most), ``threads``, the runs, ``spread`` ((max - min) / mean),
  ``cores_used`` (CPU seconds of the process tree per wall second), ``final_quality``.
- ``sync_sweep``: every sync configuration measured (the losers only in the first round).
- ``final_quality_delta``: async minus best sync final quality at equal wall clock (the same
  budget); ``quality_at_equal_updates``: at an equal number of optimizer updates (full mode: an
  async run per repeat stopped at the steps the best sync run took, its final eval beside
  the sync run's; a sync step may train several batches, so async then saw fewer samples).
- ``ratio_steady_state``: async / best sync trajectories/s (means); ``ratios_per_repeat``: the
  same per interleaved repeat; ``core_limit``: cores / the best sync configuration's cores_used.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import redirect_stdout

import _results


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and all its descendants."""
    import psutil

    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:  # exited between the listing and the read
            continue
        total += t.user + t.system
    return total


def trained_work(metrics: str, fill: int) -> dict[str, float]:
    """Turns and model tokens per trained trajectory over the steady-state steps (after `fill`),
    weighted by each step's episodes: the work both modes must do alike."""
    with open(metrics) as f:
        rows = [json.loads(x) for x in f if x.strip()]
    steps = [r for r in rows if "turns_mean" in r and "step" in r][fill + 1:]
    n = sum(int(r["episodes"]) for r in steps)
    if not n:
        return {"turns_per_trajectory": float("nan"), "model_tokens_per_trajectory": float("nan")}
    return {k: round(sum(float(r[src]) * int(r["episodes"]) for r in steps) / n, 3)
            for k, src in (("turns_per_trajectory", "turns_mean"),
                           ("model_tokens_per_trajectory", "generated_mean"))}


def run_once(lag: int, threads: int, rounds: int, overrides: list[str], out: str,
             quality_key: str = "win_draw_rate", replicas: int = 1,
             groups: int = 0, steady: bool = True) -> dict[str, object]:
    """One `earl train` run (`rounds` batches per step, `replicas` rollout engines; async:
    `groups` out at once, 0 for the config's default; sync ignores it); its steady-state
    throughput, or (`steady` false: a run stopped at a step count) its final quality alone."""
    from earl.config import load_config
    from earl.run import train

    base = load_config(None, overrides)
    steps = max(3, -(-base.steps // rounds)) if base.steps < 100000 else base.steps
    # sync: whole batches (its stages take turns); async: `earl train`'s default, partial
    # rollouts
    mode = ["--partial_rollouts=off"] if lag == 0 else \
        [f"--max_concurrent_groups={groups}"] if groups else []
    cfg = load_config(None, [*overrides, *mode, f"--max_policy_lag={lag}", f"--output_dir={out}",
                             f"--placement.threads={threads}", f"--placement.rollout={replicas}",
                             f"--batch_size={base.batch_size * rounds}", f"--steps={steps}"])
    marks: list[tuple[float, float]] = []  # (wall, CPU of the whole process tree) per step

    def on_log(line: str) -> None:
        if line.startswith("step "):  # one progress line per trained step
            marks.append((time.perf_counter(), tree_cpu_s()))

    t0 = time.perf_counter()
    with redirect_stdout(io.StringIO()):
        res = train(cfg, log=on_log)
    wall = time.perf_counter() - t0
    # episodes out at once: the groups partial rollouts let out, else lag + 1 whole batches;
    # async: the marks of the first in_flight / batch_size steps include batches started
    # before the first step was trained
    in_flight = cfg.max_concurrent_groups * cfg.group_size or cfg.batch_size * (lag + 1)
    fill = -(-in_flight // cfg.batch_size) - 1
    if not steady:
        return {"steps": len(marks), "final_quality": res.eval[quality_key],
                "wall_s": round(wall, 1)}
    if len(marks) < fill + 2:
        raise RuntimeError(f"{len(marks)} step lines logged in {wall:.0f} s (steps {res.steps}, "
                           f"stopped by {getattr(res, 'stopped', '?')!r}); the steady state "
                           f"starts after step {fill + 1}: raise --steps or the time limit")
    loop_s = marks[-1][0] - marks[fill][0]
    trajectories = (len(marks) - 1 - fill) * cfg.batch_size
    return {"max_policy_lag": lag, "threads_per_actor": threads, "rollout_replicas": replicas,
            "max_concurrent_groups": cfg.max_concurrent_groups, "steps": len(marks),
            "batch_size": cfg.batch_size,
            "in_flight": in_flight,
            "trajectories": trajectories, "loop_seconds": round(loop_s, 2),
            "trajectories_per_s": round(trajectories / loop_s, 2),
            "cores_used": round((marks[-1][1] - marks[fill][1]) / loop_s, 3),
            "final_win_draw": res.eval.get("win_draw_rate", float("nan")),
            "final_quality": res.eval[quality_key], "wall_s": round(wall, 1),
            **trained_work(res.files["metrics"], fill)}


def summarize(runs: list[dict[str, object]]) -> dict[str, object]:
    """Mean and spread over the repeats of one configuration."""
    tps = [float(r["trajectories_per_s"]) for r in runs]  # type: ignore[arg-type]
    mean = statistics.fmean(tps)
    return {"max_policy_lag": runs[0]["max_policy_lag"],
            "threads": runs[0]["threads_per_actor"], "in_flight": runs[0]["in_flight"],
            "rollout_replicas": runs[0]["rollout_replicas"],
            "max_concurrent_groups": runs[0]["max_concurrent_groups"],
            **{k: round(statistics.fmean(float(r[k]) for r in runs), 3)  # type: ignore[arg-type]
               for k in ("turns_per_trajectory", "model_tokens_per_trajectory")},
            "batch_size": runs[0]["batch_size"], "repeats": len(runs),
            "trajectories_per_s": round(mean, 2), "trajectories_per_s_runs": tps,
            "trajectories_per_s_stdev": round(statistics.stdev(tps), 2) if len(tps) > 1 else 0.0,
            "spread": round((max(tps) - min(tps)) / mean, 3),
            "cores_used": round(statistics.fmean(
                float(r["cores_used"]) for r in runs), 3),  # type: ignore[arg-type]
            "final_win_draw": round(statistics.fmean(
                float(r["final_win_draw"]) for r in runs), 4),  # type: ignore[arg-type]
            "final_win_draw_runs": [r["final_win_draw"] for r in runs],
            "final_quality": round(statistics.fmean(
                float(r["final_quality"]) for r in runs), 4),  # type: ignore[arg-type]
            "final_quality_runs": [r["final_quality"] for r in runs],
            "steps": [r["steps"] for r in runs], "wall_s": [r["wall_s"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="a short loop per run")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for `earl bench`)")
    p.add_argument("--workload", choices=("tictactoe", "agentic"), default="tictactoe")
    p.add_argument("--lag", type=int, default=None,
                   help="async run's max_policy_lag (default 1; 4 for --workload agentic)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (>= 1)")
    p.add_argument("--minutes", type=float, default=4.5, help="loop budget per run (full mode)")
    p.add_argument("--sync-threads", default=None,
                   help="threads per actor tried for the sync baseline (the best one is used; "
                        "default 1,2; agentic 1: 2 threads lost at 32 and 160 in flight, "
                        "async_vs_sync_agentic-2026-11-26.json, and 2 replicas are tried)")
    p.add_argument("--rollout", type=int, default=None,
                   help="the async run's rollout replicas (default 1, as bench/peers.py)")
    p.add_argument("--groups", type=int, default=None,
                   help="the async run's max_concurrent_groups (default 0, the config's; 96 "
                        "for agentic: 384 episodes out, as bench/peers.py's 48 groups of 8)")
    p.add_argument("--sync-rollout", default=None,
                   help="rollout replicas tried for the sync baseline (default 1; agentic 1,2)")
    p.add_argument("--sync-rounds", default="",
                   help="batches per sync step tried (default: 1 and lag+1, the async run's "
                        "batches in flight; agentic 1, 5, 10, 20, 40, 80)")
    _results.add_flag(p)
    a = p.parse_args(argv)
    begun = _results.start()
    if a.repeats < 1:
        p.error("--repeats must be >= 1")
    if a.lag is None:
        a.lag = 16 if a.workload == "agentic" else 1
    if a.lag < 1:
        p.error("--lag must be >= 1 (the async run)")
    agentic = a.workload == "agentic"
    a.sync_threads = a.sync_threads or ("1" if agentic else "1,2")
    a.sync_rollout = a.sync_rollout or ("1,2" if agentic else "1")
    a.rollout = a.rollout or 1
    a.groups = (96 if agentic else 0) if a.groups is None else a.groups
    sync_threads = [int(x) for x in a.sync_threads.split(",")]
    sync_replicas = [int(x) for x in a.sync_rollout.split(",")]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # No evals inside the loop (they would pause it), so the target stop never fires and both
    # modes run the same steps (quick) or the same loop budget (full); the final eval compares.
    if a.quick:
        common = ["--steps=10", "--time_limit_minutes=30", "--warm_start.steps=0",
                  "--batch_size=32", "--group_size=8", "--eval_every=0", "--eval_games=200",
                  "--seed=0"]
    else:
        common = ["--steps=100000", f"--time_limit_minutes={a.minutes}", "--eval_every=0",
                  "--eval_games=200", "--seed=0"]
    quality_key = "win_draw_rate"
    tmp_tasks = tempfile.TemporaryDirectory(prefix="earl-agentic-")
    if a.workload == "agentic":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _agentic_workload import write_tasks

        here = os.path.dirname(os.path.abspath(__file__))
        train = write_tasks(os.path.join(tmp_tasks.name, "train.jsonl"), 512, seed=1)
        held = write_tasks(os.path.join(tmp_tasks.name, "eval.jsonl"), 200, seed=2)
        common = [f"--agent={here}/_agentic_workload.py:agent", f"--tasks={train}",
                  f"--eval_tasks={held}", "--max_tokens=8", "--batch_size=32",
                  "--group_size=4", "--eval_every=0", "--placement.reference=0",
                  "--model.max_model_len=1024", "--warm_start.steps=0", "--seed=0",
                  "--steps=10" if a.quick else "--steps=100000",
                  "--time_limit_minutes=30" if a.quick else f"--time_limit_minutes={a.minutes}"]
        quality_key = "reward"
    # agentic: sync gets 32 to 2,560 episodes in flight (waiting-bound: concurrency can decide
    # it; its rate still rose from 640 to 1,280) besides the async run's own
    default_rounds = {1, 5, 10, 20, 40, 80} if agentic else {1, a.lag + 1}
    rounds = [int(x) for x in a.sync_rounds.split(",")] if a.sync_rounds else \
        sorted(default_rounds)
    Config = tuple[int, int, int, int]  # (lag, threads, batches per step, rollout replicas)
    sync_configs: list[Config] = [(0, t, m, n) for n in sync_replicas for t in sync_threads
                                  for m in rounds]
    async_config: Config = (a.lag, 1, 1, a.rollout)
    configs = [*sync_configs, async_config]
    runs: dict[Config, list[dict[str, object]]] = {c: [] for c in configs}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.repeats):  # interleaved: every sync setting, async, best sync, ...
            for lag, threads, m, n in configs:
                r = run_once(lag, threads, m, common,
                             os.path.join(d, f"lag{lag}-t{threads}-m{m}-r{n}-{rep}"),
                             quality_key, replicas=n, groups=a.groups)
                runs[(lag, threads, m, n)].append(r)
                print(f"lag {lag} threads {threads} rounds {m} replicas {n} rep {rep}: "
                      f"{r['trajectories_per_s']} traj/s, {r['cores_used']} cores "
                      f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
            if rep == 0:  # the fastest sync configuration of round 0 goes on alone
                best_c = max(sync_configs, key=lambda c: float(
                    runs[c][0]["trajectories_per_s"]))  # type: ignore[arg-type]
                configs = [best_c, async_config]
        # quality at an equal number of optimizer updates: async again, stopped at the steps
        # the best sync run of each repeat took in its budget (the same final eval)
        equal: list[dict[str, object]] = []
        if not a.quick:
            for rep, sync_run in enumerate(runs[best_c]):
                steps = int(sync_run["steps"])  # type: ignore[call-overload]
                equal.append(run_once(a.lag, 1, 1, [*common, f"--steps={steps}",
                                                     "--time_limit_minutes=120"],
                                      os.path.join(d, f"equal-{rep}"), quality_key,
                                      replicas=a.rollout, groups=a.groups, steady=False))
    best = summarize(runs[best_c])
    asyn = summarize(runs[async_config])
    cores = os.cpu_count() or 1
    tmp_tasks.cleanup()
    per_repeat = [round(float(x["trajectories_per_s"]) / float(y["trajectories_per_s"]), 3)  # type: ignore[arg-type]
                  for x, y in zip(runs[async_config], runs[best_c], strict=True)]
    out = {"bench": "async_vs_sync", "workload": a.workload, "quick": a.quick,
           "repeats": a.repeats, "quality_key": quality_key,
           "sync_best": best, "async": asyn,
           "sync_sweep": [summarize(runs[c]) for c in sync_configs],
           "quality_at_equal_updates": {
               "updates": [r["steps"] for r in runs[best_c]],
               "sync_best": best["final_quality"],
               "async": round(statistics.fmean(float(r["final_quality"])  # type: ignore[arg-type]
                                               for r in equal), 4),
               "async_runs": [r["final_quality"] for r in equal]} if equal else None,
           "ratio_steady_state": round(float(asyn["trajectories_per_s"])  # type: ignore[arg-type]
                                       / float(best["trajectories_per_s"]), 3),  # type: ignore[arg-type]
           "ratios_per_repeat": per_repeat,
           "final_win_draw_delta": round(float(asyn["final_win_draw"])  # type: ignore[arg-type]
                                         - float(best["final_win_draw"]), 4),  # type: ignore[arg-type]
           "final_quality_delta": round(float(asyn["final_quality"])  # type: ignore[arg-type]
                                        - float(best["final_quality"]), 4),  # type: ignore[arg-type]
           "async_cores_used": asyn["cores_used"], "cores": cores,
           "core_limit": round(cores / float(best["cores_used"]), 3),  # type: ignore[arg-type]
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    if a.save:
        name = "async_vs_sync" if a.workload == "tictactoe" else f"async_vs_sync_{a.workload}"
        _results.save(name, out, quick=a.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
