"""A scripted selector policy for the live re-layout test (`selector.policy_factory`).

It plugs in through the `earl.runtime.selector.Policy` protocol like any user policy: the
built-in `SearchPolicy` decides the context, window and budgets, and from step `AT` on this
policy moves one device from the rollout to the trainer: 2 rollout replicas on devices 0-1 and
one trainer rank on device 2 become one replica on device 0 and a trainer of 2 data-parallel
ranks on devices 1-2. Deterministic, so a test can assert what a move does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from earl.runtime.selector import (
    ContextStats,
    CostModel,
    Decision,
    Parallel,
    PolicyConfig,
    RunProfile,
    SearchPolicy,
    SelectorStatistics,
)

AT = 2  # the first step planned with the moved device


class Relayout:
    def __init__(self, cost: CostModel, config: PolicyConfig, measured: RunProfile) -> None:
        self.inner = SearchPolicy(cost, config, measured=measured)
        self.moved = False  # decisions of batches in flight interleave: once moved, stay

    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        d = self.inner.decide(step=step, when=when, contexts=contexts, slots=slots,
                              queue_depths=queue_depths)
        self.moved = moved = self.moved or step >= AT
        rollout = replace(d.plan.actor("rollout"), parallel=Parallel(dp=1 if moved else 2),
                          slots=("device0",) if moved else ("device0", "device1"))
        trainer = replace(d.plan.actor("trainer"),
                          parallel=Parallel(dp=2 if moved else 1, recompute=moved),
                          slots=("device1", "device2") if moved else ("device2",))
        plan = replace(d.plan, actors=(rollout, trainer), feasible=True)
        return replace(d, plan=plan, reason=f"scripted: {'moved' if moved else 'start'}")

    def statistics(self) -> SelectorStatistics:
        return self.inner.statistics()


def factory(cost: CostModel, config: PolicyConfig, measured: RunProfile) -> Relayout:
    return Relayout(cost, config, measured)


class ReferenceMove:
    """From step `AT` on, a device moves from the rollout to the reference: 2 replicas on
    devices 0-1, the trainer on device 2 and the reference on device 3 become one replica on
    device 0 and a reference of 2 data-parallel ranks on devices 1 and 3."""

    def __init__(self, cost: CostModel, config: PolicyConfig, measured: RunProfile) -> None:
        self.inner = SearchPolicy(cost, config, measured=measured)
        self.moved = False

    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        d = self.inner.decide(step=step, when=when, contexts=contexts, slots=slots,
                              queue_depths=queue_depths)
        self.moved = moved = self.moved or step >= AT
        rollout = replace(d.plan.actor("rollout"), parallel=Parallel(dp=1 if moved else 2),
                          slots=("device0",) if moved else ("device0", "device1"))
        trainer = replace(d.plan.actor("trainer"), parallel=Parallel(), slots=("device2",))
        reference = replace(d.plan.actor("reference"), parallel=Parallel(dp=2 if moved else 1),
                            slots=("device1", "device3") if moved else ("device3",))
        plan = replace(d.plan, actors=(rollout, trainer, reference), feasible=True)
        return replace(d, plan=plan, reason=f"scripted: {'moved' if moved else 'start'}")

    def statistics(self) -> SelectorStatistics:
        return self.inner.statistics()


def reference_factory(cost: CostModel, config: PolicyConfig,
                      measured: RunProfile) -> ReferenceMove:
    return ReferenceMove(cost, config, measured)
