"""Callbacks a run calls at fixed points: the public way to inject faults or watch a run.

`earl chaos` uses them to pause the loop after a step until its fault has fired
(`after_step`) and to fail a checkpoint save as a full disk would (`before_checkpoint`);
tests use them to observe steps. A hook that raises fails what it guards (a save, a step)
exactly as the real failure would, and the run heals from it the same way.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl.loop.schedule import StepRecord

__all__ = ["RunHooks"]


@dataclass(frozen=True, kw_only=True, slots=True)
class RunHooks:
    """Attributes:
        after_step: awaited after each trained step is logged; the next step's training waits
            for it (production may run ahead, within `max_policy_lag`).
        before_checkpoint: awaited with the folder before the trainer saves its checkpoint
            there; raising `OSError` fails that save (the previous checkpoint stays in force).
        env: extra environment variables for every actor process of the run.
    """

    after_step: Callable[[StepRecord], Awaitable[None]] | None = None
    before_checkpoint: Callable[[str], Awaitable[None]] | None = None
    env: dict[str, str] = field(default_factory=dict)
