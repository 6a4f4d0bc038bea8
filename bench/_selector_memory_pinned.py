"""The `pinned` arm of `bench/selector.py --memory-bound`: the selector held to its first plan.

A `selector.policy_factory` (``bench/_selector_memory_pinned.py:pinned``): the run's own
`SearchPolicy` decides once, and every later decision returns that plan unchanged. Everything
else of the selector runs as with `--selector on` (its decisions before each rollout and step,
the profile it measures, the records it writes), so the arm's time over a static run of the
same layout is the selector's overhead when it has nothing to do.
"""

from __future__ import annotations

from collections.abc import Mapping

from earl.runtime.selector import ContextStats, CostModel, Decision, PolicyConfig, SearchPolicy


class PinnedPolicy:
    """`SearchPolicy`'s first decision, then that plan for ever (`changed` False)."""

    def __init__(self, inner: SearchPolicy) -> None:
        self.inner = inner
        self.first: Decision | None = None

    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        if self.first is None:
            self.first = self.inner.decide(step=step, when=when, contexts=contexts, slots=slots,
                                           queue_depths=queue_depths)
            return self.first
        return Decision(step=step, when=when, plan=self.first.plan, changed=False,
                        reason="pinned to the first plan", context=contexts)

    def __getattr__(self, name: str) -> object:  # statistics() and the like: the inner's
        return getattr(self.inner, name)


def pinned(cost: CostModel, config: PolicyConfig, measured: object) -> PinnedPolicy:
    """The factory `earl train --selector.policy_factory=...:pinned` calls."""
    return PinnedPolicy(SearchPolicy(cost, config, measured=measured))  # type: ignore[arg-type]
