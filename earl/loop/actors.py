"""The run's live actor groups: the one place that says which trainer and rollout are live.

`Actors` holds a handle per group (trainer ranks, rollout replicas, producers, reference, the
dock's client) and the trainer's micro-batch token budget. The loop's parts read the groups
from it at each call, so a group re-created by the selector (`earl.loop.selection_actors`) or
looked up again after a restart (`earl.loop.healing_parts`) is seen by every part at once.
What changes during a run changes through its methods (`use_rollout`, `use_trainer`,
`use_reference`, `set_micro_batch_tokens`); nothing else assigns its attributes.

Not here: spawning the groups (`earl.loop.spawn`), or what each part does with them
(`earl.loop.parts`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from earl.runtime import ActorGroup
    from earl.runtime.dock import Dock
    from earl.stages.producer import ProducerActor
    from earl.stages.reference import ReferenceActor
    from earl.stages.rollout import RolloutActor

__all__ = ["Actors"]


class Actors:
    """The live groups of one run attempt (a rewind spawns a new `Actors`).

    Args:
        trainer: the trainer ranks.
        dock: the dock's client (the index; shards live in producers and reference).
        reference: the reference actors, or None without a KL term.
        micro_batch_tokens: the trainer's micro-batch token budget (None: its own setting).

    The rollout replicas and the producers are spawned after the trainer (the selector's first
    plan decides the rollout's layout), and join with `use_rollout` / `use_producers`.
    """

    def __init__(self, *, trainer: ActorGroup[Any], dock: Dock,
                 reference: ActorGroup[ReferenceActor] | None,
                 micro_batch_tokens: int | None = None) -> None:
        self._trainer, self._dock, self._reference = trainer, dock, reference
        self._rollout: ActorGroup[RolloutActor] | None = None
        self._producers: ActorGroup[ProducerActor] | None = None
        self._micro_batch_tokens = micro_batch_tokens

    @property
    def trainer(self) -> ActorGroup[Any]:
        return self._trainer

    @property
    def dock(self) -> Dock:
        return self._dock

    @property
    def reference(self) -> ActorGroup[ReferenceActor] | None:
        return self._reference

    @property
    def rollout(self) -> ActorGroup[RolloutActor]:
        if self._rollout is None:
            raise RuntimeError("the rollout replicas are not spawned yet (Actors.use_rollout)")
        return self._rollout

    @property
    def producers(self) -> ActorGroup[ProducerActor]:
        if self._producers is None:
            raise RuntimeError("the producers are not spawned yet (Actors.use_producers)")
        return self._producers

    @property
    def micro_batch_tokens(self) -> int | None:
        return self._micro_batch_tokens

    async def use_rollout(self, group: ActorGroup[RolloutActor], version: int | None = None
                          ) -> None:
        """`group` serves generations from now on; with `version`, the producers switch to it
        and expect weights of at least that version."""
        self._rollout = group
        if version is not None and self._producers is not None:
            await self._producers.use_rollout.call(group.name, version)

    def use_reference(self, group: ActorGroup[ReferenceActor]) -> None:
        """A re-created reference group (new devices) scores the dock from now on."""
        self._reference = group

    async def reference_replaced(self, old: ActorGroup[ReferenceActor],
                                 stopping: Callable[[], bool]) -> None:
        """Return once the reference is no longer `old` (a move re-created it), or
        `stopping()` is true."""
        while self._reference is old and not stopping():
            await asyncio.sleep(0.05)

    def use_producers(self, group: ActorGroup[ProducerActor]) -> None:
        self._producers = group

    def use_trainer(self, group: ActorGroup[Any], micro_batch_tokens: int | None) -> None:
        """A re-created trainer group (new layout or slots) and its micro-batch budget."""
        self._trainer, self._micro_batch_tokens = group, micro_batch_tokens

    def set_micro_batch_tokens(self, tokens: int) -> None:
        """The trainer's next steps are planned with this budget (no restart)."""
        self._micro_batch_tokens = tokens
