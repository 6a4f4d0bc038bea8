"""The driver carries metadata only: its peak RSS against the experience bytes a run produced.

Runs `earl train` (Tic-Tac-Toe recipe, tiny model) in a fresh process per size, with 1x and 8x
the experience (steps x batch), and reads the driver process's own peak RSS (`ru_maxrss`,
children excluded) and the bytes of the dock columns the run produced (every trajectory's
tokens times the per-token column bytes, from `earl.runtime.types.COLUMNS`). If experience
passed through the driver, its peak RSS would grow with the bytes; the JSON reports both and
the growth per experience byte.

    python bench/driver_memory.py --json            # 1x and 8x experience
    python bench/driver_memory.py --json --quick    # smaller, < 2 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import _results

CHILD = r"""
import asyncio, json, resource, sys
from earl.config import load_config
from earl.run import run
from earl.runtime.types import COLUMNS
import numpy as np

steps, batch, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = load_config(None, [f"--steps={steps}", f"--batch_size={batch}", "--group_size=8",
                         "--eval_every=0", "--eval_games=8", "--warm_start.steps=2",
                         "--checkpoint_every=1000", "--dump_trajectories=false",
                         f"--output_dir={out}", "--time_limit_minutes=30"])
res = asyncio.run(run(cfg, log=lambda s: None))
per_token = sum(np.dtype(COLUMNS[c]).itemsize for c in
                ("input_ids", "loss_mask", "advantages", "rollout_logprobs", "versions",
                 "ref_logprobs"))
rows = [json.loads(x) for x in open(res.files["metrics"])]
tokens = sum(r["ctx_mean"] * r["episodes"] for r in rows)
print(json.dumps({"steps": res.steps, "episodes": res.episodes, "tokens": tokens,
                  "experience_bytes": tokens * per_token,
                  "driver_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                  / 1024}))
"""


def measure(steps: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="earl-drvmem-") as out:
        p = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(batch), out],
                           capture_output=True, text=True, check=False,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if p.returncode != 0:
            raise RuntimeError(p.stderr[-3000:])
        return json.loads(p.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    _results.add_flag(ap)
    args = ap.parse_args()
    begun = _results.start()
    steps = 4 if args.quick else 8
    small = measure(steps, 16)
    large = measure(steps * 2, 64)  # 8x the trajectories
    grow = large["driver_peak_rss_mb"] - small["driver_peak_rss_mb"]
    extra = large["experience_bytes"] - small["experience_bytes"]
    out = {"small": small, "large": large,
           "experience_ratio": large["experience_bytes"] / small["experience_bytes"],
           "driver_rss_growth_mb": grow,
           "driver_rss_growth_per_experience_byte": grow * 2**20 / extra if extra else 0.0,
           "driver_peak_rss_over_experience": large["driver_peak_rss_mb"] * 2**20
           / large["experience_bytes"]}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    if args.save:
        _results.save("driver_memory", out, quick=args.quick, begun=begun)


if __name__ == "__main__":
    main()
