"""Async (max_policy_lag > 0) vs synchronous (lag 0) `earl train`: same model, env, seed and
wall budget. Prints one JSON object: trajectories/s, time to reach a win+draw threshold, final
win+draw for each mode, and the async/sync ratios.

    python bench/async_vs_sync.py            # 2 x ~5 min runs (default recipe, eval every 10)
    python bench/async_vs_sync.py --quick    # < 60 s: throughput only, tiny budget, 20-game eval
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import sys
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

THRESHOLD = 0.9  # win+draw rate for `minutes_to_threshold`


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


def run_mode(lag: int, overrides: list[str], out: str) -> dict[str, object]:
    from earl.config import load_config
    from earl.run import train

    cfg = load_config(None, [*overrides, f"--max_policy_lag={lag}", f"--output_dir={out}"])
    marks: list[tuple[float, float]] = []  # (wall, CPU of the whole process tree) per step

    def on_log(line: str) -> None:
        if line.startswith("step "):
            marks.append((time.perf_counter(), tree_cpu_s()))

    t0 = time.perf_counter()
    with redirect_stdout(io.StringIO()):
        res = asyncio.run(train(cfg, log=on_log))
    wall = time.perf_counter() - t0
    from earl.observe import read_metrics

    ms = read_metrics(Path(res.files["metrics"]))
    # Steady state: from the end of the first step (pipeline filled) to the end of the last.
    train_s = float(ms[-1]["wall_s"]) - float(ms[0]["wall_s"]) if len(ms) > 1 else 0.0
    games = int(ms[-1]["games"]) - int(ms[0]["games"]) if len(ms) > 1 else 0
    # Evals pause training in both modes (the same 200 games); without them: the pipeline alone.
    eval_s = sum(float(e.get("seconds", 0.0)) for e in res.evals
                 if ms and float(ms[0]["step"]) <= float(e["step"]) < float(ms[-1]["step"]))
    hit = [e["minutes"] for e in res.evals if e["win_draw_rate"] >= THRESHOLD]
    import statistics

    step_s = statistics.median(float(m["step_s"]) for m in ms) if ms else 0.0
    roll_s = statistics.median(float(m.get("rollout_s", 0.0)) for m in ms) if ms else 0.0
    return {"max_policy_lag": lag, "steps": res.steps, "trajectories": games,
            "step_s_median": round(step_s, 4), "rollout_s_median": round(roll_s, 4),
            "trajectories_per_s": games / train_s if train_s else 0.0,
            "loop_seconds": round(train_s, 2), "eval_seconds": round(eval_s, 2),
            "trajectories_per_s_without_evals": games / (train_s - eval_s)
            if train_s > eval_s else 0.0,
            "cores_used": round((marks[-1][1] - marks[0][1]) / (marks[-1][0] - marks[0][0]), 3)
            if len(marks) > 1 else None, "wall_s": round(wall, 1),
            "threshold": THRESHOLD, "minutes_to_threshold": hit[0] if hit else None,
            "final_win_draw": res.eval["win_draw_rate"],
            "mean_staleness": sum(float(m["staleness"]) for m in ms) / max(len(ms), 1)}


def overlap_limit(sync: dict[str, object]) -> float | None:
    """Upper bound of the async speed-up: a sync step is rollout then the rest (reference,
    train, weight push); perfect overlap makes a step last as long as the longer part."""
    step, roll = float(sync["step_s_median"]), float(sync["rollout_s_median"])  # type: ignore[arg-type]
    if step <= 0 or roll <= 0:
        return None
    return round(step / max(roll, step - roll), 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", help="(always JSON; kept for `earl bench`)")
    p.add_argument("--lag", type=int, default=1, help="async run's max_policy_lag")
    p.add_argument("--minutes", type=float, default=4.5, help="wall budget per mode")
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if a.quick:
        common = ["--steps=12", "--warm_start.steps=0", "--placement.reference=0",
                  "--algorithm.kl_coef=0",
                  "--batch_size=32", "--group_size=8",
                  "--eval_games=20", "--eval_every=0", "--checkpoint_every=100",
                  "--dump_trajectories=false", "--target_win_draw=0"]
    else:
        # Both modes run the whole budget (no early stop at a target), so final quality compares.
        common = ["--steps=100000", f"--time_limit_minutes={a.minutes}", "--eval_every=10",
                  "--target_win_draw=0", "--checkpoint_every=100000"]
    with tempfile.TemporaryDirectory() as d:
        sync = run_mode(0, common, os.path.join(d, "sync"))
        asyn = run_mode(a.lag, common, os.path.join(d, "async"))
    out = {"bench": "async_vs_sync", "quick": a.quick, "sync": sync, "async": asyn,
           "throughput_ratio": (asyn["trajectories_per_s"] / sync["trajectories_per_s"])
           if sync["trajectories_per_s"] else None,
           "throughput_ratio_without_evals": (asyn["trajectories_per_s_without_evals"]  # type: ignore[operator]
                                              / sync["trajectories_per_s_without_evals"])
           if sync["trajectories_per_s_without_evals"] else None,
           "final_win_draw_delta": asyn["final_win_draw"] - sync["final_win_draw"],  # type: ignore[operator]
           "overlap_limit": overlap_limit(sync),
           "cores": os.cpu_count(),
           "core_limit": round(os.cpu_count() / sync["cores_used"], 3)  # type: ignore[operator]
           if sync["cores_used"] else None,
           "note": "overlap_limit: the best async/sync ratio possible from the sync run's own "
                   "stage times, (rollout + rest) / max(rollout, rest) per step, if rollout "
                   "and training never slowed each other. core_limit: the best ratio if async "
                   "kept every core busy with the sync run's CPU work per trajectory "
                   "(cores / cores the sync run used)"}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
