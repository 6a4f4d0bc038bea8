"""earl.loop.selection with a fake reconfigurer and the real policy, no processes: the rollout's
context grows before the contexts reach it, the trainer's budget follows the contexts without a
restart, re-creations never overlap a play, decisions become selector/* rows and trace events,
and the Schedule calls the selection around every stage."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from earl.config import RunConfig
from earl.loop.schedule import LoopState, Schedule
from earl.loop.selection import (
    ReferenceProgress,
    Selection,
    Setting,
    _Training,
    keep_places,
    setting_of,
)
from earl.runtime.selector import (
    ActorPlan,
    CostConfig,
    CostModel,
    Decision,
    ModelShape,
    Parallel,
    Plan,
    PolicyConfig,
    SearchPolicy,
)
from earl.stages.batch_types import BatchResult, Episode

pytestmark = pytest.mark.timeout(30)

MIB = 2**20
SHAPE = ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192, vocab=512,
                   params=120_000)
COST = CostModel(SHAPE, CostConfig(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, act_bytes=4,
                                   kv_bytes=4, logit_bytes=8, reserve_bytes=400 * MIB))
SLOTS = {"rollout0": 480.0 * MIB, "trainer0": 480.0 * MIB}
PLANNED_KV = 32256  # the KV budget the policy gives a rollout slot of SLOTS (a run spawns with it)

def schedule_config(*, time_limit_s: float = float("inf"), eval_every: int = 0,
                    **kw: object) -> RunConfig:
    """The run settings the schedule reads (no evals, no time limit unless given; whole
    batches, as the selector plans them)."""
    return RunConfig(time_limit_minutes=time_limit_s / 60, eval_every=eval_every,
                     partial_rollouts="off", **kw)  # type: ignore[arg-type]



class FakeReconfigurer:
    def __init__(self) -> None:
        self.applied: list[tuple[Setting, Setting]] = []
        self.budgets: list[int] = []
        self.recompute: list[bool] = []
        self.busy = 0  # plays in flight, set by the fake production

    async def set_micro_batch_tokens(self, tokens: int) -> None:
        self.budgets.append(tokens)

    async def set_recompute(self, on: bool) -> None:
        self.recompute.append(on)

    async def apply(self, old: Setting, new: Setting) -> dict[str, float]:
        assert self.busy == 0, "re-created an actor while a play was using it"
        await asyncio.sleep(0.001)
        self.applied.append((old, new))
        return {"rollout/spawn_s": 0.5, "trainer/save_s": 0.25}


def _result(batch: int, lengths: list[int]) -> BatchResult:
    eps = [Episode(sample_id=f"b{batch}-{i}", group_id="g", reward=0.0, tokens=n)
           for i, n in enumerate(lengths)]
    return BatchResult(batch=batch, episodes=eps, samples=len(eps), seconds=0.0)


def _selection(reconf: FakeReconfigurer, rows: list[dict[str, float | int | str]],
               events: list[Decision], *, window: int = 512,
               mb: int = 1 << 16, kv: int = PLANNED_KV) -> Selection:
    policy = SearchPolicy(COST, PolicyConfig(actors={"rollout": "rollout", "trainer": "train"},
                                             pp_max=1, bucket_base=256))
    setting = Setting(micro_batch_tokens=mb, max_model_len=window, kv_tokens=kv,
                      rollout_slots=("rollout0",), trainer_slots=("trainer0",))

    async def queues() -> dict[str, int]:
        return {"train": 8}

    return Selection(policy, reconf, setting=setting, slots=lambda: SLOTS, queues=queues,
                     max_context=4096, record=rows.append, trace=events.append)


def test_growing_contexts_grow_the_rollout_window_ahead_and_shrink_the_budget() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events)

    async def main() -> None:
        for b in range(12):
            async with sel.rollout(b):
                pass
            lengths = [150 + 110 * b + 7 * i for i in range(16)]  # grows ~110 tokens a step
            async with sel.train(b, _result(b, lengths)):
                pass
            # the window set now covers this batch's longest trajectory, and the next one's
            assert sel.setting.max_model_len >= max(lengths) + 110

    asyncio.run(main())
    assert reconf.applied, "the window never grew"
    grown = [new.max_model_len for _, new in reconf.applied]
    assert grown == sorted(grown) and grown[-1] > 512
    # the micro-batch budget followed the contexts down without a restart
    assert reconf.budgets and min(reconf.budgets) < 1 << 16
    assert sel.statistics().reconfigurations == len(reconf.applied)
    assert sel.statistics().reconfig_seconds["rollout/spawn_s"] == 0.5 * len(reconf.applied)
    assert len(rows) == len(events) == 24
    assert {r["selector/when"] for r in rows} == {"rollout", "prep"}
    for key in ("selector/context_p50", "selector/context_p95", "selector/context_max",
                "selector/context_trend", "selector/reason", "selector/trainer/tp",
                "selector/rollout/micro_batch_tokens", "selector/applied_max_model_len",
                "selector/reconfig_s"):
        assert key in rows[-1]
    assert any(float(r["selector/reconfig_s"]) > 0 for r in rows)


def test_steady_contexts_do_not_reconfigure() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)

    async def main() -> None:
        for b in range(10):
            async with sel.rollout(b):
                pass
            async with sel.train(b, _result(b, [300 + (b % 2) * 40] * 8)):
                pass

    asyncio.run(main())
    assert reconf.applied == []
    assert sel.setting.max_model_len == 1024  # never shrinks


def test_a_reconfiguration_waits_for_the_play_in_flight() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=256)
    order: list[str] = []

    async def play(b: int, hold: asyncio.Event) -> None:
        async with sel.rollout(b):
            reconf.busy += 1
            order.append(f"play{b}")
            await hold.wait()
            reconf.busy -= 1
            order.append(f"done{b}")

    async def main() -> None:
        hold = asyncio.Event()
        first = asyncio.create_task(play(0, hold))
        await asyncio.sleep(0.01)
        sel.observe(_result(0, [900, 1000, 1100]))  # contexts jumped past the 256 window
        second = asyncio.create_task(play(1, asyncio.Event()))
        await asyncio.sleep(0.01)
        assert reconf.applied == []  # still waiting for play 0
        hold.set()
        await first
        await asyncio.sleep(0.01)
        assert len(reconf.applied) == 1
        second.cancel()

    asyncio.run(main())
    assert order[:2] == ["play0", "done0"]


def test_setting_of_caps_and_keeps_the_window() -> None:
    cur = Setting(micro_batch_tokens=4096, max_model_len=1024, kv_tokens=1024)

    def plan(bucket: int, tp: int = 1, pp: int = 1) -> Plan:
        return Plan(context_bucket=bucket, actors=(
            ActorPlan(actor="rollout", stage="rollout", parallel=Parallel(), slots=("a",),
                      micro_batch_tokens=bucket * 2, predicted_bytes=0, tokens_per_s=1),
            ActorPlan(actor="trainer", stage="train", parallel=Parallel(tp=tp, pp=pp),
                      slots=("b", "c")[:tp * pp], micro_batch_tokens=bucket,
                      predicted_bytes=0, tokens_per_s=1)))

    assert setting_of(plan(512), cur, max_context=2048).max_model_len == 1024  # no shrink
    s = setting_of(plan(3072, tp=2), cur, max_context=2048)
    assert (s.max_model_len, s.kv_tokens, s.trainer_tp, s.trainer_slots) == \
        (2048, 6144, 2, ("b", "c"))
    with pytest.raises(ValueError, match="pp_max=1"):
        setting_of(plan(512, pp=2), cur, max_context=2048)


def test_a_planned_reference_gets_its_devices_data_parallel_only() -> None:
    cur = Setting(micro_batch_tokens=4096, max_model_len=1024, kv_tokens=1024,
                  reference_slots=("r0",))

    def plan(ref: Parallel, slots: tuple[str, ...]) -> Plan:
        return Plan(context_bucket=1024, actors=(
            ActorPlan(actor="reference", stage="reference", parallel=ref, slots=slots,
                      micro_batch_tokens=1024, predicted_bytes=0, tokens_per_s=1),))

    s = setting_of(plan(Parallel(dp=2), ("r0", "r1")), cur, max_context=2048)
    assert s.reference_slots == ("r0", "r1") and s.trainer_key() == cur.trainer_key()
    assert s.changed(cur) == ["reference"]  # only the reference is re-created
    with pytest.raises(ValueError, match="data parallel only"):
        setting_of(plan(Parallel(tp=2), ("r0", "r1")), cur, max_context=2048)


def test_actors_giving_up_devices_are_re_created_before_those_taking_them() -> None:
    from earl.loop.selection_actors import _order

    old = Setting(micro_batch_tokens=1, max_model_len=1, kv_tokens=1, rollout_slots=("d0",),
                  trainer_slots=("d1",), reference_slots=("d2", "d3"))
    # the trainer takes the reference's d3, the reference takes nothing: reference first
    new = replace(old, trainer_slots=("d1", "d3"), trainer_dp=2, reference_slots=("d2",))
    assert _order(["trainer", "reference"], old, new) == ["reference", "trainer"]
    # a chain: the rollout takes the trainer's d1, the trainer takes the reference's d2
    chain = replace(old, rollout_slots=("d0", "d1"), trainer_slots=("d2",),
                    reference_slots=("d3",))
    assert _order(["trainer", "rollout", "reference"], old, chain) == \
        ["reference", "trainer", "rollout"]
    swap = replace(old, rollout_slots=("d1",), trainer_slots=("d0",))
    assert _order(["trainer", "rollout"], old, swap) == ["rollout", "trainer"]


class _Prod:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        self.log.append(f"play{batch}")
        return _result(batch, [100 + 50 * batch] * 4)

    async def note_version(self, version: int) -> None:
        pass


class _Train:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: object = None) -> dict[str, float]:
        self.log.append(f"train{batch}")
        return {}

    async def publish(self, version: int) -> None:
        self.log.append(f"publish{version}")


class _Ckpt:
    async def save(self, state: LoopState, critic_batch: int | None) -> None:
        pass


def test_schedule_calls_the_selection_around_each_stage() -> None:
    log: list[str] = []
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events)
    orig_rollout, orig_train = sel.rollout, sel.train

    def rollout(b: int):  # type: ignore[no-untyped-def]
        log.append(f"decide-rollout{b}")
        return orig_rollout(b)

    def train(b: int, res: BatchResult):  # type: ignore[no-untyped-def]
        log.append(f"decide-prep{b}")
        return orig_train(b, res)

    sel.rollout, sel.train = rollout, train  # type: ignore[method-assign]
    sched = Schedule(schedule_config(steps=3, max_policy_lag=0), production=_Prod(log),
                     training=_Train(log), evaluation=None, checkpoints=_Ckpt(),
                     state=LoopState(), selection=sel)
    asyncio.run(sched.run())
    for b in range(3):
        assert log.index(f"decide-rollout{b}") < log.index(f"play{b}")
        assert log.index(f"play{b}") < log.index(f"decide-prep{b}") < log.index(f"train{b}")
    assert [r["selector/when"] for r in rows] == ["rollout", "prep"] * 3


def test_trajectories_cut_by_the_window_count_as_longer() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=512)
    res = _result(0, [200, 300, 500])
    res.episodes[2].truncated = True  # cut at the window: needs more than 512
    assert sel.observe(res).max == 2048
    res.episodes[0].truncated = True  # cut by a per-turn cap, far from the window
    assert sel.observe(res).p50 == 300


def test_an_infeasible_plan_grows_the_window_keeps_layouts_and_reports() -> None:
    reconf, rows = FakeReconfigurer(), []
    policy = SearchPolicy(COST, PolicyConfig(actors={"rollout": "rollout", "trainer": "train"},
                                       pp_max=1, bucket_base=256))
    setting = Setting(micro_batch_tokens=1 << 16, max_model_len=256, kv_tokens=256,
                      rollout_slots=("rollout0",), trainer_slots=("trainer0",))

    async def queues() -> dict[str, int]:
        return {}

    tight = {"rollout0": 401.0 * MIB, "trainer0": 401.0 * MIB}  # the reserve alone is 400
    sel = Selection(policy, reconf, setting=setting, slots=lambda: tight, queues=queues,
                    max_context=4096, record=rows.append, initial_context=1000)

    async def main() -> None:
        async with sel.rollout(0):
            pass

    asyncio.run(main())
    assert rows[0]["selector/feasible"] == 0 and rows[0]["selector/shortfall"]
    s = sel.setting
    assert s.max_model_len == 1024 and s.micro_batch_tokens == 1024
    # the rollout was re-created, the trainer kept: its budget still reached it
    assert len(reconf.applied) == 1 and reconf.budgets == [1024]
    assert (s.trainer_tp, s.trainer_slots, s.rollout_slots) == (1, ("trainer0",), ("rollout0",))


def test_the_first_plan_is_applied_at_spawn_not_by_a_re_creation() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    policy = SearchPolicy(COST, PolicyConfig(actors={"rollout": "rollout", "trainer": "train"},
                                       pp_max=1, bucket_base=256))
    setting = Setting(micro_batch_tokens=1 << 16, max_model_len=256, kv_tokens=256,
                      rollout_slots=("rollout0",), trainer_slots=("trainer0",))

    async def queues() -> dict[str, int]:
        return {"train": 0}

    sel = Selection(policy, reconf, setting=setting, slots=lambda: SLOTS, queues=queues,
                    max_context=4096, record=rows.append, trace=events.append,
                    initial_context=2000)
    spawned: list[Setting] = []

    async def spawn(s: Setting) -> None:
        assert not rows, "the decision was recorded before the actors it set up existed"
        spawned.append(s)

    async def main() -> None:
        await sel.start(3, spawn)
        async with sel.rollout(3):  # decided at spawn: no second decision
            pass
        async with sel.train(3, _result(3, [1500] * 4)):
            pass
        async with sel.rollout(4):
            pass

    asyncio.run(main())
    assert len(spawned) == 1 and spawned[0].max_model_len >= 2000
    assert reconf.applied == []  # the rollout was born with the window: nothing re-created
    assert sel.setting.max_model_len == spawned[0].max_model_len
    # the trainer existed already: the plan's budget reached it the way later ones do
    assert reconf.budgets and reconf.budgets[0] == sel.decisions[0].plan.actor(
        "trainer").micro_batch_tokens
    assert [r["selector/when"] for r in rows] == ["rollout", "prep", "rollout"]
    assert len(events) == 3
    assert rows[0]["selector/applied_max_model_len"] == spawned[0].max_model_len
    assert rows[0]["selector/reconfigurations"] == 0 and rows[0]["selector/reconfig_s"] == 0.0


def test_a_kv_only_change_rebuilds_the_rollout_and_a_small_one_does_not() -> None:
    """The policy's KV budget alone is a change (vLLM sizes its cache at start: the engines
    are rebuilt in place, same replicas and slots) when it grows or shrinks by `KV_CHANGE` or
    more (a much smaller plan: the cache no longer fits beside the grown process); a slightly
    other size is not worth a rebuild."""
    for start, rebuilt in ((4096, True), (int(PLANNED_KV * 0.9), False),
                           (int(PLANNED_KV * 1.1), False), (PLANNED_KV * 3, True)):
        reconf, rows, events = FakeReconfigurer(), [], []
        sel = _selection(reconf, rows, events, window=1024, kv=start)

        async def main(sel: Selection = sel) -> None:
            async with sel.rollout(0):
                pass

        asyncio.run(main())
        assert bool(reconf.applied) is rebuilt, start
        if rebuilt:
            old, new = reconf.applied[0]
            assert old.rollout_key()[:4] == new.rollout_key()[:4]  # layout, slots, window
            assert (old.kv_tokens, new.kv_tokens) == (start, PLANNED_KV)
            assert rows[0]["selector/applied_kv_tokens"] == PLANNED_KV
        else:
            assert sel.setting.kv_tokens == start


def test_recompute_switches_live_and_the_step_reaches_the_profile() -> None:
    """A plan that recomputes activations reaches the live trainer with no re-creation; each
    batch's rollout and training step are recorded in the run profile at the setting they
    ran with, and the profile's rows reach the metrics."""
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    profile = RunProfile(COST)
    sel = _selection(reconf, rows, events, window=1024)
    sel.profile = profile
    lengths = [600, 700, 800]
    res = BatchResult(batch=0, episodes=_result(0, lengths).episodes, samples=3, seconds=2.0)

    async def main() -> None:
        async with sel.rollout(0):
            pass
        async with sel.train(0, res):
            pass
        sel.trained(0, {"tokens": 2100.0, "step_time_s": 3.0, "peak_rss_mib": 900.0})
        async with sel.rollout(1):  # the next decision reads the profile
            pass
        await sel._apply(replace(sel.setting, trainer_recompute=True))

    asyncio.run(main())
    assert reconf.recompute == [True] and reconf.applied == []
    assert sel.statistics().recompute_changes == 1
    assert profile.tokens_per_s("rollout", Parallel(), 800) is not None  # its busy time
    assert profile.tokens_per_s("train", Parallel(), 800) == pytest.approx(2100 / 3.0)
    assert profile.memory_scale("train") >= 1.0 and "train" in profile.memory
    assert "selector/profile/train/efficiency" in rows[-1]


def test_the_reference_is_measured_per_step_at_its_ranks_and_a_new_group_starts_afresh(
) -> None:
    """Each trained step records the reference's tokens and busy seconds since the last one,
    per rank in parallel; counters that went down (a re-created group) count from zero."""
    from earl.runtime import ActorDied
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    sel.profile = RunProfile(COST)
    sel.setting = replace(sel.setting, reference_slots=("r0", "r1"))
    progress = iter([(3000, 4.0), (6000, 8.0), None, (1500, 1.0)])

    async def reference() -> ReferenceProgress:
        got = next(progress)
        if got is None:  # a rank restarting: that step goes unmeasured, the run goes on
            raise ActorDied("reference[0]", "connection lost")
        return ReferenceProgress(*got)

    sel.reference_progress = reference

    async def main() -> None:
        for b in range(4):
            async with sel.train(b, _result(b, [600, 700, 800])):
                pass

    asyncio.run(main())
    rate = sel.profile.rates[("reference", str(Parallel(dp=2)), sel.profile.bucket_of(800))]
    # steps of 3000, 3000 and 1500 tokens in 2, 2 and 0.5 s (busy / 2 ranks); each older
    # step counts half: 3000 / 4 + 3000 / 2 + 1500 tokens over 2 / 4 + 2 / 2 + 0.5 s
    assert rate.tokens == pytest.approx(3750) and rate.seconds == pytest.approx(2.0)
    assert "reference" not in sel.profile.memory  # no peak read: nothing assumed


def test_the_reference_memory_peak_scales_its_predicted_memory() -> None:
    """A reference rank whose peak exceeds the cost model's prediction for its forward
    passes (`token_budget` padded tokens) makes the policy plan it larger from then on."""
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    sel.profile = RunProfile(COST)
    sel.setting = replace(sel.setting, reference_slots=("r0",))
    predicted = COST.memory("reference", Parallel(), seq_len=800,
                            micro_batch_tokens=4096).total

    async def reference() -> ReferenceProgress:
        return ReferenceProgress(3000, 4.0, peak_mib=1.5 * predicted / 2**20, token_budget=4096)

    sel.reference_progress = reference

    async def main() -> None:
        async with sel.train(0, _result(0, [600, 700, 800])):
            pass

    asyncio.run(main())
    assert sel.profile.memory_scale("reference") == pytest.approx(1.5, rel=0.01)


def test_a_policy_of_ones_own_plugs_in_by_factory(tmp_path: Path) -> None:
    """`selector.policy_factory` names a factory (cost, knobs, profile) -> Policy: the loop
    runs that policy's decisions unchanged; a bad reference names the field."""
    from earl.loop.selection_actors import make_policy
    from earl.runtime.selector import RunProfile

    (tmp_path / "mine.py").write_text(
        "from earl.runtime.selector import SearchPolicy\n"
        "class Mine(SearchPolicy):\n"
        "    calls = 0\n"
        "    def decide(self, **kw):\n"
        "        Mine.calls += 1\n"
        "        return super().decide(**kw)\n"
        "def factory(cost, config, measured):\n"
        "    return Mine(cost, config, measured=measured)\n"
        "def nothing(cost, config, measured):\n"
        "    return 3\n")
    knobs = PolicyConfig(actors={"rollout": "rollout", "trainer": "train"}, pp_max=1)
    policy = make_policy(f"{tmp_path}/mine.py:factory", COST, knobs, RunProfile(COST))
    assert type(policy).__name__ == "Mine"
    reconf = FakeReconfigurer()

    async def queues() -> dict[str, int]:
        return {}

    sel = Selection(policy, reconf, setting=Setting(micro_batch_tokens=4096, max_model_len=512,
                                                    kv_tokens=PLANNED_KV),
                    slots=lambda: SLOTS, queues=queues, max_context=4096)

    async def main() -> None:
        async with sel.rollout(0):
            pass

    asyncio.run(main())
    assert type(policy).calls == 1 and sel.decisions[0].plan.feasible
    with pytest.raises(ValueError, match="selector.policy_factory"):
        make_policy(f"{tmp_path}/absent.py:factory", COST, knobs, RunProfile(COST))
    with pytest.raises(TypeError, match="no decide"):
        make_policy(f"{tmp_path}/mine.py:nothing", COST, knobs, RunProfile(COST))


def test_a_device_moved_from_the_rollout_to_the_trainer_is_counted() -> None:
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    sel.setting = replace(sel.setting, rollout_replicas=2, rollout_slots=("d0", "d1"),
                          trainer_slots=("d2",))

    async def main() -> None:
        await sel._apply(replace(sel.setting, rollout_replicas=1, rollout_slots=("d0",),
                                 trainer_dp=2, trainer_slots=("d1", "d2")))
        await sel._apply(replace(sel.setting, trainer_slots=("d1", "d3")))  # d2 out, d3 in

    asyncio.run(main())
    st = sel.statistics()
    assert (st.device_moves, st.trainer_layout_changes, st.rollout_layout_changes) == (3, 1, 1)
    assert st.reconfigurations == 2


def test_overlapping_plays_are_measured_by_the_rollouts_busy_time() -> None:
    """With plays in flight together (max_policy_lag), a batch's own wall time undercounts
    the rollout's rate: the profile gets tokens per second of busy rollout (from the end of
    the previous play, or from this one's start when the rollout was idle)."""
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    sel.profile = RunProfile(COST)

    async def play(b: int, wait: float) -> None:
        async with sel.rollout(b):
            await asyncio.sleep(wait)

    async def main() -> None:
        await asyncio.gather(play(0, 0.2), play(1, 0.3))  # overlapping: 0.3 s busy in all
        for b in (0, 1):
            res = _result(b, [500] * 4)
            res.seconds = 0.2 + 0.1 * b  # each batch's own wall time
            async with sel.train(b, res):
                pass

    asyncio.run(main())
    # 2000 tokens in ~0.2 s, then 2000 more in the ~0.1 s after: 1/0.1 s, not 1/0.3 s
    rate = sel.profile.tokens_per_s("rollout", Parallel(), 500)
    assert rate is not None and rate > 2000 / 0.3 * 1.5


def test_equal_devices_stay_where_they_are_across_a_change() -> None:
    """A plan names devices by position; with equal devices each stage keeps its own and takes
    free ones (then what the other gives up), so a change moves as few as it can."""
    cur = Setting(micro_batch_tokens=1024, max_model_len=512, kv_tokens=512,
                  rollout_slots=("device0",), trainer_slots=("device1",))
    grow = replace(cur, rollout_replicas=2, trainer_dp=2, rollout_slots=("device0", "device1"),
                   trainer_slots=("device2", "device3"))
    two = keep_places(grow, cur)
    assert two.rollout_slots == ("device0", "device2")
    assert two.trainer_slots == ("device1", "device3")
    # the rollout gives one back: the trainer keeps its two and takes it
    shift = replace(two, rollout_replicas=1, trainer_dp=3, rollout_slots=("device0",),
                    trainer_slots=("device1", "device2", "device3"))
    three = keep_places(shift, two)
    assert three.rollout_slots == ("device0",)
    assert three.trainer_slots == ("device1", "device3", "device2")
    assert keep_places(two, two) == two  # nothing to move
    # with a reference: it keeps its device, and a second rank takes the free one
    ref = replace(cur, reference_slots=("device2",))
    wide = replace(ref, trainer_dp=2, trainer_slots=("device0", "device1"),
                   rollout_slots=("device2",), reference_slots=("device3", "device4"))
    placed = keep_places(wide, ref)
    assert placed.rollout_slots == ("device0",)
    assert placed.trainer_slots == ("device1", "device3")
    assert placed.reference_slots == ("device2", "device4")


def test_a_stage_in_devices_is_measured_by_what_its_devices_were_charged() -> None:
    """With device slots the trainer's memory is its devices' charged peak (what the kernel
    enforces), not its ranks' resident set (which counts pages charged elsewhere)."""
    from earl.runtime.selector import RunProfile

    def measured(device_peak: Callable[[tuple[str, ...]], float | None] | None) -> float:
        reconf, rows, events = FakeReconfigurer(), [], []
        sel = _selection(reconf, rows, events, window=1024)
        sel.profile, sel.device_peak = RunProfile(COST), device_peak

        async def main() -> None:
            async with sel.train(0, _result(0, [600, 700, 800])):
                pass
            sel.trained(0, {"tokens": 2100.0, "step_time_s": 3.0, "peak_rss_mib": 900.0})

        asyncio.run(main())
        return sel.profile.memory["train"]

    asked: list[tuple[str, ...]] = []

    def charged(names: tuple[str, ...]) -> float:
        asked.append(names)
        return 700.0

    assert measured(charged) == pytest.approx(measured(None) * 700 / 900)
    assert asked == [("trainer0",)]
    assert measured(lambda names: None) == pytest.approx(measured(None))  # not measured


def test_the_first_step_after_a_move_is_not_measured_on_the_device_it_moved() -> None:
    """A device a move gave the trainer was charged for its last holder (a vLLM replica)
    since its peak was last read: that step's peak is not the trainer's, so it is not
    recorded (it ended the gauntlet's memory slack at step 4); the next step's is."""
    from dataclasses import replace

    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    read: list[tuple[str, ...]] = []

    def charged(names: tuple[str, ...]) -> float:
        read.append(names)
        return 200.0  # below what COST predicts for the step: slack

    sel.profile, sel.device_peak = RunProfile(COST), charged
    step = {"tokens": 2100.0, "step_time_s": 3.0, "peak_rss_mib": 900.0}
    moved = replace(sel.setting, trainer_dp=2, trainer_slots=("trainer0", "rollout1"))

    asyncio.run(sel._apply(moved))  # rollout1 held nothing of the trainer's before
    for batch in (0, 1):  # two steps trained in the moved setting (no decision between)
        sel._training[batch] = _Training(sel.setting, 800, 2100, 0)
        sel.trained(batch, step)
        if batch == 0:
            assert "train" not in sel.profile.memory and read == [("trainer0", "rollout1")]
    assert read == [("trainer0", "rollout1")] * 2  # both readings start a new peak
    assert sel.profile.memory["train"] > 0 and sel.profile.memory_slack("train") > 0


def test_the_first_batch_of_a_re_created_actor_is_not_measured() -> None:
    """A re-created trainer (new ranks) and rollout (new replicas) warm up on their first
    batch: that batch's rates stay out of the profile (priced by it, a layout just moved to
    looked 4x slower and the selector moved back); the next batch's go in."""
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    profile = sel.profile = RunProfile(COST)

    def steps() -> tuple[int, int]:
        def of(stage: str) -> int:
            return sum(r.steps for (s, _, _), r in profile.rates.items() if s == stage)
        return of("rollout"), of("train")

    async def batch(b: int) -> None:
        async with sel.rollout(b):
            pass
        async with sel.train(b, _result(b, [600, 700, 800])):
            pass
        sel.trained(b, {"tokens": 2100.0, "step_time_s": 3.0})

    async def main() -> None:
        await batch(0)  # the first plan: no re-creation, measured
        assert steps() == (1, 1)
        planned = sel.setting
        sel.setting = replace(planned, trainer_dp=2, rollout_replicas=2)  # as if elsewhere
        await sel._apply(planned)  # both re-created
        await batch(1)
        assert steps() == (1, 1)
        await batch(2)
        assert steps() == (2, 2)

    asyncio.run(main())
    assert len(reconf.applied) == 1


def test_a_training_step_is_measured_in_its_batchs_trajectory_tokens() -> None:
    """The trainer's rate is in the rollout's unit, the batch's trajectory tokens per second,
    however many more tokens the step trained (replayed samples: the gauntlet's
    self-imitation trains 48 samples per 32 played): the two rates compare as time per step."""
    from earl.runtime.selector import RunProfile

    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    sel.profile = RunProfile(COST)

    async def main() -> None:
        async with sel.rollout(0):
            pass
        async with sel.train(0, _result(0, [600, 700, 800])):
            pass
        sel.trained(0, {"tokens": 3150.0, "step_time_s": 3.0})  # 1.5x what was played

    asyncio.run(main())
    assert sel.profile.tokens_per_s("train", Parallel(), 800) == pytest.approx(2100 / 3.0)
    assert sel.profile.step_tokens() == 2100


def test_the_policy_is_fed_steps_end_to_end_but_those_a_change_ran_in() -> None:
    """`observe_step` gets each training step's trajectory tokens, the loop's seconds since
    the previous step and the trajectories' token-weighted length; the first `SETTLE_STEPS`,
    and as many after a re-creation (the change itself, new actors warming up, the pipeline
    refilling), are left out, as is a step that ends while the change is applied (it ran the
    old plan, which the policy has already left)."""
    reconf, rows, events = FakeReconfigurer(), [], []
    sel = _selection(reconf, rows, events, window=1024)
    fed: list[tuple[float, float]] = []
    told: list[float] = []  # every call's seconds: 0 for the steps left unmeasured

    def observe(*, tokens: float, seconds: float, context: int) -> None:
        told.append(seconds)
        if seconds:
            assert context == (600**2 + 700**2 + 800**2) // 2100  # token-weighted length
            fed.append((tokens, seconds))

    sel.policy.observe_step = observe  # type: ignore[method-assign]

    async def batch(b: int) -> None:
        async with sel.rollout(b):
            await asyncio.sleep(0.01)
        async with sel.train(b, _result(b, [600, 700, 800])):
            pass
        sel.trained(b, {"tokens": 2100.0, "step_time_s": 0.01})

    async def main() -> None:
        settle = Selection.SETTLE_STEPS
        for b in range(settle + 2):
            await batch(b)
        assert len(fed) == 2
        assert all(t == 2100 and s >= 0.01 for t, s in fed)
        b = settle + 2
        async with sel.rollout(b):
            pass
        async with sel.train(b, _result(b, [600, 700, 800])):
            pass
        planned = sel.setting
        sel.setting = replace(planned, trainer_dp=2)  # as if elsewhere: re-created below
        apply = reconf.apply

        async def step_ends_meanwhile(old: Setting, new: Setting) -> dict[str, float]:
            sel.trained(b, {"tokens": 2100.0, "step_time_s": 0.01})  # it ran the old plan
            return await apply(old, new)

        reconf.apply = step_ends_meanwhile  # type: ignore[method-assign]
        await sel._apply(planned)
        assert told[-1] == 0.0 and len(fed) == 2
        for b in range(settle + 3, 2 * settle + 6):
            await batch(b)
        assert len(fed) == 2 + 3
        assert len(told) == len(fed) + 2 * settle + 1  # the unmeasured ones: seconds 0

    asyncio.run(main())
