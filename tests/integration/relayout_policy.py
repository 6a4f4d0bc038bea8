"""Scripted selector policies for the live re-layout tests (`selector.policy_factory`).

They plug in through the `earl.runtime.selector.Policy` protocol like any user policy: the
built-in `SearchPolicy` decides the context, window and budgets, and from step `AT` on each
moves one device from the rollout to another stage (`factory`: to the trainer;
`reference_factory`: to the reference). Deterministic, so a test can assert what a move does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from earl.runtime.selector import (
    ActorPlan,
    ContextStats,
    CostModel,
    Decision,
    Parallel,
    Plan,
    PolicyConfig,
    RunProfile,
    SearchPolicy,
    SelectorStatistics,
)

AT = 2  # the first step planned with the moved device


class _Scripted:
    """`SearchPolicy`'s decision with the layouts of `actors(plan, moved)`."""

    def __init__(self, cost: CostModel, config: PolicyConfig, measured: RunProfile) -> None:
        self.inner = SearchPolicy(cost, config, measured=measured)
        self.moved = False  # decisions of batches in flight interleave: once moved, stay

    def actors(self, plan: Plan, moved: bool) -> tuple[ActorPlan, ...]:
        raise NotImplementedError

    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        d = self.inner.decide(step=step, when=when, contexts=contexts, slots=slots,
                              queue_depths=queue_depths)
        self.moved = moved = self.moved or step >= AT
        plan = replace(d.plan, actors=self.actors(d.plan, moved), feasible=True)
        return replace(d, plan=plan, reason=f"scripted: {'moved' if moved else 'start'}")

    def statistics(self) -> SelectorStatistics:
        return self.inner.statistics()


class Relayout(_Scripted):
    """2 rollout replicas on devices 0-1 and one trainer rank on device 2 become one replica on
    device 0 and a trainer of 2 data-parallel ranks on devices 1-2 (recomputing)."""

    def actors(self, plan: Plan, moved: bool) -> tuple[ActorPlan, ...]:
        rollout = replace(plan.actor("rollout"), parallel=Parallel(dp=1 if moved else 2),
                          slots=("device0",) if moved else ("device0", "device1"))
        trainer = replace(plan.actor("trainer"),
                          parallel=Parallel(dp=2 if moved else 1, recompute=moved),
                          slots=("device1", "device2") if moved else ("device2",))
        return rollout, trainer


class ReferenceMove(_Scripted):
    """2 replicas on devices 0-1, the trainer on device 2 and the reference on device 3
    become one replica on device 0 and a reference of 2 data-parallel ranks on devices 1, 3."""

    def actors(self, plan: Plan, moved: bool) -> tuple[ActorPlan, ...]:
        rollout = replace(plan.actor("rollout"), parallel=Parallel(dp=1 if moved else 2),
                          slots=("device0",) if moved else ("device0", "device1"))
        trainer = replace(plan.actor("trainer"), parallel=Parallel(), slots=("device2",))
        reference = replace(plan.actor("reference"), parallel=Parallel(dp=2 if moved else 1),
                            slots=("device1", "device3") if moved else ("device3",))
        return rollout, trainer, reference


def factory(cost: CostModel, config: PolicyConfig, measured: RunProfile) -> Relayout:
    return Relayout(cost, config, measured)


def reference_factory(cost: CostModel, config: PolicyConfig,
                      measured: RunProfile) -> ReferenceMove:
    return ReferenceMove(cost, config, measured)
