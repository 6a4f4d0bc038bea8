"""`earl train`: run the asynchronous RL pipeline (default: tiny model, Tic-Tac-Toe, CPU).

    earl train                                  # the main job, ~10 minutes on 2 CPU cores
    earl train --recipe calc                    # a shipped recipe: a folder in earl/recipes/
    earl train --agent my_agent.py:agent --tasks train.jsonl --eval-tasks eval.jsonl
    earl train --output-dir runs/a --json       # last stdout line: one JSON object
    earl train --config run.yaml --optim.lr=5e-4 --max_policy_lag=0
    earl train --output-dir runs/a --resume     # continue after a crash / SIGKILL
    earl train --trace                          # also write a Chrome/Perfetto trace
    earl train --recipe connect4 --selector on  # re-plan layouts as contexts grow
    earl train --placement.device=cuda --dry-run --gpus 8 --gpu-memory-gib 80 --json
                                                # the plan for an 8-GPU node; starts nothing

Any `--key.sub=value` not listed below overrides a field of `earl.config.RunConfig`.

Resume restores the trainer (model, optimizer, schedule, RNG), the recipe's critic, the policy
version and the data cursor (the next batch's game seeds), so a resumed run continues the same
metrics trajectory. It is not bit-identical: vLLM's sampling stream restarts with the engine and,
with max_policy_lag > 0, which policy version sampled which token depends on timing.

The run folder stays bounded: `checkpoint/` keeps only the checkpoint in force (a new one every
`--checkpoint_every` steps replaces it once whole); the trajectory dump keeps `--dump_share`
(0.1) of the groups in gzip-rotated files capped at `--dump_max_mb` (16; 0 = no cap). The
terminal shows a progress bar and a line per event; each step's line is in <output_dir>/run.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from earl.loop.failures import describe, failures_json


def main(argv: list[str]) -> int:
    from earl.recipe import recipe_names

    p = argparse.ArgumentParser(prog="earl train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML file with RunConfig fields (a recipe file)")
    p.add_argument("--recipe", help="a shipped recipe: " + ", ".join(recipe_names()) +
                   " (default: tictactoe)")
    p.add_argument("--agent", help="your agent coroutine, PATH.py:NAME or module:NAME")
    p.add_argument("--tasks", help="JSONL file of training samples for --agent")
    p.add_argument("--eval-tasks", help="JSONL file of held-out samples to evaluate on")
    p.add_argument("--reward", help="a reward rule PATH.py:NAME, reward(sample, response) -> "
                   "float, scoring the final answer instead of the agent's return")
    p.add_argument("--output-dir", help="where metrics, plots, checkpoints go "
                   "(default: runs/latest)")
    p.add_argument("--json", action="store_true", help="end with one JSON line of results")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--trace", action="store_true", help="write trace.json (Chrome/Perfetto)")
    p.add_argument("--quiet", action="store_true", help="nothing on the terminal but the "
                   "result (every step's line is in <output_dir>/run.log either way)")
    p.add_argument("--verbose", action="store_true", help="the actors' library warnings and "
                   "progress bars (vLLM, transformers) on the terminal instead of "
                   "<output_dir>/run.log")
    p.add_argument("--selector", help="on: the parallelism selector re-plans layouts and "
                   "budgets before each rollout and training step (default: off)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and "
                   "the device plan (each stage's devices, layout and dtype, vLLM's engine "
                   "arguments, the trainer's parallelism); start nothing")
    p.add_argument("--gpus", type=int, help="with --dry-run and placement.device=cuda: the "
                   "GPUs of the machine to plan for (default: this machine's)")
    p.add_argument("--gpu-memory-gib", type=float, help="with --dry-run and "
                   "placement.device=cuda: each GPU's memory in GiB, e.g. 80 "
                   "(default: this machine's)")
    args, rest = p.parse_known_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from earl.config import load_config

    overrides = list(rest)
    for name in ("output_dir", "recipe", "agent", "tasks", "eval_tasks", "reward"):
        if getattr(args, name):
            overrides.append(f"--{name}={getattr(args, name)}")
    if args.selector:  # beside --selector.<knob>=... overrides
        overrides.append(f"--selector.mode={args.selector}")
    if args.dry_run:
        from earl.commands.dry_run import dry_run

        return dry_run(args.config, overrides, as_json=args.json, gpus=args.gpus,
                       gpu_memory_gib=args.gpu_memory_gib)
    if args.gpus is not None or args.gpu_memory_gib is not None:
        return _fail(args.json, "earl train: --gpus and --gpu-memory-gib describe the machine "
                     "a --dry-run plans for; add --dry-run (a run uses the GPUs it sees)", code=2)
    try:
        cfg = load_config(args.config, overrides)
    except (ValueError, TypeError) as exc:
        return _fail(args.json, f"earl train: {exc}", code=2)
    from earl.commands.terminal import Terminal
    from earl.run import run

    term = Terminal(sys.stderr if args.json else sys.stdout, quiet=args.quiet,
                    time_limit_s=cfg.time_limit_minutes * 60)
    try:
        result = asyncio.run(run(cfg, resume=args.resume, trace=args.trace,
                                 verbose=args.verbose, log=term.event, progress=term.step))
    except BaseException as exc:  # noqa: BLE001 - one clear line instead of a traceback
        term.close()
        return _stopped(args.json, exc, cfg.output_dir)
    term.close()
    key = result.target_key
    ev, ev0 = result.eval, result.eval_start
    shown = f"{key} {ev[key]:.3f}" if key in ev else "no eval tasks"
    start = f" (at start {ev0[key]:.3f})" if key in ev0 else ""
    summary = (f"eval: {shown}{start}; {result.steps} steps in {result.wall_minutes:.1f} min; "
               f"plot {result.files['plot']}")
    if result.failures:
        summary += (f"; {sum(result.failures.values())} episodes failed: "
                    f"{describe(result.failures)} (each text: `failures` in "
                    f"{Path(result.files['config']).with_name('result.json')})")
    if args.json:
        print(summary, file=sys.stderr)
        print(json.dumps(result.to_json()), flush=True)
    else:
        print(summary)
    return 0


def _innermost(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def _cause(exc: BaseException) -> str:
    """The innermost error of an exception group, as one line."""
    exc = _innermost(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _stopped(as_json: bool, exc: BaseException, output_dir: str) -> int:
    """Report why the run stopped. A bad setting or input (ValueError, TypeError raised in
    this process) is not healed by a resume, so none is suggested for it."""
    inner, resume = _innermost(exc), f"`earl train --output-dir {output_dir} --resume`"
    with contextlib.suppress(OSError), (Path(output_dir) / "run.log").open("a") as f:
        f.write(f"earl train: the run stopped: {_cause(exc)}\n")
    if isinstance(inner, KeyboardInterrupt):
        return _fail(as_json, f"earl train: interrupted; continue with {resume}", code=130)
    if isinstance(inner, (ValueError, TypeError)):
        failures = getattr(inner, "failures", None)  # NothingToTrain: the agents' errors
        return _fail(as_json, f"earl train: {inner}", code=2,
                     failures=failures_json(failures) if failures else None)
    return _fail(as_json, f"earl train: the run stopped: {_cause(exc)}; continue with "
                 f"{resume}", code=1)


def _fail(as_json: bool, line: str, *, code: int,
          failures: list[dict[str, object]] | None = None) -> int:
    print(line, file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps({"error": line, "exit_code": code,
                          **({"failures": failures} if failures else {})}), flush=True)
    return code
