"""The main job's learning, as a result file: `earl train` on a shipped recipe, end to end.

Runs `earl train --recipe NAME --json` in a fresh output folder (the recipe's own defaults: on
Tic-Tac-Toe the 9-minute training budget) and prints one JSON object: the held-out metric after
the warm start (`eval_start`, the same policy before RL: what RL is compared with) and at the
end, the validation curve (step, minutes, metric), steps and wall minutes. `--save` keeps it in
bench/results/ (`main_job` for Tic-Tac-Toe, `main_job_<recipe>` otherwise).

    earl bench main_job --json --save
    earl bench main_job --recipe calc --json --save
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import _results


def run(recipe: str, extra: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="earl-main-job-") as tmp:
        cmd = [sys.executable, "-m", "earl.cli", "train", "--recipe", recipe, "--json",
               "--output-dir", str(Path(tmp) / "run"), *extra]
        p = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if p.returncode != 0:
            raise SystemExit(f"main_job: earl train failed ({p.returncode}): {p.stderr[-2000:]}")
        res = json.loads(p.stdout.strip().splitlines()[-1])
    key = res["target_key"]
    return {"recipe": recipe, "metric": key, "eval": res["eval"].get(key),
            "eval_start": res["eval_start"].get(key), "steps": res["steps"],
            "wall_minutes": res["wall_minutes"], "stopped": res["stopped"],
            "selected_step": res["selected_step"], "episodes": res["episodes"],
            "curve": [{"step": int(e["step"]), "minutes": round(e["minutes"], 2),
                       key: e.get(key)} for e in res["evals"]],
            "extra_args": extra}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tictactoe")
    ap.add_argument("--json", action="store_true", help="print the JSON object only")
    _results.add_flag(ap)
    args, extra = ap.parse_known_args()
    begun = _results.start()
    res = run(args.recipe, extra)
    print(json.dumps(res) if args.json else json.dumps(res, indent=1), flush=True)
    if args.save:
        name = "main_job" if args.recipe == "tictactoe" else f"main_job_{args.recipe}"
        _results.save(name, res, quick=bool(extra), begun=begun)


if __name__ == "__main__":
    main()
