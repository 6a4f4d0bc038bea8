"""The soak: `earl chaos --soak MINUTES` (a live run of the tictactoe recipe's batch size, for
MINUTES, with a fault every ~5 minutes drawn with replacement from the chaos list), its report
checked against the soak's targets.

Prints one JSON object: the chaos report (faults, the oracle's lost/duplicated, restarts,
rewinds) without its raw samples, the soak's summary (`earl.commands.chaos_soak`: RSS growth
per actor after warm-up, the run folder's size by part, steps/s per 10-minute window) and
`targets`: each target with the measured value and whether it held. RSS is the memory target
(issue 49); USS (private pages) is reported beside it, not a target: it counts a page of a
shared library (torch's, mapped by every actor) private once no other live process maps it, so
it moves when siblings restart (docs/results.md: the soaks).

    .venv/bin/python bench/soak.py --minutes 121 --seed 1 --save    # the 2-hour soak
    .venv/bin/python bench/soak.py --minutes 12 --every-s 60          # a short look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _results

# what a step appends to (a metrics line, TensorBoard scalars, a log line, trace events, the
# oracle's records): these grow with the steps by design, by a bounded amount per step
STEP_LOGS = ("metrics.jsonl", "run.log", "tb", "trained", ".trace.jsonl")
LOG_KIB_PER_STEP = 8.0
DUMP_MAX_MIB = 16.0  # the trajectory dump's cap (`dump_max_mb`, its default)


def _within(part: dict) -> bool:
    """A part ends within 10% (+1 MiB) of its size after warm-up; for the checkpoint, its part
    besides the critic tables does, and the tables are under the size they reach full."""
    critic = part.get("critic")
    if critic is None:
        return part["end_mib"] <= part["after_warmup_mib"] * 1.10 + 1.0
    early, end = critic["after_warmup"], critic["end"]
    rest_early, rest_end = part["after_warmup_mib"] - early["mib"], part["end_mib"] - end["mib"]
    return rest_end <= rest_early * 1.10 + 1.0 and end["mib"] <= end["full_mib"]


def folder_bounded(growth: dict[str, dict]) -> dict[str, object]:
    """The run folder holds only what is bounded: the step logs grow <= `LOG_KIB_PER_STEP`
    KiB a step together, the trajectory dump stays under its cap (and a segment being
    written), and every other part (the checkpoint in force, the weights) ends within 10%
    (+1 MiB) of its size after warm-up, the checkpoint's critic tables aside: those fill up
    to their caps (`max_states` observations, `max_replies` replies each), and the bound
    they reach full is reported. Nothing piles up with time or faults."""
    logs = round(sum(g["kib_per_step"] for k, g in growth.items() if k in STEP_LOGS), 3)
    dump = growth.get("trajectories", {}).get("end_mib", 0.0)
    grew = sorted(k for k, g in growth.items() if k not in STEP_LOGS and k != "trajectories"
                  and not _within(g))
    ok = bool(growth) and logs <= LOG_KIB_PER_STEP and dump <= DUMP_MAX_MIB + 1.0 and not grew
    return {"value": {"step_logs_kib_per_step": logs, "trajectories_mib": round(dump, 2),
                      "parts_that_grew": grew}, "ok": ok}


def targets(rep: dict, minutes: float) -> dict[str, dict[str, object]]:
    """The soak's targets (issue 49) against its report."""
    soak = rep.get("soak", {})
    growth = soak.get("max_rss_growth")
    return {
        "hours_ge_2": {"value": round(soak.get("seconds", 0) / 3600, 2),
                       "ok": soak.get("seconds", 0) >= 7200 - 600},  # sampled from start-up
        "faults_ge_20": {"value": rep.get("faults_injected", 0),
                         "ok": rep.get("faults_injected", 0) >= 20},
        "all_recovered": {"value": rep.get("recovered"), "ok": bool(rep.get("recovered"))},
        "lost_0": {"value": rep.get("samples_lost"), "ok": rep.get("samples_lost") == 0},
        "duplicated_0": {"value": rep.get("samples_duplicated"),
                         "ok": rep.get("samples_duplicated") == 0},
        "rss_growth_le_10pct": {"value": growth, "ok": growth is not None and growth <= 0.10},
        "folder_bounded": folder_bounded(soak.get("folder_growth", {})),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=121.0)
    ap.add_argument("--every-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", help="keep the run folder here (default: a temp dir, removed)")
    _results.add_flag(ap)
    args = ap.parse_args()
    begun = _results.start()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryDirectory(prefix="earl-soak-") as tmp:
        out = args.keep or f"{tmp}/run"
        p = subprocess.run([sys.executable, "-m", "earl.cli", "chaos", "--json", "--soak",
                            str(args.minutes), "--every-s", str(args.every_s), "--seed",
                            str(args.seed), "--output-dir", out],
                           capture_output=True, text=True, env=env, check=False,
                           cwd=_results.REPO)
    lines = p.stdout.strip().splitlines()
    rep = json.loads(lines[-1]) if lines else {"error": p.stderr.strip()[-2000:]}
    res = {"minutes": args.minutes, "every_s": args.every_s, "seed": args.seed,
           "exit": p.returncode, "targets": targets(rep, args.minutes), **rep}
    res["ok"] = all(t["ok"] for t in res["targets"].values())
    print(json.dumps({k: v for k, v in res.items() if k != "soak"} | {
        "soak": {k: v for k, v in rep.get("soak", {}).items() if k != "rows"}}), flush=True)
    if args.save:
        _results.save("soak", res, quick=args.minutes < 120, begun=begun)


if __name__ == "__main__":
    main()
