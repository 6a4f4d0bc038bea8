"""The main job's learning, as a result file: `earl train` on a shipped recipe, end to end.

Runs `earl train --recipe NAME --json` in a fresh output folder (the recipe's own defaults: on
Tic-Tac-Toe the 9-minute training budget) and prints one JSON object: the held-out metric after
the warm start (`eval_start`, the same policy before RL: what RL is compared with) and at the
end, the validation curve (step, minutes, metric), the training reward per tenth of the steps,
where the time went (rollout and train seconds per step, train and rollout tokens/s), steps and
wall minutes, and what the run left and showed: the run folder's size (checkpoints, metrics, the
bounded trajectory dump) and the lines it printed on the terminal. `--config FILE.yaml` runs a run file instead (e.g. a user's agent). `--save` keeps
it in bench/results/ (`main_job` for Tic-Tac-Toe, `main_job_<recipe or run file's name>`
otherwise).

    earl bench main_job --json --save
    earl bench main_job --recipe calc_smollm2 --json --save
    earl bench main_job --config agents/openai_calc_smollm2.yaml --json --save
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import _results


def _steps(metrics: Path) -> dict[str, object]:
    """Training reward per tenth of the steps, and where a step's time went (medians)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "reward" in r and "step_s" in r]
    if not rows:
        return {}
    tenth = max(len(rows) // 10, 1)

    def med(key: str) -> float:
        return round(statistics.median(r.get(key, 0.0) for r in rows), 3)

    return {"reward_curve": [{"step": int(rows[i]["step"]), "reward": round(statistics.fmean(
                r["reward"] for r in rows[i:i + tenth]), 3)} for i in range(0, len(rows), tenth)],
            "step_s_median": med("step_s"), "rollout_s_median": med("rollout_s"),
            "train_step_s_median": med("train/step_time_s"),
            "train_tokens_per_s_median": med("train/tokens_per_s"),
            "rollout_tokens_per_s_median": med("tokens_per_s")}


def run(recipe: str, extra: list[str], config: str | None = None) -> dict[str, object]:
    what = ["--config", config] if config else ["--recipe", recipe]
    with tempfile.TemporaryDirectory(prefix="earl-main-job-") as tmp:
        cmd = [sys.executable, "-m", "earl.cli", "train", *what, "--json",
               "--output-dir", str(Path(tmp) / "run"), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise SystemExit(f"main_job: earl train failed ({p.returncode}): {p.stderr[-2000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
        steps = _steps(Path(tmp) / "run" / "metrics.jsonl")
        out = Path(tmp) / "run"
        sizes = {"run_folder_mb": _mb(out.rglob("*")),
                 "trajectory_dump_mb": _mb(out.glob("trajectories*")),
                 "terminal_lines": len(p.stderr.splitlines())}  # what a person sees (--json)
    key = res["target_key"]
    return {"recipe": res["recipe"], "config": config, "metric": key, **steps, "eval": res["eval"].get(key),
            "eval_start": res["eval_start"].get(key), "steps": res["steps"],
            "wall_minutes": res["wall_minutes"], "stopped": res["stopped"],
            "selected_step": res["selected_step"], "episodes": res["episodes"],
            "curve": [{"step": int(e["step"]), "minutes": round(e["minutes"], 2),
                       key: e.get(key)} for e in res["evals"]],
            **sizes, "extra_args": extra}


def _mb(paths: object) -> float:
    return round(sum(f.stat().st_size for f in paths if f.is_file()) / 2**20, 2)  # type: ignore[attr-defined]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tictactoe")
    ap.add_argument("--config", help="a run file (YAML) to train instead of --recipe")
    ap.add_argument("--json", action="store_true", help="print the JSON object only")
    _results.add_flag(ap)
    args, extra = ap.parse_known_args()
    begun = _results.start()
    res = run(args.recipe, extra, args.config)
    print(json.dumps(res) if args.json else json.dumps(res, indent=1), flush=True)
    if args.save:
        what = Path(args.config).stem if args.config else args.recipe
        name = "main_job" if what == "tictactoe" else f"main_job_{what}"
        _results.save(name, res, quick=bool(extra), begun=begun)


if __name__ == "__main__":
    main()
