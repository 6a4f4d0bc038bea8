"""The clock arithmetic of `bench/race_chain.py`: when the two sides are evaluated, which saved
policy stands for each of those moments, when a curve first reaches a threshold, and the CPU
time of a process tree whose processes come and go.

Pure functions, one small accumulator and one reader of /proc (`tree_readings`); no model, no
process started here. Times are seconds of a side's process age (its start-up counts, as in
`earl train`'s `time_limit_minutes`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

__all__ = ["TreeCpu", "cpu_between", "eval_points", "policy_at", "time_to", "tree_readings",
           "verdict", "versus"]


def eval_points(minutes: float, every_min: float) -> list[float]:
    """The wall-clock points (seconds of process age) where both sides are evaluated: every
    `every_min` minutes, and the budget's end (once, also when it is not a multiple).

    >>> eval_points(12, 5)
    [300.0, 600.0, 720.0]

    Raises:
        ValueError: a budget or interval that is not positive.
    """
    if minutes <= 0 or every_min <= 0:
        raise ValueError(f"--minutes and --eval-every-min must be > 0, got {minutes}, {every_min}")
    end = minutes * 60.0
    step = every_min * 60.0
    points = [round(k * step, 3) for k in range(1, math.floor(end / step + 1e-9) + 1)]
    if not points or end - points[-1] > 1e-6:
        points.append(round(end, 3))
    return points


def policy_at(saved: Sequence[tuple[float, str]], t: float) -> str | None:
    """The policy in force at age `t`: the last of `saved` ((age it was saved, name), in the
    order saved) saved at or before `t`; None when none was yet."""
    best = None
    for age, name in saved:
        if age <= t:
            best = name
        else:
            break
    return best


def time_to(curve: Sequence[tuple[float, float]], threshold: float) -> float | None:
    """The first point's time ((time, accuracy) in time order) whose accuracy reaches
    `threshold`; None when no point does."""
    for t, acc in curve:
        if acc >= threshold:
            return t
    return None


def versus(earl: Sequence[tuple[float, float]], trl: Sequence[tuple[float, float]]
           ) -> list[dict[str, float | bool]]:
    """Point by point (same times on both sides), EARL's accuracy against TRL's: each row has
    the time, both accuracies and whether EARL's is at least TRL's.

    Raises:
        ValueError: the two curves are not evaluated at the same times.
    """
    if [t for t, _ in earl] != [t for t, _ in trl]:
        raise ValueError("both sides must be evaluated at the same points")
    return [{"t_s": t, "earl": a, "trl": b, "earl_at_least": a >= b}
            for (t, a), (_, b) in zip(earl, trl, strict=True)]


def verdict(earl: Sequence[tuple[float, float]],
            trl: dict[str, Sequence[tuple[float, float]]]) -> dict[str, object]:
    """EARL's curve against the best TRL arm at each point (arms that ran, all evaluated at
    EARL's points): ``trl_best_curve``, ``versus`` (point by point), ``earl_at_least_after_first``
    (EARL's accuracy >= TRL's best at every point after the first) and
    ``earl_time_to_trl_final_s`` (EARL's first point at or above TRL's best final accuracy).
    Without EARL or without a TRL arm, only what can be said."""
    arms = [list(c) for c in trl.values() if c]
    best = [(t, max(c[i][1] for c in arms)) for i, (t, _) in enumerate(arms[0])] if arms else []
    if not earl or not best:
        return {"trl_best_curve": best, "versus": None, "earl_at_least_after_first": None,
                "earl_time_to_trl_final_s": None}
    rows = versus(earl, best)
    return {"trl_best_curve": best, "versus": rows,
            "earl_at_least_after_first": all(bool(r["earl_at_least"]) for r in rows[1:]),
            "earl_time_to_trl_final_s": time_to(earl, best[-1][1])}


@dataclass(slots=True)
class TreeCpu:
    """CPU seconds (user + system) of a process tree sampled now and then: each process'
    latest reading is kept after it exits, so a tree whose workers come and go is counted
    whole (up to the last sample of each). A process is keyed by (pid, start time): a reused
    pid is another process."""

    seen: dict[tuple[int, float], float] = field(default_factory=dict)

    def update(self, readings: Iterable[tuple[int, float, float]]) -> None:
        """Record (pid, start time, CPU seconds so far) for the processes alive now."""
        for pid, started, cpu in readings:
            key = (pid, started)
            self.seen[key] = max(cpu, self.seen.get(key, 0.0))

    def total(self) -> float:
        return sum(self.seen.values())

    def processes(self) -> int:
        return len(self.seen)


def tree_readings(pid: int) -> tuple[list[tuple[int, float, float]], float]:
    """(pid, start time, CPU s so far) of each process of `pid`'s tree now (for `TreeCpu`),
    and their summed RSS in MiB."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return [], 0.0
    out, rss = [], 0
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out.append((p.pid, p.create_time(), t.user + t.system))
                rss += p.memory_info().rss
        except psutil.Error:
            continue
    return out, rss / 2**20


def cpu_between(timeline: Sequence[tuple[float, float]], t0: float, t1: float) -> float:
    """CPU seconds a tree spent between its ages `t0` and `t1`, from `timeline`'s (age s, CPU s
    so far) readings in order, interpolated linearly between readings (clamped at the ends).

    >>> cpu_between([(0.0, 0.0), (10.0, 5.0), (20.0, 25.0)], 5.0, 15.0)
    12.5
    """
    if not timeline:
        raise ValueError("cpu_between needs at least one (age, CPU) reading")

    def at(t: float) -> float:
        if t <= timeline[0][0]:
            return timeline[0][1]
        for (a, ca), (b, cb) in itertools.pairwise(timeline):
            if t <= b:
                return ca + (cb - ca) * (t - a) / (b - a) if b > a else cb
        return timeline[-1][1]

    return at(t1) - at(t0)
