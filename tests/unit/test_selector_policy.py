"""The selector policy on synthetic context traces (runtime/selector/policy.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from earl.runtime.selector.cost import CostConfig, CostModel, ModelShape, Parallel
from earl.runtime.selector.plan import ContextStats, ContextTracker, Decision, Plan
from earl.runtime.selector.policy import PolicyConfig, SearchPolicy

GB = 1e9
MODEL = CostModel(ModelShape.llama31_8b(), CostConfig(attention="flash"))
SMALL = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                             vocab=512, params=120_000))


def slots(n: int = 16, cap: float = 80 * GB) -> dict[str, float]:
    return {f"s{i:02d}": cap for i in range(n)}


def replay(policy: SearchPolicy, maxima: list[int], pool: dict[str, float]) -> list[Decision]:
    """Decide before Experience Preparation of each step (its lengths are known then)."""
    tracker, out = ContextTracker(), []
    for step, top in enumerate(maxima):
        stats = tracker.observe([top // 2, top * 4 // 5, top])
        out.append(policy.decide(step=step, when="prep", contexts=stats, slots=pool))
    return out


def assert_holds(policy: SearchPolicy, decisions: list[Decision], maxima: list[int],
                 pool: dict[str, float]) -> None:
    """No OOM: every actor's layout holds that step's longest context on its slots."""
    for d, top in zip(decisions, maxima, strict=True):
        assert d.plan.feasible, d.reason
        assert d.plan.context_bucket >= top
        for a in d.plan.actors:
            assert policy.evaluate(a.actor, a.parallel, a.slots, top, pool[a.slots[0]]), \
                (d.step, a.describe())
        used = [s for a in d.plan.actors for s in a.slots]
        if not policy.config.colocated:
            assert len(used) == len(set(used)) <= len(pool)  # split: no slot given twice


def test_steady_growth_adapts_without_oom() -> None:
    maxima = [int(2048 * 32 ** (i / 29)) for i in range(30)]  # 2K -> 64K
    policy, pool = SearchPolicy(MODEL), slots()
    ds = replay(policy, maxima, pool)
    assert_holds(policy, ds, maxima, pool)
    st = policy.statistics()
    assert st.switches >= 3  # the layout really changes as contexts grow
    assert st.switches <= len({d.plan.context_bucket for d in ds})  # at most once per bucket
    trainer = [d.plan.actor("trainer") for d in ds]
    assert trainer[-1].parallel.recompute or trainer[-1].parallel.tp > trainer[0].parallel.tp
    assert all("cannot hold" in d.reason or "faster" in d.reason or d.step == 0
               for d in ds if d.changed)


def test_spike_raises_the_bucket_at_once_and_lowers_it_only_after_patience() -> None:
    maxima = [4000] * 6 + [20000] + [4000] * 10
    cfg = PolicyConfig(patience=3)
    policy, pool = SearchPolicy(MODEL, cfg), slots()
    ds = replay(policy, maxima, pool)
    assert_holds(policy, ds, maxima, pool)
    buckets = [d.plan.context_bucket for d in ds]
    assert buckets[6] >= 20000
    assert buckets[7] == buckets[6]  # the next step does not drop straight back
    assert buckets[-1] < 20000  # ...but the spike does not stay planned for ever
    assert policy.statistics().switches <= 4


def test_shrinking_contexts_return_to_a_faster_plan() -> None:
    maxima = [int(65536 / 32 ** (i / 24)) for i in range(25)]  # 64K -> 2K
    policy, pool = SearchPolicy(MODEL), slots()
    ds = replay(policy, maxima, pool)
    assert_holds(policy, ds, maxima, pool)
    buckets = [d.plan.context_bucket for d in ds]
    assert buckets == sorted(buckets, reverse=True)  # never back up
    assert ds[-1].plan.tokens_per_s > 2 * ds[0].plan.tokens_per_s
    assert policy.statistics().switches >= 2


@pytest.mark.parametrize("colocated", [False, True])
def test_oscillation_around_a_bucket_boundary_does_not_thrash(colocated: bool) -> None:
    maxima = [4000, 4200] * 20  # around the 4096 bucket edge
    policy, pool = SearchPolicy(MODEL, PolicyConfig(colocated=colocated)), slots()
    ds = replay(policy, maxima, pool)
    assert_holds(policy, ds, maxima, pool)
    assert policy.statistics().switches <= 2
    assert len({d.plan.context_bucket for d in ds[2:]}) == 1


def test_noisy_gain_near_the_switch_threshold_needs_patience() -> None:
    policy = SearchPolicy(MODEL, PolicyConfig(patience=3, cooldown_steps=0))
    tracker, pool = ContextTracker(), slots()
    # contexts alternating between two buckets whose best plans differ: the bucket stays up
    ds = [policy.decide(step=i, when="rollout", contexts=tracker.observe([8000 if i % 2 else 3000]),
                        slots=pool) for i in range(20)]
    assert sum(d.changed for d in ds) <= 2


def test_infeasible_context_is_reported_before_it_is_needed() -> None:
    maxima = [int(4096 * 1.25 ** i) for i in range(25)]  # grows past what 4 slots hold
    pool = slots(8)
    policy = SearchPolicy(MODEL, PolicyConfig(warn_steps=6))
    ds = replay(policy, maxima, pool)
    first_short = next(d for d in ds if d.shortfall is not None)
    first_bad = next(d for d in ds if not d.plan.feasible)
    assert first_short.plan.feasible and first_short.step < first_bad.step
    sf = first_short.shortfall
    assert sf is not None and sf.at_step > first_short.step
    assert sf.min_device_bytes > 80 * GB or sf.min_devices > 8
    assert "cannot fit" in sf.message() and str(sf.context) in sf.message()
    assert "no configuration fits" in first_bad.reason
    assert policy.statistics().infeasible >= 1


def test_a_deep_training_queue_moves_slots_to_the_trainer() -> None:
    tracker = ContextTracker()
    stats = tracker.observe([4096, 3000, 2000])
    cfg = {"queue_target": 8}
    calm = SearchPolicy(MODEL, PolicyConfig(**cfg)).decide(
        step=0, when="prep", contexts=stats, slots=slots(), queue_depths={"train": 0})
    busy = SearchPolicy(MODEL, PolicyConfig(**cfg)).decide(
        step=0, when="prep", contexts=stats, slots=slots(), queue_depths={"train": 64})
    assert len(busy.plan.actor("trainer").slots) > len(calm.plan.actor("trainer").slots)


def test_decision_records_for_metrics_and_trace() -> None:
    d = replay(SearchPolicy(MODEL), [4096, 5000], slots())[-1]
    rec = d.record()
    assert rec["selector/trainer/tp"] == d.plan.actor("trainer").parallel.tp
    assert rec["selector/reason"] == d.reason
    assert all(isinstance(v, (int, float, str)) for v in rec.values())
    ev = d.trace_event(1234.0)
    assert ev["ph"] == "i" and ev["ts"] == 1234.0
    json.dumps(ev)


def test_context_tracker_statistics_and_trend() -> None:
    tr = ContextTracker(window=4)
    for top in (1000, 1100, 1200, 1300):
        st = tr.observe(list(range(1, top + 1)))
    assert st.max == 1300 and 640 <= st.p50 <= 660 and st.p95 >= 1230
    assert st.trend == pytest.approx(100, rel=0.01)
    assert st.projected(3) == 1600


def test_bad_config_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"actors\.x"):
        PolicyConfig(actors={"x": "generate"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="headroom"):
        PolicyConfig(headroom=1.5)
    with pytest.raises(ValueError, match="at least one"):
        ContextTracker().observe([])


def test_a_dp_only_stage_is_planned_one_rank_per_device() -> None:
    both = PolicyConfig(tp_max=4, pp_max=4)
    only = PolicyConfig(tp_max=4, pp_max=4, dp_only=("reference",))
    assert {(p.tp, p.pp) for p in SearchPolicy(MODEL, both).layouts("reference", 4)} > {(1, 1)}
    assert [(p.tp, p.pp, p.dp) for p in SearchPolicy(MODEL, only).layouts("reference", 4)] == \
        [(1, 1, 4)]
    assert len(SearchPolicy(MODEL, only).layouts("train", 4)) > 2  # other stages as before
    with pytest.raises(ValueError, match="dp_only"):
        PolicyConfig(dp_only=("ref",))  # type: ignore[arg-type]


def test_a_lasting_backlog_moves_slots_live_after_patience_and_a_lost_slot_replans() -> None:
    policy = SearchPolicy(MODEL, PolicyConfig(queue_target=8, patience=2, cooldown_steps=0))
    tracker, pool = ContextTracker(), slots()
    stats = tracker.observe([4096, 3000])
    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    before = len(first.plan.actor("trainer").slots)
    ds = [policy.decide(step=i, when="prep", contexts=stats, slots=pool,
                        queue_depths={"train": 64}) for i in range(1, 4)]
    assert not ds[0].changed  # one deep queue is not enough
    moved = next(d for d in ds if d.changed)
    assert len(moved.plan.actor("trainer").slots) > before
    smaller = dict(list(pool.items())[:-2])  # two slots gone (e.g. a host lost)
    d = policy.decide(step=5, when="prep", contexts=stats, slots=smaller)
    assert d.changed and "slots changed" in d.reason
    assert all(n in smaller for a in d.plan.actors for n in a.slots)


def test_a_starved_trainer_moves_slots_to_the_rollout() -> None:
    """Queue depths weigh both ways: fewer samples waiting than `queue_target` mean the trainer
    waits for experience (rollout-bound), so the rollout gets more slots than when balanced."""
    stats = ContextTracker().observe([4096, 3000, 2000])
    cfg = PolicyConfig(queue_target=32)

    def rollout_slots(backlog: int) -> int:
        d = SearchPolicy(MODEL, cfg).decide(step=0, when="rollout", contexts=stats,
                                            slots=slots(), queue_depths={"train": backlog})
        return len(d.plan.actor("rollout").slots)

    assert rollout_slots(0) > rollout_slots(32) >= rollout_slots(320)
    assert SearchPolicy(MODEL, cfg)._demand({"train": 0})["rollout"] == 2.0
    assert SearchPolicy(MODEL, cfg)._demand({"train": 96})["trainer"] == 3.0
    assert SearchPolicy(MODEL, cfg)._demand(None) == {"rollout": 1.0, "reference": 1.0,
                                                      "trainer": 1.0}


class _Steps:
    """A measured profile: a step's tokens, what a switch costs, and one layout measured slow."""

    def __init__(self, tokens: float, switch_s: float) -> None:
        self.tokens, self.switch_s = tokens, switch_s
        self.slow: tuple[str, object] | None = None

    def tokens_per_s(self, stage: str, par: object, context: int) -> float | None:
        return 1e3 if (stage, par) == self.slow else None

    def memory_scale(self, stage: object) -> float:
        return 1.0

    def memory_slack(self, stage: object) -> float:
        return 0.0

    def efficiency(self, stage: object, par: object = None, context: object = None) -> float:
        return 1.0

    def step_tokens(self) -> float:
        return self.tokens

    def switch_seconds(self) -> float:
        return self.switch_s


@pytest.mark.parametrize(("tokens", "moves"), [(1e6, True), (10.0, False)])
def test_a_switch_must_pay_for_itself_over_the_horizon(tokens: float, moves: bool) -> None:
    """The trainer's layout turns out slow when measured: the policy leaves it when a step's
    tokens make the faster plan save more than a switch costs over `horizon_steps`, and keeps
    it when the steps are so small that the switch would not pay."""
    measured = _Steps(tokens, switch_s=30.0)
    policy = SearchPolicy(MODEL, PolicyConfig(patience=1, cooldown_steps=0, horizon_steps=20),
                          measured=measured)
    stats = ContextTracker().observe([4096, 3000])
    first = policy.decide(step=0, when="prep", contexts=stats, slots=slots())
    measured.slow = ("train", first.plan.actor("trainer").parallel)
    d = policy.decide(step=1, when="prep", contexts=stats, slots=slots())
    assert d.changed is moves
    if not moves:
        assert "a switch costs 30.0 s" in d.reason and "over 20 steps" in d.reason


def test_queue_depths_weigh_nothing_once_the_run_measures_its_steps() -> None:
    """Measured rates say which stage holds the pipeline back; weighing the backlog as well
    swung near-balanced layouts back and forth."""
    cfg = PolicyConfig(queue_target=32)
    assert SearchPolicy(MODEL, cfg)._demand({"train": 0})["rollout"] == 2.0
    measured = SearchPolicy(MODEL, cfg, measured=_Steps(1e4, 5.0))
    assert set(measured._demand({"train": 0}).values()) == {1.0}
    assert set(measured._demand({"train": 96}).values()) == {1.0}


def test_tp_overhead_prices_tensor_parallelism_per_doubling() -> None:
    """Each TP doubling loses `tp_overhead`: with none, a TP-2 replica beats two TP-1
    replicas on the same devices (decode reads half the weights per device); at CPU slots'
    0.25 it no longer does."""
    from earl.runtime.selector.cost import Parallel

    def rates(overhead: float) -> tuple[float, float]:
        cost = CostModel(ModelShape.llama31_8b(), CostConfig(tp_overhead=overhead))
        p = SearchPolicy(cost, PolicyConfig(rollout_seqs=64))
        two = ("s00", "s01")
        tp2 = p.evaluate("rollout", Parallel(tp=2), two, 4096, 80 * GB)
        dp2 = p.evaluate("rollout", Parallel(dp=2), two, 4096, 80 * GB)
        assert tp2 is not None and dp2 is not None
        return tp2.tokens_per_s, dp2.tokens_per_s

    (cpu_tp2, cpu_dp2), (tp2, dp2) = rates(0.25), rates(0.0)
    assert cpu_tp2 == pytest.approx(0.75 * tp2) and cpu_dp2 == pytest.approx(dp2)
    assert tp2 > dp2 and cpu_tp2 < cpu_dp2
    with pytest.raises(ValueError, match="tp_overhead"):
        CostConfig(tp_overhead=1.0)


def test_rollout_seqs_caps_the_decode_batch_the_roofline_credits() -> None:
    """A replica decodes its share of the run's sequences: KV budget beyond that share is not
    credited with throughput (with `rollout_seqs` 0 it is)."""
    from earl.runtime.selector.cost import Parallel

    def rate(seqs: int) -> float:
        p = SearchPolicy(MODEL, PolicyConfig(rollout_seqs=seqs))
        plan = p.evaluate("rollout", Parallel(dp=2), ("s00", "s01"), 4096, 80 * GB)
        assert plan is not None
        return plan.tokens_per_s

    assert rate(8) < rate(64) <= rate(0)
    with pytest.raises(ValueError, match="rollout_seqs"):
        PolicyConfig(rollout_seqs=-1)


def test_the_projected_context_stops_at_max_context() -> None:
    """A steep trend near the window does not plan for contexts no trajectory can reach (the
    gauntlet's full run planned for 6,144 tokens with 4,096 positions and went to TP 2 with
    recomputation for it)."""
    stats = ContextTracker().observe([3000, 3500, 3729])
    stats = type(stats)(p50=stats.p50, p95=stats.p95, max=3729, trend=565.0)

    def bucket(cap: int) -> int:
        d = SearchPolicy(MODEL, PolicyConfig(max_context=cap)).decide(
            step=0, when="prep", contexts=stats, slots=slots())
        return d.plan.context_bucket

    assert bucket(0) == 6144 and bucket(4096) == 4096
    with pytest.raises(ValueError, match="max_context"):
        PolicyConfig(max_context=-1)


def test_the_plan_holds_the_longest_context_of_the_recent_steps() -> None:
    # a step's longest trajectory swings 2x from step to step: the bucket follows the recent
    # maximum, so one short step does not switch the layout back
    policy = SearchPolicy(MODEL, PolicyConfig(actors={"trainer": "train"}, lookahead_steps=0))
    tr = ContextTracker(window=4)
    buckets = []
    for top in (3000, 1400, 1500, 1300, 1400, 1500, 1350):
        d = policy.decide(step=len(buckets), when="prep", contexts=tr.observe([top]),
                          slots=slots(1))
        buckets.append(d.plan.context_bucket)
    assert buckets[:4] == [3072] * 4  # the 3,000 stays in the window for 4 steps
    assert buckets[-1] == 1536  # then the bucket shrinks to what the recent steps needed


def test_the_rollout_and_prep_decisions_of_a_step_count_its_contexts_once() -> None:
    """Both decisions of a step see the same observation: a bucket shrinks after `patience`
    observations well below it, not after one step seen twice."""
    policy = SearchPolicy(MODEL, PolicyConfig(actors={"trainer": "train"}, lookahead_steps=0,
                                              patience=2))
    tr = ContextTracker(window=2)
    big = tr.observe([3000])
    policy.decide(step=0, when="prep", contexts=big, slots=slots(1))
    tr.observe([1000])
    low = tr.observe([1000])  # the 3,000 has left the window
    for when in ("prep", "rollout"):
        d = policy.decide(step=2, when=when, contexts=low, slots=slots(1))
        assert d.plan.context_bucket == 3072
    d = policy.decide(step=3, when="prep", contexts=tr.observe([1000]), slots=slots(1))
    assert d.plan.context_bucket == 1024


def test_the_rollout_kv_budget_at_its_cap_does_not_depend_on_the_context_bucket() -> None:
    """A KV budget is a pool of blocks, not whole sequences: at `max_kv_tokens` it is the same
    at every bucket, so a bucket change alone never rebuilds the engines for a budget a
    fraction of a percent smaller (131,072 tokens at 1,024, 130,560 at 1,536 before)."""
    policy = SearchPolicy(MODEL, PolicyConfig(max_kv_tokens=1 << 17))
    budgets = {ctx: policy.evaluate("rollout", Parallel(), ("s00",), ctx, 80 * GB)
               for ctx in (1024, 1536, 3072)}
    assert all(p is not None and p.micro_batch_tokens == 1 << 17 for p in budgets.values())
    train = policy.evaluate("trainer", Parallel(), ("s00",), 1536, 400 * GB)
    assert train is not None and train.micro_batch_tokens % 1536 == 0  # whole sequences


def test_a_rollout_tp_change_is_priced_as_new_engine_processes() -> None:
    """Device moves measured ~1 s (warm hosts); a rollout TP change starts new engine
    processes (17.9 s): it must pay off against `respawn_cost_s`, not the median of moves."""
    from earl.runtime.selector.plan import Plan

    policy = SearchPolicy(SMALL, PolicyConfig(respawn_cost_s=15.0),
                          measured=_Steps(1e4, switch_s=1.0))
    two, other = ("s00", "s01"), ("s02", "s03")

    def plan(rollout: Parallel, trainer: Parallel) -> Plan:
        r = policy.evaluate("rollout", rollout, two, 1024, 80 * GB)
        t = policy.evaluate("trainer", trainer, other, 1024, 80 * GB)
        assert r is not None and t is not None
        return Plan(actors=(r, t), context_bucket=1024)

    cur = plan(Parallel(dp=2), Parallel(dp=2))
    _, ledger = policy.switching.pays_off(plan(Parallel(tp=2), Parallel(dp=2)), cur, None)
    assert "a switch costs 15.0 s" in ledger
    _, ledger = policy.switching.pays_off(plan(Parallel(dp=2), Parallel(tp=2)), cur, None)
    assert "a switch costs 1.0 s" in ledger
    with pytest.raises(ValueError, match="respawn_cost_s"):
        PolicyConfig(respawn_cost_s=-1)


def _probe_policy(**knobs: float) -> tuple[SearchPolicy, dict[str, float]]:
    cfg = PolicyConfig(actors={"rollout": "rollout", "trainer": "train"}, probe_every=5,
                       probe_steps=2, probe_margin=0.99, **knobs)  # type: ignore[arg-type]
    return SearchPolicy(SMALL, cfg), slots(4)


def _shape(d: Decision) -> tuple[tuple[str, Parallel], ...]:
    return tuple((a.actor, a.parallel) for a in d.plan.actors)


def _switching(measured: _Steps, probe_steps: int) -> SearchPolicy:
    """A rollout and a trainer on `SMALL`, switching at once on prices, no probes."""
    return SearchPolicy(SMALL, PolicyConfig(
        actors={"rollout": "rollout", "trainer": "train"}, patience=1, cooldown_steps=0,
        probe_every=0, probe_steps=probe_steps), measured=measured)


@pytest.mark.parametrize("probe_faster", [False, True])
def test_a_probe_runs_the_other_plan_and_the_faster_end_to_end_stays(probe_faster: bool) -> None:
    """Stage rates from a few batches can price the faster layout lower (a gauntlet run left it
    at step 17 and never measured it again): every `probe_every` steps the best other plan
    (same rollout TP) runs `probe_steps` steps measured end to end, and the faster stays; the
    policy does not switch back on prices until the next probe, and a lost probe doubles the
    wait for the next."""
    policy, pool = _probe_policy()
    stats = ContextTracker().observe([1024, 800])

    def step(n: int, seconds: float = 1.0) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    assert not any(step(n).changed for n in range(1, 5))  # no probe before `probe_every`
    probe = step(5)
    assert probe.changed and probe.reason.startswith("probe for 2 steps")
    assert _shape(probe) != _shape(first)
    assert probe.plan.actor("rollout").parallel.tp == first.plan.actor("rollout").parallel.tp
    held = step(6, 0.5 if probe_faster else 2.0)
    assert not held.changed and held.reason.startswith("on trial: 1/2")
    end = step(7, 0.5 if probe_faster else 2.0)
    if probe_faster:  # 2,000 tok/s against 1,000: kept, and not left on prices
        assert not end.changed and end.reason.startswith("trial kept")
        later = [step(n, 0.5) for n in range(8, 12)]
        assert all(_shape(d) == _shape(probe) and not d.changed for d in later)
        assert any(d.reason.startswith("kept: a plan priced") and "end to end" in d.reason
                   for d in later)
    else:  # 500 tok/s: back to the first plan; the next probe waits 2 x probe_every
        assert end.changed and end.reason.startswith("trial lost")
        assert _shape(end) == _shape(first)
        waited = [step(n) for n in range(8, 17)]
        assert not any(d.changed for d in waited)
        assert step(17).reason.startswith("probe for")


def test_no_probe_without_steps_measured_end_to_end() -> None:
    """A policy the loop does not feed (`observe_step`; the cluster simulator) never probes."""
    policy, pool = _probe_policy()
    stats = ContextTracker().observe([1024, 800])
    ds = [policy.decide(step=n, when="prep", contexts=stats, slots=pool) for n in range(30)]
    assert sum(d.changed for d in ds) == 1  # the first plan only
    with pytest.raises(ValueError, match="probe_margin"):
        PolicyConfig(probe_margin=1.0)


@pytest.mark.parametrize("slower", [2.0, 1.05])
def test_a_plan_priced_faster_but_measured_slower_end_to_end_is_left_and_not_taken_again(
        slower: float) -> None:
    """Prices propose, steps measured end to end decide: a switch the prices called for is a
    trial, undone once the new plan runs slower end to end than the old one did at the same
    bucket, by any margin (runs R, T and U held a plan priced faster and measured 15-35%
    slower for 50-200 steps), and the prices do not take it again there."""
    measured = _Steps(1e6, switch_s=1.0)
    policy = _switching(measured, probe_steps=2)
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)

    def step(n: int, seconds: float) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    assert not step(1, 1.0).changed and not step(2, 1.0).changed  # 1,000 tok/s end to end
    measured.slow = ("train", first.plan.actor("trainer").parallel)  # priced slow from now
    priced = step(3, 1.0)
    assert priced.changed and "faster (tokens/s) at context 1024, on trial" in priced.reason
    assert not step(4, slower).changed  # one step of the new plan: not measured yet
    back = step(5, slower)
    assert back.changed and back.reason.startswith("trial lost")
    assert f"{1000 / slower:,.0f} tok/s end to end against 1,000 tok/s" in back.reason
    assert _shape(back) == _shape(first)
    kept = [step(n, 1.0) for n in range(6, 10)]
    assert not any(d.changed for d in kept)
    assert all(d.reason.startswith("kept: a plan priced") and
               f"ran {1000 / slower:,.0f} tok/s" in d.reason for d in kept)


@pytest.mark.parametrize(("faster", "verdict", "at"), [
    (2.0, "trial kept", 8), (1.05, "trial tied", 12), (0.95, "trial tied", 12),
    (0.5, "trial lost", 8)])
def test_a_trial_within_the_noise_runs_on_and_one_beyond_it_is_decided_at_once(
        faster: float, verdict: str, at: int) -> None:
    """A rate over a few steps is noisy (over 6 steps ~10% on the gauntlet, as large as the
    gaps between its layouts): a trial whose rate is within `trial_sigmas` standard errors of
    the old plan's (from their steps' spread, in consecutive pairs) runs on to 3 x
    `probe_steps` measured steps and, still within the noise, goes back (the old plan wins a
    tie: run Z4 kept a tie and held a train-bound layout for 194 steps); one clearly faster
    or slower is decided at `probe_steps`."""
    measured = _Steps(1e6, switch_s=1.0)
    policy = _switching(measured, probe_steps=2)
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)
    noisy = [1.0, 1.0, 1.3, 1.3, 0.7, 0.7]  # 1,000 tok/s; in pairs 2.0, 2.6 and 1.4 s

    def step(n: int, seconds: float) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    assert not any(step(n, s).changed for n, s in enumerate(noisy[:-1], 1))
    measured.slow = ("train", first.plan.actor("trainer").parallel)  # priced slow from now
    assert step(6, noisy[-1]).changed  # on prices, on trial
    (old,) = [e for e in policy.switching.ends.values()]
    # pairs off 1,000 tok/s by 0, -600 and +600 tokens over 2.0 s on average
    assert old.rate == pytest.approx(1000) and old.se == pytest.approx((2 * 600**2 / 6) ** 0.5 / 2)
    decisions = {n: step(n, noisy[(n - 7) % 6] / faster) for n in range(7, 13)}
    end = next(n for n, d in decisions.items() if not d.reason.startswith("on trial"))
    assert end == at and decisions[at].reason.startswith(verdict), decisions[at].reason
    assert decisions[at].changed is (verdict != "trial kept")
    if at > 8:
        assert "within the noise (346 tok/s; 2/6)" in decisions[8].reason


@pytest.mark.parametrize("noisy", [True, False])
def test_a_plan_measured_faster_is_switched_back_to_only_beyond_the_noise(noisy: bool) -> None:
    """A plan measured `switch_gain` faster end to end at the bucket is switched back to only
    if the two rates also differ by more than `trial_sigmas` standard errors (run Z went back
    to three replicas on "+12%" at step 67, from rates over 6 and 18 steps)."""
    measured = _Steps(1e6, switch_s=1.0)
    policy = _switching(measured, probe_steps=2)
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)
    first_steps = [1.0, 1.0, 1.3, 1.3, 0.7, 0.7] if noisy else [1.0] * 6  # 1,000 tok/s

    def step(n: int, seconds: float) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    for n, s in enumerate(first_steps[:-1], 1):
        step(n, s)
    measured.slow = ("train", first.plan.actor("trainer").parallel)
    assert step(6, first_steps[-1]).changed  # on prices, on trial
    step(7, 0.5)
    assert step(8, 0.5).reason.startswith("trial kept")  # 2,000 tok/s
    later = [step(n, 1 / 0.85) for n in range(9, 15)]  # then 850 tok/s: the first 18% faster
    back = [d for d in later if d.changed]
    if noisy:  # +-17% (in pairs): 150 tok/s apart is within 2 standard errors
        assert not back
    else:
        assert len(back) == 1 and back[0].reason.startswith("measured +18% faster")
        assert _shape(back[0]) == _shape(first)


def test_a_trial_is_judged_at_one_bucket_or_goes_back_without_a_verdict() -> None:
    """A step's end-to-end efficiency rises with its context (~20% a half-octave on the
    gauntlet), so a plan's rate is taken at one bucket, and a trial is compared with the plan
    it replaced at the same bucket: where the contexts move on before the trial has its steps
    there, and the old plan has no rate at the new bucket, it goes back without a verdict
    (and without doubling the wait for the next probe)."""
    measured = _Steps(1e6, switch_s=1.0)
    policy = _switching(measured, probe_steps=2)
    short, long = ContextTracker().observe([1024, 800]), ContextTracker().observe([1500, 1400])
    pool = slots(4)

    def step(n: int, seconds: float, stats: ContextStats) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=short, slots=pool)
    step(1, 1.0, short)
    step(2, 1.0, short)
    measured.slow = ("train", first.plan.actor("trainer").parallel)
    assert step(3, 1.0, short).changed  # on prices, on trial at 1024
    moved = [step(n, 0.5, long) for n in range(4, 9)]  # 2,000 tok/s, but at 1536
    assert moved[0].plan.context_bucket == 1536 and not any(d.changed for d in moved)
    assert moved[-1].reason == "on trial: the plan it replaced has no rate at context 1536 (5/6)"
    w = policy.switching._window(1536)  # the rate at 1536: its steps there only
    assert w is not None and {b for *_, b in w} == {1536} and len(w) == 4
    last = step(9, 0.5, long)
    assert last.changed and last.reason.startswith("trial without a verdict")
    assert _shape(last) == _shape(first) and policy.switching.probe_wait == 1


def test_a_plan_is_left_on_prices_only_once_measured_end_to_end() -> None:
    """Where the loop measures plans end to end, the current plan first runs `probe_steps`
    measured steps at its bucket (so a measured switch can come back to it: three gauntlet runs
    left their first plan at step 4 on two batches' rates); a policy nothing feeds (the cluster
    simulator) switches on prices alone, as before."""
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)

    def run(fed: bool, unmeasured: int = 0) -> list[Decision]:
        measured = _Steps(1e6, switch_s=1.0)
        policy = _switching(measured, probe_steps=3)
        if fed:  # the loop's start: no step yet
            policy.observe_step(tokens=0.0, seconds=0.0)
        first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
        measured.slow = ("train", first.plan.actor("trainer").parallel)
        out = []
        for n in range(1, 5 + unmeasured):
            if fed:
                policy.observe_step(tokens=1000.0, seconds=1.0 if n > unmeasured else 0.0)
            out.append(policy.decide(step=n, when="prep", contexts=stats, slots=pool))
        return out

    fed = run(fed=True)
    assert [d.changed for d in fed] == [False, False, True, False]
    assert "not measured end to end at context 1024 yet (1/3 steps)" in fed[0].reason
    assert run(fed=False)[0].changed
    # the loop's first steps go unmeasured (settling): the plan is kept through them too (run
    # S at 0f82699 left its first plan at step 5, before its first measured step)
    settling = run(fed=True, unmeasured=4)
    assert [d.changed for d in settling] == [False] * 6 + [True, False]
    assert "(0/3 steps)" in settling[0].reason


@pytest.mark.parametrize("with_context", [True, False])
def test_end_to_end_rates_compare_plans_at_the_same_cost_per_token(with_context: bool) -> None:
    """Contexts grow while plans take turns, and a token of a longer context costs more: given
    each step's typical context, the end-to-end rates are in roofline seconds per second, so a
    plan measured a few steps earlier at shorter contexts does not look faster for it (run J
    moved back to one that did); without contexts the raw rates compare."""
    measured = _Steps(1e6, switch_s=1.0)
    policy = _switching(measured, probe_steps=2)
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)
    roof = {n: SMALL.tokens_per_s("train", Parallel(), n, batch_tokens=n) for n in (512, 1024)}
    slower = roof[1024] / roof[512]  # the longer context's tokens/s at the same efficiency

    def step(n: int, seconds: float, context: int) -> Decision:
        policy.observe_step(tokens=1000.0, seconds=seconds,
                            context=context if with_context else 0)
        return policy.decide(step=n, when="prep", contexts=stats, slots=pool)

    first = policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    step(1, 1.0, 512)
    step(2, 1.0, 512)
    measured.slow = ("train", first.plan.actor("trainer").parallel)
    assert step(3, 1.0, 512).changed  # on prices
    step(4, 1.0 / (1.05 * slower), 1024)  # 5% faster than the first plan, per unit of cost
    after = step(5, 1.0 / (1.05 * slower), 1024)
    assert slower < 0.85  # the raw rate is lower by more than switch_gain
    assert after.changed is not with_context


class _Efficient(_Steps):
    """Recomputing layouts measured (or borrowed) at 4x the plain ones' efficiency."""

    def efficiency(self, stage: object, par: object = None, context: object = None) -> float:
        return 2.0 if getattr(par, "recompute", False) else 0.5


def test_activation_recomputation_is_taken_only_where_the_plain_layout_does_not_fit() -> None:
    """Recomputation computes one more forward: never faster than the same layout without. A
    price that says otherwise comes from efficiencies (a layout not run borrows its stage's
    at the bucket; run M trained 376 of 400 steps recomputing on one); it is used only for
    what the plain layout cannot hold."""
    policy = SearchPolicy(SMALL, measured=_Efficient(1e4, 1.0))
    two = ("s00", "s01")
    plain = policy.best("trainer", two, 4096, 1 * GB)
    assert plain is not None and not plain.parallel.recompute
    priced = policy.evaluate("trainer", replace(plain.parallel, recompute=True), two, 4096,
                             1 * GB)
    assert priced is not None and priced.tokens_per_s > plain.tokens_per_s  # the price's view
    tight = policy.best("trainer", two, 4096, 0.05 * GB)  # only recomputation holds it here
    assert tight is not None and tight.parallel.recompute


def test_a_plan_held_longer_is_rated_by_more_of_its_steps() -> None:
    """A step's seconds vary 2-3x with its batch's longest game: a plan's end-to-end rate is
    taken over its last 3 x `probe_steps` steps since it came in, not the last `probe_steps`
    alone (two slow batches would halve it)."""
    policy = _switching(_Steps(1e6, switch_s=1.0), probe_steps=2)
    stats, pool = ContextTracker().observe([1024, 800]), slots(4)
    policy.decide(step=0, when="prep", contexts=stats, slots=pool)
    for seconds in (1.0, 1.0, 1.0, 1.0, 4.0, 4.0):
        policy.observe_step(tokens=1000.0, seconds=seconds)
    (end,) = policy.switching.ends.values()
    assert end.rate == pytest.approx(6000 / 12)  # the last two alone: 2000 / 8


def test_a_switch_pays_off_at_the_loops_measured_step_seconds_there_and_back() -> None:
    """Where the loop measures steps, the saving is the priced share of a step times the
    step's measured seconds (run T's composed prices put its steps at several times what they
    took, and a TP 2 replica "paid" for a 17 s start), and a switch to a plan not measured at
    the bucket costs the way back too."""
    policy = SearchPolicy(SMALL, PolicyConfig(respawn_cost_s=15.0, horizon_steps=50,
                                              probe_steps=2),
                          measured=_Steps(1e9, switch_s=1.0))  # priced: long steps
    two, other = ("s00", "s01"), ("s02", "s03")

    def plan(rollout: Parallel) -> Plan:
        r = policy.evaluate("rollout", rollout, two, 1024, 80 * GB)
        t = policy.evaluate("trainer", Parallel(dp=2), other, 1024, 80 * GB)
        assert r is not None and t is not None
        return Plan(actors=(r, t), context_bucket=1024)

    cur, dp2 = plan(Parallel(tp=2)), plan(Parallel(dp=2))  # new engine processes either way
    share = 1 - policy.score(cur, None) / policy.score(dp2, None)
    assert share > 0
    priced, ledger = policy.switching.pays_off(dp2, cur, None, 1024)
    assert priced and "there and back" not in ledger, ledger  # nothing measured: prices
    for _ in range(2):
        policy.observe_step(tokens=1000.0, seconds=0.5)
    pays, ledger = policy.switching.pays_off(dp2, cur, None, 1024)
    assert f"would save {0.5 * share * 50:.1f} s" in ledger
    assert "a switch costs 30.0 s there and back" in ledger and not pays
