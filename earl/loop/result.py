"""What a run returns and leaves behind: `RunResult` and its `result.json`, plots and paths."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from earl.loop.failures import failures_json

if TYPE_CHECKING:
    from earl.loop.job import Job
    from earl.loop.schedule import LoopState

__all__ = ["RunResult", "write_result"]


@dataclass(kw_only=True, slots=True)
class RunResult:
    """What `earl.train` returns (and `earl train --json` prints)."""

    eval: dict[str, float]
    eval_start: dict[str, float]
    wall_minutes: float
    steps: int
    policy_version: int
    episodes: int
    recipe: str = ""
    target_key: str = "reward"
    evals: list[dict[str, float]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)  # error text -> failed episodes
    files: dict[str, str] = field(default_factory=dict)
    stopped: str = ""
    selected_step: int = -1

    def to_json(self) -> dict[str, object]:
        return {"recipe": self.recipe, "eval": self.eval, "eval_start": self.eval_start,
                "target_key": self.target_key, "wall_minutes": round(self.wall_minutes, 3),
                "steps": self.steps, "policy_version": self.policy_version,
                "episodes": self.episodes, "games": self.episodes, "stopped": self.stopped,
                "selected_step": self.selected_step,
                "failed_episodes": sum(self.failures.values()),
                "failures": failures_json(self.failures),
                "evals": self.evals, **self.files}


def write_result(job: Job, state: LoopState, final: dict[str, float], stopped: str,
                 selected: int) -> RunResult:
    """Close the metrics, draw the plots, write `result.json`; returns the result."""
    from earl.observe import read_metrics, write_plots

    assert job.metrics is not None
    job.metrics.close()
    out, recipe = job.out, job.recipe
    files = {"metrics": str(job.metrics.path), "checkpoint": str(out / "checkpoint"),
             "weights": str(job.weights), "config": str(out / "config.json")}
    evals = state.evals + [dict(final, minutes=job.elapsed() / 60)]
    plots = write_plots(read_metrics(job.metrics.path), evals, out, key=recipe.target_key,
                        title=recipe.name)
    files.update({f"plot_{k}": v for k, v in plots.items()})
    files["plot"] = files["plot_reward"]
    if job.cfg.dump_trajectories:
        files["trajectories"] = str(out / "trajectories.jsonl")
    if job.trace:
        files["trace"] = str(job.tracer.write(out / "trace.json"))
        if job.tracer.spool is not None:  # all of it is in trace.json now
            job.tracer.spool.unlink(missing_ok=True)
    if job.cfg.select_best and state.best[0] >= 0:
        files["weights_selected"] = str(job.best_dir)
    result = RunResult(eval=final, eval_start=state.eval_start, recipe=recipe.name,
                       target_key=recipe.target_key, wall_minutes=job.elapsed() / 60,
                       steps=state.step, policy_version=state.step, episodes=state.episodes,
                       evals=state.evals, failures=state.failures, files=files,
                       stopped=stopped, selected_step=selected)
    (out / "result.json").write_text(json.dumps(result.to_json(), indent=2))
    return result
