"""One metrics row and one progress line per trained step.

`StepLog` is the schedule's `observe` callback: from a `StepRecord` (the batch's episodes, the
trainer's metrics, the step's seconds) it writes a row to `metrics.jsonl` (reward, failure
and truncation rates and the step's most frequent error, context lengths, staleness, seconds per
phase, restarts, bytes per transport of each flow), hands it to `Job.step` (run.log, the
progress display) and logs each error text the run has not seen before as an event.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from earl.loop.failures import add_failures, describe
from earl.runtime.errors import ActorDied

if TYPE_CHECKING:
    from earl.loop.job import Job
    from earl.loop.schedule import StepRecord
    from earl.stages.batch_types import Episode

__all__ = ["StepLog", "info_rates", "slot_idle_share"]


class StepLog:
    """Logs each step of `job`'s attempt in force."""

    def __init__(self, job: Job) -> None:
        self.job = job
        self._reference_total = 0.0
        self._reference_bytes: dict[str, int] = {}

    async def __call__(self, r: StepRecord) -> None:
        job = self.job
        assert job.metrics is not None
        rec = step_row(r, steps=job.cfg.steps)
        rec.update(job.attempt.training.seconds)
        rec.update(job.attempt.training.flows)  # bytes per transport: experience, weights
        rec.update(await self._reference_since(), wall_s=job.elapsed())
        rec.update(job.supervisor.metrics())  # restarts/<actor>, rewinds
        job.metrics.log(rec)
        for text in r.new_errors:
            job.log(f"episodes failing (first at step {r.version}): {text}")
        job.step(rec)
        if job.hooks.after_step is not None:
            await job.hooks.after_step(r)

    async def _reference_since(self) -> dict[str, float]:
        """The reference actors' busy seconds (`reference_s`) and the bytes each transport
        carried warehouses -> reference, since the last step."""
        reference = self.job.attempt.actors.reference
        if reference is None:
            return {"reference_s": 0.0}
        try:
            busy = sum(await reference.busy_seconds.call())
            parts = await reference.fetched_bytes.call()
        except ActorDied:  # restarting: the next step counts from its new process (from 0)
            self._reference_total, self._reference_bytes = 0.0, {}
            return {"reference_s": 0.0}
        total: dict[str, int] = {}
        for part in parts:
            for kind, n in part.items():
                total[kind] = total.get(kind, 0) + n
        last, self._reference_bytes = self._reference_bytes, total
        out = {f"transport/reference_bytes/{k}": float(n - last.get(k, 0))
               for k, n in total.items() if n > last.get(k, 0)}
        out["reference_s"], self._reference_total = busy - self._reference_total, busy
        return out


def step_row(r: StepRecord, *, steps: int) -> dict[str, Any]:
    """The metrics of one step's episodes and training."""
    eps = r.result.episodes
    n = max(len(eps), 1)
    tokens = sum(e.tokens for e in eps)
    generated = sum(e.generated for e in eps)
    stale = (sum((r.version - 1) * e.generated - e.version_sum for e in eps) / generated
             if generated else 0.0)
    errors: dict[str, int] = {}
    add_failures(errors, eps)
    return {
        **{f"train/{k}": v for k, v in r.train.items()}, "step": r.version, "steps": steps,
        "episodes": len(eps),
        "reward": float(np.mean([0.0 if e.reward is None else e.reward for e in eps]))
        if eps else 0.0,
        "failed_rate": sum(e.failed for e in eps) / n,
        **({"failed_error": describe(errors, top=1, chars=120)} if errors else {}),
        "truncated_rate": sum(e.truncated for e in eps) / n,
        "tokens_per_s": tokens / max(r.step_s, 1e-6), "staleness": stale,
        "ctx_mean": tokens / n, "ctx_max": max((e.tokens for e in eps), default=0),
        "turns_mean": sum(e.turns for e in eps) / n, "generated_mean": generated / n,
        "groups_cut": len(r.result.cut),
        "step_s": r.step_s, "rollout_s": r.result.seconds, "lr_scale": r.lr_scale,
        "straggler_wait_s": r.straggler_wait_s, "stale_groups": r.stale_groups,
        **filtered_row(eps, r.filtered),
        "groups_running": r.groups_running,
        "staleness_max": staleness_max(r),
        "slot_idle_share": slot_idle_share(eps, r.slots, r.step_s),
        **info_rates(eps)}


def filtered_row(trained: list[Episode], filtered: list[Episode]) -> dict[str, float]:
    """`algorithm.filter_groups`: the groups a step skipped (all alike) and the mean reward
    over every episode it took, skipped ones included ("reward" is the trained episodes')."""
    eps = [*trained, *filtered]
    return {"filtered_groups": len({e.group_id for e in filtered}),
            "reward_played": float(np.mean([0.0 if e.reward is None else e.reward
                                            for e in eps])) if eps else 0.0}


def staleness_max(r: StepRecord) -> int:
    """How many versions older than its step the oldest token it trained is: read from the
    trainer's tokens where it bounded them (`oldest_version`), else from the episodes."""
    if "oldest_version" in r.train:
        return r.version - 1 - int(r.train["oldest_version"])
    return max((r.version - 1 - e.first_version for e in r.result.episodes
                if e.first_version >= 0), default=0)


def slot_idle_share(eps: list[Episode], slots: int, seconds: float) -> float:
    """The share of the `slots` rollout slots (episodes the staleness gate lets run at once)
    that stood idle over `seconds`, estimated from the episodes one step trains: in steady
    state a step's episodes are the ones the slots finished in its time."""
    if slots <= 0 or seconds <= 0:
        return 0.0
    busy = sum(float(e.info.get("episode_s", 0.0)) for e in eps)
    return min(max(1.0 - busy / (slots * seconds), 0.0), 1.0)


def info_rates(eps: list[Episode]) -> dict[str, float]:
    """Means of numeric `info` values and rates of string ones (`info/outcome=win`)."""
    out: dict[str, float] = {}
    n = max(len(eps), 1)
    for e in eps:
        for k, v in e.info.items():
            if k == "seed":
                continue
            if isinstance(v, str):
                out[f"info/{k}={v}"] = out.get(f"info/{k}={v}", 0.0) + 1 / n
            else:
                out[f"info/{k}"] = out.get(f"info/{k}", 0.0) + float(v) / n
    return out
