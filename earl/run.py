"""`earl train` and `earl.train(...)`: one general RL run.

`train` builds the run's config (a recipe's defaults, a YAML file or dict, keyword overrides)
and `run` resolves what to train (a shipped recipe, or a user's agent + tasks), builds the
run's `Job` and runs it (`earl.loop.main.run_job` -> `train_attempt`).

One sample's path: agent coroutine (producer actor) -> the producer's dock shard -> the
reference adds "ref_logprobs" on its shard -> the trainer ranks fetch straight from both ->
weights back to the vLLM rollout actors. The driver carries metadata only.

`runtime` is the actors' runtime of a run, shared with `earl eval` (`earl.evaluate`).

Not here: the loop (`earl.loop`), the actors (`earl.stages`), the CLI (`earl.commands.train`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.config import RunConfig, to_dict
from earl.loop.result import RunResult
from earl.resolve import resolve_recipe

if TYPE_CHECKING:
    from earl.runtime import Runtime

__all__ = ["RunResult", "run", "train"]


def train(config: RunConfig | str | dict[str, object] | None = None, *,
          agent: Callable[..., Any] | None = None, tasks: Iterable[object] | None = None,
          resume: bool = False, trace: bool = False, verbose: bool = False,
          log: Callable[[str], None] = print, **overrides: object) -> RunResult:
    """Train from Python; returns what `earl train --json` prints.

    Args:
        config: a RunConfig, a YAML path, or a dict of fields (None: the defaults).
        agent: an `async def agent(rollout, sample) -> float` defined at module level.
        tasks: training samples (any iterable of JSON-like values), with `agent`.
        verbose: library warnings and progress bars of the actors (vLLM, transformers) to
            the terminal; otherwise they go to `<output_dir>/run.log`.
        overrides: RunConfig fields, e.g. `steps=20`, `optim={"lr": 1e-4}`.

    Example:
        >>> result = earl.train(agent=my_agent, tasks=problems, steps=50, output_dir="runs/a")
    """
    from earl.config import _merge, from_dict, read_yaml, validate
    from earl.recipe import load_recipe

    if isinstance(config, RunConfig):
        data: dict[str, object] = to_dict(config)
    elif isinstance(config, str):
        data = read_yaml(config)
    else:
        data = dict(config or {})
    data = _merge(data, dict(overrides))
    if agent is not None and (data.get("agent") or data.get("tasks")):
        raise ValueError("pass the agent either as agent= or as the agent/tasks config fields")
    defaults = {} if agent is not None or data.get("agent") or isinstance(config, RunConfig) \
        else load_recipe(str(data.get("recipe", "tictactoe"))).config
    cfg = from_dict(RunConfig, _merge(dict(defaults), data))
    validate(cfg)
    if agent is not None and tasks is None:
        raise ValueError("agent= needs tasks=: an iterable of samples")
    return asyncio.run(run(cfg, agent=agent, tasks=tasks, resume=resume, trace=trace,
                           verbose=verbose, log=log))


async def run(cfg: RunConfig, *, agent: Callable[..., Any] | None = None,
              tasks: Iterable[object] | None = None, resume: bool = False,
              trace: bool = False, verbose: bool = False,
              log: Callable[[str], None] = print,
              progress: Callable[[dict[str, Any]], None] | None = None) -> RunResult:
    """Run the whole job; returns the evaluations and the paths of every output file.
    Unless `verbose`, the actors' output and this process' warnings go to
    `<output_dir>/run.log` (`quiet_logs`). `log` gets each event line, `progress` each
    step's metrics row (None: its progress line to `log`); run.log gets both."""
    recipe, ref = resolve_recipe(cfg, agent=agent, tasks=tasks)
    async with runtime(cfg, verbose=verbose) as rt:
        from earl.loop.job import Job
        from earl.loop.main import run_job

        return await run_job(Job(cfg, recipe, ref, rt, log=log, progress=progress,
                                 trace=trace), resume)


@contextlib.asynccontextmanager
async def runtime(cfg: RunConfig, *, verbose: bool = False) -> AsyncIterator[Runtime]:
    """The runtime `cfg`'s actors run in, as its placement says (local or Ray launcher).
    Actors may write only under the output folder; unless `verbose`, their output goes to
    `<output_dir>/run.log` (`quiet_logs`)."""
    from earl.runtime import Runtime, RuntimeConfig, registry

    # Actors write checkpoints and weights only under roots the run allows: its output folder.
    registry.allow_root(Path(cfg.output_dir).resolve())
    actor_log = None if verbose else quiet_logs(Path(cfg.output_dir))
    ray = cfg.placement.launcher == "ray"
    async with Runtime(RuntimeConfig(launcher=cfg.placement.launcher, actor_log=actor_log,
                                     ray_resources=cfg.placement.host_resources() if ray else {},
                                     ray_gpus=cfg.placement.ray_gpus() if ray else {})) as rt:
        yield rt


def quiet_logs(out: Path) -> str:
    """Send library noise to `out/run.log`: the actors' output (vLLM's and transformers'
    warnings, progress bars) and this process' Python warnings. Returns the file's path."""
    import logging
    import os

    out.mkdir(parents=True, exist_ok=True)
    path = out / "run.log"
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    logging.captureWarnings(True)
    warnings_log = logging.getLogger("py.warnings")
    if not any(getattr(h, "baseFilename", "") == str(path.resolve())
               for h in warnings_log.handlers):
        warnings_log.addHandler(logging.FileHandler(path))
        warnings_log.propagate = False
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    return str(path)
