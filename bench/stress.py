"""Stress benchmark: 10,000 simulated agent sessions, and the elastic vs static tool executor.

    python bench/stress.py --json [--quick]

Prints one JSON object with three parts, all measured in this run:
  scale:    `earl stress --sessions 10000 --env tictactoe` (sim engine): sessions completed/failed,
            turns/s, peak RSS and overhead_us_per_turn (main-process CPU per turn, simulated
            engine time excluded); target <= 100 us.
  floor:    the same number of sessions/turns doing nothing but the asyncio wake-ups a turn
            needs (a timer sleep per turn, uvloop): the floor for any asyncio agent runtime.
  executor: a bursty calc workload (3 tool calls per session) on the elastic action-level pool
            (max 8 workers) vs the static per-session baseline (16 sandboxes); targets: ACT >= 2x
            better with >= 50% fewer workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from typing import Any

import _results


def _stress(args: list[str]) -> dict[str, Any]:
    # exit status 1 means some sessions failed: reported in the JSON, not an error here
    res = subprocess.run([sys.executable, "-m", "earl.cli", "stress", "--json", *args],
                         check=False, capture_output=True, text=True)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode not in (0, 1) or not lines:
        raise RuntimeError(f"earl stress {' '.join(args)} exited {res.returncode}: "
                           f"{res.stderr[-2000:]}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


def _floor(sessions: int, turns_per_session: int) -> float:
    """CPU us per turn of bare asyncio: one 1-3 ms timer sleep per turn, nothing else."""
    import uvloop

    async def session(rng: random.Random) -> None:
        for _ in range(turns_per_session):
            await asyncio.sleep(0.001 + 0.002 * rng.random())

    async def main() -> None:
        async with asyncio.TaskGroup() as tg:
            for i in range(sessions):
                tg.create_task(session(random.Random(i)))

    c0 = time.process_time()
    uvloop.run(main())
    return (time.process_time() - c0) / (sessions * turns_per_session) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="2,000 sessions, smaller burst (< 60 s)")
    _results.add_flag(ap)
    a = ap.parse_args(argv)
    begun = _results.start()
    n = 2000 if a.quick else 10000
    scale = _stress(["--sessions", str(n), "--env", "tictactoe"])
    turns = int(scale["turns"])
    floor = _floor(n, max(1, round(turns / n)))
    ex_sessions = "128" if a.quick else "256"
    ex = _stress(["--sessions", ex_sessions, "--env", "calc", "--tool-calls", "3",
                  "--arrival", "burst", "--burst-size", "64", "--burst-interval-s", "2",
                  "--max-workers", "8", "--static-workers", "16", "--compare"])
    cmp = ex["compare"]
    keep = ("sessions_completed", "sessions_failed", "turns", "turns_per_s",
            "tokens_per_s", "wall_s", "peak_rss_mb", "overhead_us_per_turn",
            "engine_idle_fraction")
    res = {
        "bench": "stress", "quick": a.quick,
        "scale": {k: scale[k] for k in keep} | {"sessions": n},
        "floor_asyncio_us_per_turn": floor,
        "executor": cmp,
        "targets": {
            "sessions_10000_all_completed": n == 10000 and scale["sessions_completed"] == n,
            "overhead_us_per_turn_le_100": scale["overhead_us_per_turn"] <= 100,
            "act_2x_better": (cmp["act_mean_speedup"] or 0) >= 2,
            "workers_50pct_fewer": (cmp["worker_reduction"] or 0) >= 0.5,
        },
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(json.dumps(res, indent=2))
    if a.save:
        _results.save("stress", res, quick=a.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
