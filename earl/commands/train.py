"""`earl train`: run the asynchronous RL pipeline (default: tiny model, Tic-Tac-Toe, CPU).

    earl train                                  # the main job, ~10 minutes on 2 CPU cores
    earl train --output-dir runs/a --json       # last stdout line: one JSON object
    earl train --config run.yaml --algorithm.lr=5e-4 --max_policy_lag=0
    earl train --output-dir runs/a --resume     # continue after a crash / SIGKILL
    earl train --trace                          # also write a Chrome/Perfetto trace

Any `--key.sub=value` not listed below overrides a field of `earl.config.RunConfig`.

Resume restores the trainer (model, optimizer, schedule, RNG), the critic table, the policy
version and the data cursor (the next batch's game seeds), so a resumed run continues the same
metrics trajectory. It is not bit-identical: vLLM's sampling stream restarts with the engine and,
with max_policy_lag > 0, which policy version sampled which token depends on timing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="earl train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with RunConfig fields")
    p.add_argument("--output-dir", help="where metrics, plots, checkpoints go "
                   "(default: runs/latest)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--trace", action="store_true", help="write trace.json (Chrome/Perfetto)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args, rest = p.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from earl.config import load_config

    overrides = list(rest)
    if args.output_dir:
        overrides.append(f"--output_dir={args.output_dir}")
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, TypeError) as exc:
        print(f"earl train: {exc}", file=sys.stderr)
        return 2
    from earl.run import train

    def log(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    try:
        result = asyncio.run(train(cfg, resume=args.resume, trace=args.trace, log=log))
    except ValueError as exc:
        print(f"earl train: {exc}", file=sys.stderr)
        return 2
    ev = result.eval
    summary = (f"eval: {ev['games']} games vs random, win {ev['win_rate']:.3f} draw "
               f"{ev['draw_rate']:.3f} (win+draw {ev['win_draw_rate']:.3f}), illegal "
               f"{ev['illegal_rate']:.3f}; {result.steps} steps in {result.wall_minutes:.1f} min; "
               f"plot {result.files['plot']}")
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps(result.to_json()), flush=True)
    else:
        print(summary)
    return 0
