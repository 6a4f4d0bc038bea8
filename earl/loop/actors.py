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

    Each group joins as its stage spawns it (`earl.loop.stages`): `use_trainer`, `use_dock`,
    `use_reference` (none without a KL term), `use_rollout`, `use_producers`.
    """

    def __init__(self) -> None:
        self._trainer: ActorGroup[Any] | None = None
        self._dock: Dock | None = None
        self._reference: ActorGroup[ReferenceActor] | None = None
        self._rollout: ActorGroup[RolloutActor] | None = None
        self._producers: ActorGroup[ProducerActor] | None = None
        self._micro_batch_tokens: int | None = None

    @property
    def trainer(self) -> ActorGroup[Any]:
        if self._trainer is None:
            raise RuntimeError("the trainer is not spawned yet (Actors.use_trainer)")
        return self._trainer

    @property
    def dock(self) -> Dock:
        if self._dock is None:
            raise RuntimeError("the dock is not spawned yet (Actors.use_dock)")
        return self._dock

    def use_dock(self, dock: Dock) -> None:
        self._dock = dock

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
        """The reference group (spawned, or re-created on new devices) scores the dock from
        now on."""
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
        """The trainer group (spawned, or re-created with a new layout or slots) and its
        micro-batch budget (None: its own setting)."""
        self._trainer, self._micro_batch_tokens = group, micro_batch_tokens

    def set_micro_batch_tokens(self, tokens: int) -> None:
        """The trainer's next steps are planned with this budget (no restart)."""
        self._micro_batch_tokens = tokens
