"""A seeded sweep of drawn fault schedules: `earl chaos --draw N --seed S --json` for each seed,
one run at a time (each is a live tiny run: ~1.5-3 min on 2 cores).

Prints one JSON object: per seed the drawn schedule, whether it held every invariant (`ok`),
recovered, lost, duplicated, steps, stalls, wall seconds and the error; and the totals. Every
schedule that fails is kept as a regression case in `tests/integration/chaos_regressions.json`
(its seed, draw, steps, faults and error; `tests/integration/test_chaos.py` replays each one in
the slow tier) until a run of it passes again (`--prune`).

    .venv/bin/python bench/chaos_sweep.py --seeds 0-49 --draw 3 --save
    .venv/bin/python bench/chaos_sweep.py --seeds 100-109 --draw 5 --steps 10
    .venv/bin/python bench/chaos_sweep.py --seeds 7 --draw 3 --prune   # replay one, and
                                                                        # forget it if it passes
    .venv/bin/python bench/chaos_sweep.py --faults kill:producer,kill:reference,kill:rollout \
        --steps 6 --seeds 0-9 --save     # a named schedule at each seed (where in a step each
                                         # fault lands); not kept as regression cases
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import _results

REGRESSIONS = _results.REPO / "tests" / "integration" / "chaos_regressions.json"


def seeds_of(text: str) -> list[int]:
    """"0-9,20,30-31" -> [0..9, 20, 30, 31]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def run_one(seed: int, draw: int, steps: int, deadline: float, faults: str = ""
            ) -> dict[str, object]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="earl-sweep-") as tmp:
        t0 = time.perf_counter()
        which = ["--faults", faults] if faults else ["--draw", str(draw)]
        p = subprocess.run([sys.executable, "-m", "earl.cli", "chaos", "--json", *which,
                            "--seed", str(seed), "--steps", str(steps),
                            "--deadline", str(deadline), "--output-dir", f"{tmp}/run"],
                           capture_output=True, text=True, timeout=deadline + 300, env=env,
                           check=False, cwd=_results.REPO)
        lines = p.stdout.strip().splitlines()
        rep = json.loads(lines[-1]) if lines else {}
    row: dict[str, object] = {
        "seed": seed, "exit": p.returncode, "ok": bool(rep.get("ok")),
        "faults": faults.split(",") if faults else rep.get("drawn", {}).get("faults", []),
        "drawn": rep.get("drawn"), "recovered": rep.get("recovered"),
        "samples_lost": rep.get("samples_lost"),
        "samples_duplicated": rep.get("samples_duplicated"),
        "steps_reached": rep.get("steps_reached"), "steps": steps,
        "stalls": len(rep.get("stalls", [])), "rewinds": rep.get("rewinds"),
        "wall_s": rep.get("wall_s", round(time.perf_counter() - t0, 1)),
        "error": rep.get("error") or ("" if rep else p.stderr.strip()[-600:]),
        "failed_faults": [f["fault"] for f in rep.get("faults", []) if not f.get("recovered")]}
    return row


def keep(rows: list[dict[str, object]], draw: int, prune: bool) -> list[dict[str, object]]:
    """Add the failing schedules to the regression cases; with `prune`, drop the cases of the
    seeds (at this draw and steps) that passed now. Returns the cases."""
    cases = json.loads(REGRESSIONS.read_text()) if REGRESSIONS.is_file() else []
    key = {(c["seed"], c["draw"], c["steps"]) for c in cases}
    for r in rows:
        k = (r["seed"], draw, r["steps"])
        if not r["ok"] and k not in key:
            cases.append({"seed": r["seed"], "draw": draw, "steps": r["steps"],
                          "faults": r["faults"], "error": r["error"],
                          "failed_faults": r["failed_faults"],
                          "samples_lost": r["samples_lost"], "found": time.strftime("%F")})
        if prune and r["ok"]:
            cases = [c for c in cases if (c["seed"], c["draw"], c["steps"]) != k]
    REGRESSIONS.write_text(json.dumps(cases, indent=1) + "\n")
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0-9", help="seeds, e.g. 0-49 or 3,7,11")
    ap.add_argument("--draw", type=int, default=3, help="faults drawn per run")
    ap.add_argument("--faults", default="",
                    help="a named fault list instead of drawn ones (earl chaos --faults)")
    ap.add_argument("--steps", type=int, default=8, help="training steps per run")
    ap.add_argument("--deadline", type=float, default=600.0,
                    help="seconds after which a run counts as hung (earl chaos --deadline)")
    ap.add_argument("--prune", action="store_true",
                    help="forget the kept cases of the seeds that pass now")
    _results.add_flag(ap)
    args = ap.parse_args()
    begun = _results.start()
    rows = []
    for seed in seeds_of(args.seeds):
        row = run_one(seed, args.draw, args.steps, args.deadline, args.faults)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("seed", "ok", "faults", "samples_lost",
                                              "steps_reached", "wall_s", "error")}),
              file=sys.stderr, flush=True)
    cases = json.loads(REGRESSIONS.read_text()) if args.faults else \
        keep(rows, args.draw, args.prune)
    res = {"draw": 0 if args.faults else args.draw, "faults": args.faults,
           "steps": args.steps, "runs": len(rows),
           "passed": sum(bool(r["ok"]) for r in rows),
           "lost": sum(int(r["samples_lost"] or 0) for r in rows),
           "duplicated": sum(int(r["samples_duplicated"] or 0) for r in rows),
           "regression_cases": len(cases), "rows": rows}
    print(json.dumps(res), flush=True)
    if args.save:
        _results.save("chaos_named" if args.faults else "chaos_sweep", res, quick=False,
                      begun=begun)


if __name__ == "__main__":
    main()
