"""The parallelism selector: cost model, profiles and policy.

Before each Rollout and Experience Preparation step a `Policy` reads the live context lengths,
the dock's queue depths and the slots' memory, and returns a `Decision` whose `Plan` gives each
actor its layout (TP/PP/DP, recompute), micro-batch token budget and slots, with the reason:

    from earl.runtime.selector import ContextTracker, CostModel, ModelShape, RunProfile
    from earl.runtime.selector import PolicyConfig, SearchPolicy

    cost = CostModel(ModelShape.from_hf_config(cfg, params))
    profile = RunProfile(cost)  # fed with each step's measured tokens/s and peak memory
    policy = SearchPolicy(cost, PolicyConfig(), measured=profile)
    tracker = ContextTracker()
    d = policy.decide(step=s, when="prep", contexts=tracker.observe(lengths),
                      slots=pool.budgets(), queue_depths={"train": 12})
    if d.changed: ...apply d.plan...;  metrics.log(d.record())

Modules: `cost` (bytes and roofline tokens/s per stage), `profile` (measured tokens/s and peak
memory: a profiler of real steps, and the run's live profile), `plan` (typed inputs, plans,
decisions, records, the `Policy` protocol), `policy` (`SearchPolicy`: the decision, with
hysteresis). Applying a plan (re-creating actors, resharding) is not here, nor is the
cluster-scale simulator of the same policy (`bench/selector_simulate.py`, a script).
"""

from earl.runtime.selector.cost import CostConfig as CostConfig
from earl.runtime.selector.cost import CostModel as CostModel
from earl.runtime.selector.cost import ModelShape as ModelShape
from earl.runtime.selector.cost import Parallel as Parallel
from earl.runtime.selector.plan import ActorPlan as ActorPlan
from earl.runtime.selector.plan import ContextStats as ContextStats
from earl.runtime.selector.plan import ContextTracker as ContextTracker
from earl.runtime.selector.plan import Decision as Decision
from earl.runtime.selector.plan import Plan as Plan
from earl.runtime.selector.plan import Policy as Policy
from earl.runtime.selector.plan import SelectorStatistics as SelectorStatistics
from earl.runtime.selector.plan import Shortfall as Shortfall
from earl.runtime.selector.policy import PolicyConfig as PolicyConfig
from earl.runtime.selector.policy import SearchPolicy as SearchPolicy
from earl.runtime.selector.profile import Profiler as Profiler
from earl.runtime.selector.profile import ProfileTable as ProfileTable
from earl.runtime.selector.profile import RunProfile as RunProfile

__all__ = [
    "ActorPlan", "ContextStats", "ContextTracker", "CostConfig", "CostModel", "Decision",
    "ModelShape", "Parallel", "Plan", "Policy", "PolicyConfig", "ProfileTable", "Profiler",
    "RunProfile", "SearchPolicy",
    "SelectorStatistics", "Shortfall",
]
