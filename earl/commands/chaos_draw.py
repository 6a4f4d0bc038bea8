"""Fault schedules drawn from a seed (`earl chaos --draw N --seed S`), as Jepsen's nemesis
draws them: which faults, in what order, after which step, at which point of the step after it,
and whether a process' death comes before the previous one has healed.

The same (N, seed, steps) always draws the same schedule, so a failing one is replayed by its
seed (`bench/chaos_sweep.py` keeps them). Not here: firing the faults
(`earl.commands.chaos_injector`).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

__all__ = ["DRAWN", "Drawn", "draw"]

# Every fault of the full list but `lose:sample` (it tests the judge: its run must fail) and
# `kill:rollout_span` (it runs under partial rollouts, where a dropped connection is not
# healed yet: docs/design/healing.md). `stall:tool` is always last when drawn (the gate of a
# fault after it would hold the sessions that must call the tool).
DRAWN = ("kill:producer", "kill:reference", "kill:rollout", "kill:dock", "kill:trainer",
         "drop:producer", "drop:reference", "corrupt_frame", "delay", "disk_full",
         "squat:shm", "slowloris", "kill:resave", "stall:tool")
HEALED_IN_PLACE = ("kill:producer", "kill:reference", "kill:rollout", "drop:producer",
                   "drop:reference")  # deaths healed in place: they may overlap


@dataclass(frozen=True, slots=True)
class Drawn:
    """A schedule: fault i fires after step `after_step[i]`, `at[i]` of a step's time later;
    with `overlap[i]` it does not wait for fault i - 1 to heal first (both are deaths healed
    in place), else it does."""

    faults: tuple[str, ...]
    after_step: tuple[int, ...]
    at: tuple[float, ...]
    overlap: tuple[bool, ...]

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def draw(n: int, seed: int, steps: int, *, checkpoint_every: int = 2) -> Drawn:
    """`n` distinct faults of `DRAWN` for a run of `steps` steps.

    Raises:
        ValueError: `n` is not in 1..len(DRAWN), or `steps` < 3 (a fault needs a step before
            it and two after it).
    """
    if not 1 <= n <= len(DRAWN):
        raise ValueError(f"--draw must be in 1..{len(DRAWN)} (distinct faults), got {n}")
    if steps < 3:
        raise ValueError(f"--steps must be >= 3 to draw faults into, got {steps}")
    rng = random.Random(seed)
    faults = rng.sample(DRAWN, n)
    if "stall:tool" in faults:
        faults.remove("stall:tool")
        faults.append("stall:tool")
    last = steps - 2  # the last fault leaves two steps to show the run recovered
    after = sorted(rng.randint(1, last) for _ in faults)
    for i, f in enumerate(faults):
        if f == "kill:resave":  # it needs a checkpoint in force
            after[i] = max(after[i], min(checkpoint_every, last))
    after = [max(after[: i + 1]) for i in range(len(after))]  # still in order
    at = [round(rng.random(), 3) for _ in faults]
    overlap = [i > 0 and faults[i] in HEALED_IN_PLACE and faults[i - 1] in HEALED_IN_PLACE
               and rng.random() < 0.5 for i in range(len(faults))]
    return Drawn(faults=tuple(faults), after_step=tuple(after), at=tuple(at),
                 overlap=tuple(overlap))
