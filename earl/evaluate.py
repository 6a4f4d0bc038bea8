"""`earl eval`'s work: what a saved policy is, and its greedy evaluation as `earl train` runs it.

A saved policy is a run folder (`earl train --output-dir`: `config.json` holds the run's
resolved config, `result.json` its final step and the step model selection chose) or a Hugging
Face model folder (one of a run's, e.g. `weights_best/`, or any other). `saved_policy` finds
the weights, the config to start from and the step; `eval_config` lays the user's flags over
that config; `evaluate_saved` serves the weights on the rollout replicas, plays the recipe's
"final" eval on the producers (`earl.loop.spawn.evaluating`, the same `ActorEvaluation` the
run used) and returns the metric: what `earl train --json` printed as `eval`.

Not here: training (`earl.run`), the command line (`earl.commands.eval`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from earl.config import RunConfig

__all__ = ["EvalReport", "SavedPolicy", "eval_config", "evaluate_saved", "saved_policy"]

NAME_IT = "--recipe NAME, or --agent PATH.py:NAME --eval-tasks FILE.jsonl"


@dataclass(frozen=True, kw_only=True, slots=True)
class SavedPolicy:
    """A policy to evaluate.

    Attributes:
        weights: the HF folder the rollout serves.
        step: the step of the run's final eval (0 outside a run): a recipe's eval samples may
            depend on it (`EvalSet.make(split, step, n)`).
        config: the run's `config.json`, or None for a model folder outside a run.
        run: the run folder, or None.
    """

    weights: Path
    step: int = 0
    config: dict[str, object] | None = None
    run: Path | None = None


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalReport:
    """What `earl eval --json` prints: `eval` is the recipe's metric, as in `earl train`'s."""

    eval: dict[str, float]
    recipe: str
    target_key: str
    weights: str
    step: int
    wall_minutes: float

    def to_json(self) -> dict[str, object]:
        return {"recipe": self.recipe, "eval": self.eval, "target_key": self.target_key,
                "weights": self.weights, "step": self.step,
                "wall_minutes": round(self.wall_minutes, 3)}


def _read(path: Path) -> dict[str, object] | None:
    """A JSON object file, or None (missing, unreadable, not an object)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _kind(folder: Path) -> str:
    """"run" (config.json of a run's fields), "model" (config.json with a model_type) or ""."""
    cfg = _read(folder / "config.json")
    if cfg is None:
        return ""
    if "model_type" in cfg:
        return "model"
    return "run" if "recipe" in cfg and "placement" in cfg else ""


def _step(run: Path) -> tuple[int, int]:
    """The final step of a finished run and the step model selection chose (-1: none)."""
    result = _read(run / "result.json") or {}
    step = int(str(result.get("steps", 0)))
    return step, int(str(result.get("selected_step", -1)))


def saved_policy(path: str) -> SavedPolicy:
    """The policy at `path`: a finished run folder (the weights its final eval served:
    `weights_best/` when model selection chose an earlier step, else `weights/`), or a model
    folder (inside a run folder: with that run's config and step).

    Raises:
        ValueError: `path` is neither, or the run has not finished; the message says the fix.
    """
    p = Path(path)
    if _kind(p) == "run":
        if not (p / "result.json").is_file():
            raise ValueError(f"{path} has no result.json: the run has not finished. Finish it "
                             f"with `earl train --output-dir {path} --resume`, or evaluate "
                             f"one of its model folders, e.g. `earl eval {p / 'weights_best'}`")
        step, selected = _step(p)
        weights = p / ("weights_best" if selected not in (-1, step) else "weights")
        if _kind(weights) != "model":
            raise ValueError(f"{weights} is not a model folder (no config.json with a "
                             "model_type); re-run `earl train` to write it")
        return SavedPolicy(weights=weights, step=step, config=_read(p / "config.json"), run=p)
    if _kind(p) == "model":
        if _kind(p.parent) == "run":
            return SavedPolicy(weights=p, step=_step(p.parent)[0],
                               config=_read(p.parent / "config.json"), run=p.parent)
        return SavedPolicy(weights=p)
    what = "does not exist" if not p.exists() else \
        "is neither a run folder (config.json of `earl train`) nor a Hugging Face model " \
        "folder (config.json with a model_type)"
    raise ValueError(f"{path} {what}; pass a run folder, e.g. `earl eval runs/latest`, or a "
                     f"model folder with {NAME_IT}")


def eval_config(policy: SavedPolicy, overrides: dict[str, object], *, output_dir: str
                ) -> RunConfig:
    """The run's config (a model folder outside a run: the named recipe's defaults) with
    `overrides` (RunConfig fields, as `earl.config_parse.parse_overrides` gives them) on top.
    Naming `recipe` or `agent` replaces the run's task. The eval writes into `output_dir`
    and dumps no trajectories.

    Raises:
        ValueError: nothing says what to evaluate on, or a field is bad (named).
    """
    from earl.config import validate
    from earl.config_parse import _merge, from_dict
    from earl.recipe import load_recipe

    named = bool(overrides.get("recipe") or overrides.get("agent"))
    if policy.config is None and not named:
        raise ValueError(f"{policy.weights} is a model folder outside a run: say what to "
                         f"evaluate it on with {NAME_IT}")
    base = dict(policy.config or {})
    if named:  # the user's task instead of the run's
        for key in ("recipe", "agent", "tasks", "eval_tasks"):
            base.pop(key, None)
    for key in ("agent", "eval_tasks", "reward"):  # the run's own files, as `earl train` saw them
        value = str(base.get(key) or "")
        file = value if key == "eval_tasks" else value.rpartition(":")[0]
        if key not in overrides and file and (key == "eval_tasks" or file.endswith(".py")) \
                and not Path(file).is_file():
            raise ValueError(f"{key} {file} of {policy.run}/config.json does not exist here (a "
                             "relative path counts from where `earl train` ran): run `earl "
                             f"eval` there, or pass --{key.replace('_', '-')} FILE")
    data = _merge(base, dict(overrides))
    if policy.config is None and not data.get("agent"):
        data = _merge(dict(load_recipe(str(data["recipe"])).config), data)
    if data.get("agent") and not data.get("tasks"):
        if not data.get("eval_tasks"):
            raise ValueError(f"--agent needs --eval-tasks FILE.jsonl: the samples to evaluate "
                             f"{policy.weights} on")
        data["tasks"] = data["eval_tasks"]  # an agent's config needs tasks; an eval plays none
    data.update(output_dir=output_dir, dump_trajectories=False)
    cfg: RunConfig = from_dict(RunConfig, data)
    validate(cfg)
    return cfg


async def evaluate_saved(cfg: RunConfig, policy: SavedPolicy, *, verbose: bool = False,
                         log: Callable[[str], None] = print) -> EvalReport:
    """Evaluate `policy` greedily on `cfg`'s recipe (its "final" eval at `policy.step`).

    Raises:
        ValueError: a bad agent, eval file or reward rule, or a recipe without eval tasks
            (before any actor starts).
    """
    from earl.loop.job import Job
    from earl.loop.spawn import evaluating
    from earl.resolve import resolve_recipe
    from earl.run import runtime

    t0 = time.perf_counter()
    recipe, ref = resolve_recipe(cfg, tasks=())  # an eval plays no training task
    async with runtime(cfg, verbose=verbose) as rt:
        job = Job(cfg, recipe, ref, rt, log=log, start=policy.weights)
        try:
            async with evaluating(job) as evaluation:
                ev = await evaluation.evaluate("final", policy.step)
        finally:
            job.close()
    return EvalReport(eval=ev, recipe=recipe.name, target_key=recipe.target_key,
                      weights=str(policy.weights), step=policy.step,
                      wall_minutes=(time.perf_counter() - t0) / 60)
