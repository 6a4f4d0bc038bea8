"""The run's progress watchdog: a run that stops making progress ends with an error naming
where it waits, instead of hanging.

Progress is a trained step, a batch played (a group, with partial rollouts) or a healing event
(a restart seen, a process rebuilt, a group played again, a step retried: `Supervisor.active_at`). The schedule says what it waits for at each
moment (`waiting`: a batch's rollout, the trainer's step, a weight push, an eval, a
checkpoint). When nothing progresses for `limit_s()` seconds, `watch` raises `Stalled` with
that stage, the step each rebuild in progress is at (`Supervisor.rebuilding`) and, if given, what the
dock holds. The limit scales with the run: `stall_steps` times its longest step so far (the
time between two trained steps, evals and checkpoints included), and never under `stall_s`.

Not here: what a stall costs. `earl.loop.supervisor.Supervisor.supervise` heals it as it heals a trainer's
death, by a rewind to the last checkpoint; past `max_restarts` rewinds the run stops with the
`Stalled` error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping

from earl.runtime.errors import causes

__all__ = ["Stalled", "Watchdog", "stalled_in"]


class Stalled(RuntimeError):
    """The run made no progress for `idle_s` seconds (its limit: `limit_s`).

    Attributes:
        stage: what the schedule was waiting for ("" before it said).
        idle_s: seconds since the last step or healing event.
        limit_s: the limit it passed.
        healing: "group[rank]" -> the rebuild step each rebuild in progress was at.
        detail: what the run's diagnosis saw (the dock's samples and waiters), or "".
    """

    def __init__(self, stage: str, idle_s: float, limit_s: float,
                 healing: Mapping[str, str] | None = None, detail: str = "") -> None:
        self.stage, self.idle_s, self.limit_s = stage, idle_s, limit_s
        self.healing, self.detail = dict(healing or {}), detail
        rebuilds = "; ".join(f"{k} at {v}" for k, v in sorted(self.healing.items()))
        super().__init__(
            f"no progress for {idle_s:.0f} s (limit {limit_s:.0f} s) while waiting for "
            f"{stage or 'the run to start'}" + (f"; rebuilding {rebuilds}" if rebuilds else "")
            + (f"; {detail}" if detail else ""))

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.stage, self.idle_s, self.limit_s, self.healing, self.detail))


def stalled_in(exc: BaseException) -> Stalled | None:
    """The `Stalled` behind `exc` (itself, in its exception groups, causes or contexts)."""
    return next((e for e in causes(exc) if isinstance(e, Stalled)), None)


class Watchdog:
    """Args:
        stall_s: the least seconds without progress that count as a stall (0: never).
        stall_steps: the limit in longest steps so far, when that is more than `stall_s`.
        clock: monotonic seconds (fake it in tests).
        activity: when the supervisor last did something (`Supervisor.active_at`, same clock).
        healing: what each rebuild in progress is doing (`Supervisor.rebuilding`).
        diagnose: a description of where the data waits (the dock's statistics), read when a
            stall is found (given 10 s).
    """

    def __init__(self, *, stall_s: float, stall_steps: float,
                 clock: Callable[[], float] = time.monotonic,
                 activity: Callable[[], float] = lambda: 0.0,
                 healing: Callable[[], Mapping[str, str]] = dict,
                 diagnose: Callable[[], Awaitable[str]] | None = None) -> None:
        if stall_s < 0 or stall_steps < 0:
            raise ValueError(f"stall_s and stall_steps must be >= 0, got {stall_s}, "
                             f"{stall_steps}")
        self.stall_s, self.stall_steps, self.clock = stall_s, stall_steps, clock
        self.activity, self.healing, self.diagnose = activity, healing, diagnose
        self.started = self.last_step = self.last_beat = clock()
        self.longest_step = 0.0
        self.stage = ""

    def step_done(self) -> None:
        """A step was trained: progress, and one more step time to scale the limit by."""
        now = self.clock()
        self.longest_step = max(self.longest_step, now - self.last_step)
        self.last_step = self.last_beat = now

    def beat(self) -> None:
        """Progress other than a step (the watchdog also reads `activity`)."""
        self.last_beat = self.clock()

    @contextlib.contextmanager
    def waiting(self, stage: str) -> Iterator[None]:
        """The schedule waits for `stage` while the block runs."""
        before, self.stage = self.stage, stage
        try:
            yield
        finally:
            self.stage = before

    def limit_s(self) -> float:
        return max(self.stall_s, self.stall_steps * self.longest_step)

    def idle_s(self) -> float:
        return self.clock() - max(self.last_beat, self.activity())

    def check(self) -> Stalled | None:
        """The stall now, if there is one (no diagnosis)."""
        if self.stall_s <= 0:
            return None
        idle, limit = self.idle_s(), self.limit_s()
        if idle < limit:
            return None
        return Stalled(self.stage, idle, limit, self.healing())

    async def watch(self, every_s: float = 1.0) -> None:
        """Check every `every_s` seconds; raise `Stalled` (with the diagnosis) at a stall.
        Run it beside the schedule and cancel it when the schedule ends."""
        if self.stall_s <= 0:
            return
        while (stall := self.check()) is None:
            await asyncio.sleep(every_s)
        detail = ""
        if self.diagnose is not None:
            try:
                async with asyncio.timeout(10.0):
                    detail = await self.diagnose()
            except Exception as exc:  # noqa: BLE001 - the stall is the error; this is detail
                detail = f"the dock did not answer ({type(exc).__name__})"
        raise Stalled(stall.stage, stall.idle_s, stall.limit_s, stall.healing, detail)
