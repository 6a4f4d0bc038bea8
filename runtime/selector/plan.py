"""The selector's typed inputs and outputs: context statistics, plans, decisions, records.

`ContextTracker` turns each step's trajectory lengths into `ContextStats` (p50/p95/max and the
trend of the max over recent steps). A `Plan` says, per actor, its layout, micro-batch token
budget and slots; a `Decision` wraps the plan with why it was chosen, and whether a shortfall
lies ahead. `Decision.record()` is the flat metrics row, `Decision.trace_event()` the Perfetto
(Chrome trace JSON) instant event. `Policy` is what the loop asks of any policy (the built-in
one is `policy.SearchPolicy`; a run names another with ``selector.policy_factory``).
Not here: how a plan is chosen (`policy`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from earl.runtime.selector.cost import Parallel, Stage


@dataclass(frozen=True, slots=True, kw_only=True)
class ContextStats:
    """Live context lengths of trajectories (tokens). `trend`: growth of the max per step;
    `recent_max`: the longest of the last steps' (`ContextTracker.window`; 0: only this one)."""

    p50: int
    p95: int
    max: int
    trend: float = 0.0
    count: int = 0
    recent_max: int = 0

    def projected(self, steps: int) -> int:
        """The max context expected `steps` steps ahead: the longest of the recent steps plus
        the trend (a step's longest trajectory swings 2x from one step to the next; planning
        for the last one alone would switch layouts back and forth)."""
        return max(self.max, self.recent_max) + round(max(0.0, self.trend) * steps)


class ContextTracker:
    """Keeps the last `window` steps' maxima; `observe` gives this step's statistics.

    Args:
        window: steps the trend (least-squares slope of the per-step max) is fitted over and
            whose longest trajectory is `recent_max`.
    """

    def __init__(self, window: int = 5) -> None:
        if window < 2:
            raise ValueError(f"ContextTracker.window must be >= 2, got {window}")
        self._maxima: deque[int] = deque(maxlen=window)

    def observe(self, lengths: Sequence[int]) -> ContextStats:
        """Statistics of one step's trajectory lengths.

        Raises:
            ValueError: `lengths` is empty.
        """
        if len(lengths) == 0:
            raise ValueError("ContextTracker.observe needs at least one trajectory length")
        a = np.asarray(lengths, dtype=np.int64)
        self._maxima.append(int(a.max()))
        trend = 0.0
        if len(self._maxima) >= 2:
            y = np.asarray(self._maxima, dtype=np.float64)
            trend = float(np.polyfit(np.arange(len(y)), y, 1)[0])
        return ContextStats(p50=int(np.percentile(a, 50)), p95=int(np.percentile(a, 95)),
                            max=int(a.max()), trend=trend, count=int(a.size),
                            recent_max=max(self._maxima))


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorPlan:
    """Where and how one actor runs.

    Attributes:
        micro_batch_tokens: tokens per micro-batch (train, reference) or KV-cache tokens per
            replica (rollout).
        predicted_bytes: the cost model's peak bytes per device (profile-corrected).
        tokens_per_s: expected throughput of the whole layout.
    """

    actor: str
    stage: Stage
    parallel: Parallel
    micro_batch_tokens: int
    slots: tuple[str, ...]
    predicted_bytes: float
    tokens_per_s: float

    def describe(self) -> str:
        return (f"{self.actor}: {self.parallel} on {len(self.slots)} slot(s), "
                f"{self.micro_batch_tokens} tok/micro-batch, "
                f"{self.predicted_bytes / 2**30:.1f} GiB/device, {self.tokens_per_s:,.0f} tok/s")


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """Layouts of every actor for one context bucket (the longest context they must hold)."""

    actors: tuple[ActorPlan, ...]
    context_bucket: int
    feasible: bool = True

    def actor(self, name: str) -> ActorPlan:
        for a in self.actors:
            if a.actor == name:
                return a
        raise KeyError(f"no actor {name!r} in plan; actors: {[a.actor for a in self.actors]}")

    @property
    def tokens_per_s(self) -> float:
        """Pipeline throughput: the slowest stage's."""
        return min((a.tokens_per_s for a in self.actors), default=0.0)

    def layouts(self) -> tuple[tuple[str, Parallel, tuple[str, ...]], ...]:
        return tuple((a.actor, a.parallel, a.slots) for a in self.actors)


@dataclass(frozen=True, slots=True, kw_only=True)
class Shortfall:
    """No configuration will fit: reported `steps_ahead` steps before it is needed."""

    stage: Stage
    context: int
    at_step: int
    steps_ahead: int
    min_devices: int  # devices of today's size that would fit it (0: none up to 64x today's)
    min_device_bytes: float  # or: memory per device needed with today's count (inf: >64x)

    def message(self) -> str:
        dev = (f"{self.min_devices} devices of today's size" if self.min_devices else
               "more memory per device (more devices do not help up to 64x)")
        return (f"{self.stage} cannot fit a {self.context}-token context (expected at step "
                f"{self.at_step}, {self.steps_ahead} step(s) ahead): needs {dev}, or "
                f"today's count of slots with {self.min_device_bytes / 2**30:.1f} GiB each")


@dataclass(frozen=True, slots=True, kw_only=True)
class Decision:
    """One run of the policy: the plan to use now, whether it changed, why."""

    step: int
    when: str  # "rollout" or "prep" (before Experience Preparation)
    plan: Plan
    changed: bool
    reason: str
    context: ContextStats
    shortfall: Shortfall | None = None

    def record(self) -> dict[str, float | int | str]:
        """Flat metrics row (keys prefixed "selector/")."""
        r: dict[str, float | int | str] = {
            "selector/step": self.step, "selector/when": self.when,
            "selector/changed": int(self.changed), "selector/feasible": int(self.plan.feasible),
            "selector/context_bucket": self.plan.context_bucket,
            "selector/context_p50": self.context.p50, "selector/context_p95": self.context.p95,
            "selector/context_max": self.context.max, "selector/context_trend": self.context.trend,
            "selector/tokens_per_s": self.plan.tokens_per_s, "selector/reason": self.reason,
            "selector/shortfall": self.shortfall.message() if self.shortfall else "",
        }
        for a in self.plan.actors:
            p = f"selector/{a.actor}/"
            r.update({p + "tp": a.parallel.tp, p + "pp": a.parallel.pp, p + "dp": a.parallel.dp,
                      p + "micro_batch_tokens": a.micro_batch_tokens, p + "slots": len(a.slots),
                      p + "predicted_gib": a.predicted_bytes / 2**30})
        return r

    def trace_event(self, ts_us: float, *, pid: int = 1, tid: int = 0) -> dict[str, object]:
        """A Chrome-trace instant event (Perfetto shows it on the driver's track)."""
        return {"name": f"selector: {'switch' if self.changed else 'keep'}", "ph": "i", "s": "g",
                "ts": ts_us, "pid": pid, "tid": tid,
                "args": {"reason": self.reason, "step": self.step, "when": self.when,
                         "plan": [a.describe() for a in self.plan.actors],
                         "shortfall": self.shortfall.message() if self.shortfall else ""}}


@dataclass(frozen=True, slots=True)
class SelectorStatistics:
    decisions: int = 0
    switches: int = 0
    kept: int = 0
    infeasible: int = 0
    shortfalls_reported: int = 0
    last_reason: str = ""
    switch_steps: tuple[int, ...] = field(default=())


class Policy(Protocol):
    """A selector policy: the loop (`earl.loop.selection.Selection`) calls `decide` before each
    rollout and each experience preparation and applies the decision's plan.

    A new policy implements these two methods; nothing in the loop changes. A run builds its
    policy with a factory ``(cost, config, measured) -> Policy`` (``selector.policy_factory``;
    `policy.SearchPolicy` itself is the default), where `measured` is the run's live profile
    (`profile.RunProfile`: tokens/s and memory per stage and layout, measured as it trains).
    A policy may also define ``observe_step(*, tokens, seconds, context)``: the loop then gives
    it each training step end to end (its batch's trajectory tokens, the loop's seconds since
    the previous step, their token-weighted length), with ``seconds`` 0 for the steps a change
    and new actors' warm-up ran in (and once at its start, before any step).
    """

    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        """The plan for the coming stage.

        Args:
            step: the RL step (batch) about to run.
            when: "rollout" or "prep" (before experience preparation).
            contexts: live context-length statistics.
            slots: device slot name -> memory bytes an actor there may use.
            queue_depths: the dock's backlog per stage ("train", "reference"), in samples.
        """
        ...

    def statistics(self) -> SelectorStatistics:
        """Decisions, switches and the last reason so far."""
        ...
