"""One attempt of a run: its live actor groups and the loop's parts over them.

The first attempt, and one per rewind (`earl.loop.supervisor.Supervisor.supervise`), is
spawned by `earl.loop.spawn.spawn_attempt`; the attempt in force is `Job.attempt`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl.loop.actors import Actors
    from earl.loop.evaluation import ActorEvaluation
    from earl.loop.production import ActorProduction
    from earl.loop.schedule import Selection
    from earl.loop.training import ActorTraining

__all__ = ["Attempt"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """An attempt's live actors and the loop's parts over them."""

    actors: Actors
    production: ActorProduction
    training: ActorTraining
    evaluation: ActorEvaluation | None
    selection: Selection | None  # the selector's, or colocation's turns (earl.loop.colocation)
