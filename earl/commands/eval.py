"""`earl eval`: evaluate a saved policy greedily, as `earl train` evaluates at the end of a run.

    earl eval runs/latest                       # a finished run: its final eval, again
    earl eval runs/a --json                     # last stdout line: one JSON object
    earl eval runs/a/weights_start              # a model folder of a run: that run's eval
    earl eval runs/a --eval_games=400           # any --key=value overrides a RunConfig field
    earl eval MODEL_DIR --recipe tictactoe      # any HF folder on a shipped recipe's eval
    earl eval MODEL_DIR --agent my_agent.py:agent --eval-tasks eval.jsonl

A run folder's own config says what to evaluate on and how (recipe or agent, eval tasks and
their number, seed, model window, placement); its weights are those the run's final eval
served (`weights_best/` when model selection chose an earlier step). `--recipe` or `--agent`
evaluates on another task instead. The `eval` printed is the metric `earl train --json`
printed as `eval` for the same weights: greedy decoding, the same eval samples. It is also
written to `<output-dir>/eval.json`, beside the actors' `run.log`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from earl.commands.train import _cause, _fail, _innermost

    p = argparse.ArgumentParser(prog="earl eval", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="a run folder (earl train --output-dir) or an HF model folder")
    p.add_argument("--recipe", help="evaluate on a shipped recipe's eval (earl train --recipe)")
    p.add_argument("--agent", help="your agent coroutine, PATH.py:NAME or module:NAME")
    p.add_argument("--eval-tasks", help="JSONL file of held-out samples to evaluate on")
    p.add_argument("--reward", help="a reward rule PATH.py:NAME scoring the final answer")
    p.add_argument("--output-dir", help="where eval.json and run.log go (default: "
                   "<run>/eval for a run folder, runs/eval otherwise)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--verbose", action="store_true", help="the actors' library warnings and "
                   "progress bars on the terminal instead of <output-dir>/run.log")
    args, rest = p.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from earl.config_parse import parse_overrides
    from earl.evaluate import eval_config, evaluate_saved, saved_policy

    try:
        policy = saved_policy(args.path)
        overrides = parse_overrides(rest)
        for name in ("recipe", "agent", "eval_tasks", "reward"):
            if getattr(args, name):
                overrides[name] = getattr(args, name)
        out = args.output_dir or str(policy.run / "eval" if policy.run else "runs/eval")
        cfg = eval_config(policy, overrides, output_dir=out)
    except (ValueError, TypeError) as exc:
        return _fail(args.json, f"earl eval: {exc}", code=2)

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    log(f"evaluating {policy.weights} on {cfg.agent or cfg.recipe} (greedy)")
    try:
        report = asyncio.run(evaluate_saved(cfg, policy, verbose=args.verbose, log=log))
    except BaseException as exc:  # noqa: BLE001 - one clear line instead of a traceback
        inner = _innermost(exc)
        if isinstance(inner, KeyboardInterrupt):
            return _fail(args.json, "earl eval: interrupted", code=130)
        if isinstance(inner, (ValueError, TypeError)):  # a bad setting or input
            return _fail(args.json, f"earl eval: {inner}", code=2)
        return _fail(args.json, f"earl eval: the eval stopped: {_cause(exc)}", code=1)
    result = report.to_json()
    (Path(cfg.output_dir) / "eval.json").write_text(json.dumps(result, indent=2))
    from earl.loop.main import fmt

    log(f"eval: {fmt(report.eval, report.target_key)}; {report.wall_minutes:.1f} min")
    if args.json:
        print(json.dumps(result), flush=True)
    return 0
