"""earl.loop.watchdog with a fake clock: a run that makes no progress for its limit stalls with
the stage it waits in; steps and healing events are progress; the limit scales with the
longest step; a stalled schedule ends with `Stalled` instead of hanging."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from earl.loop.schedule import LoopState, Schedule
from earl.loop.watchdog import Stalled, Watchdog, stalled_in
from tests.unit.test_schedule import FakeCheckpoints, FakeEval, SimProduction, schedule_config

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_no_progress_past_the_limit_is_a_stall_naming_the_stage() -> None:
    clock = Clock()
    dog = Watchdog(stall_s=60.0, stall_steps=10.0, clock=clock,
                   healing=lambda: {"producer[0]": "reproduce_lost"})
    with dog.waiting("step 3's training"):
        clock.t += 59.0
        assert dog.check() is None
        clock.t += 2.0
        stall = dog.check()
    assert stall is not None
    assert stall.stage == "step 3's training" and stall.idle_s == pytest.approx(61.0)
    assert stall.limit_s == 60.0 and stall.healing == {"producer[0]": "reproduce_lost"}
    assert "step 3's training" in str(stall) and "producer[0] at reproduce_lost" in str(stall)
    assert dog.stage == ""  # the block ended


def test_steps_and_healing_events_are_progress() -> None:
    clock, healed = Clock(), [0.0]
    dog = Watchdog(stall_s=60.0, stall_steps=1.0, clock=clock, activity=lambda: healed[0])
    clock.t += 50.0
    dog.step_done()
    clock.t += 50.0
    assert dog.check() is None  # 50 s since the step
    healed[0] = clock.t  # a restart seen, a group re-played
    clock.t += 59.0
    assert dog.check() is None
    clock.t += 1.0
    assert dog.check() is not None
    dog.beat()
    assert dog.check() is None


def test_the_limit_scales_with_the_longest_step() -> None:
    clock = Clock()
    dog = Watchdog(stall_s=60.0, stall_steps=10.0, clock=clock)
    for dt in (2.0, 30.0, 5.0):  # the longest, 30 s, sets 300 s
        clock.t += dt
        dog.step_done()
    assert dog.limit_s() == 300.0
    clock.t += 299.0
    assert dog.check() is None
    clock.t += 1.0
    assert dog.check() is not None


def test_stall_s_zero_never_stalls() -> None:
    clock = Clock()
    dog = Watchdog(stall_s=0.0, stall_steps=10.0, clock=clock)
    clock.t += 1e6
    assert dog.check() is None
    with pytest.raises(ValueError, match="stall_s"):
        Watchdog(stall_s=-1.0, stall_steps=10.0)


def test_stalled_is_found_in_groups_and_causes_and_survives_pickling() -> None:
    s = Stalled("batch 2's rollout", 61.0, 60.0, {"reference[0]": "drop_shard"}, "dock: 8")
    back = pickle.loads(pickle.dumps(s))
    assert (back.stage, back.healing, back.detail) == (s.stage, s.healing, s.detail)
    try:
        try:
            raise ExceptionGroup("tg", [ValueError("x"), s])
        except ExceptionGroup as eg:
            raise RuntimeError("healing failed") from eg
    except RuntimeError as outer:
        assert stalled_in(outer) is s
    assert stalled_in(ValueError("x")) is None


async def test_watch_raises_with_the_diagnosis() -> None:
    clock = Clock()

    async def diagnose() -> str:
        return "the dock holds 8 samples"

    dog = Watchdog(stall_s=60.0, stall_steps=10.0, clock=clock, diagnose=diagnose)
    with pytest.raises(ExceptionGroup) as info:
        async with asyncio.timeout(5.0), asyncio.TaskGroup() as tg:
            watch = tg.create_task(dog.watch(every_s=0.001))
            await asyncio.sleep(0.01)
            assert not watch.done()  # 0 s idle
            clock.t += 61.0
    stall = stalled_in(info.value)
    assert stall is not None and stall.detail == "the dock holds 8 samples"


class StuckTraining:
    """A trainer whose second step never gets its lease (a dock that never fills)."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.trained = clock, 0

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: object = None) -> dict[str, float]:
        self.clock.t += 1.0
        while batch == 1:  # time passes, nothing comes (the producers stop at the gate)
            await asyncio.sleep(0.01)
            self.clock.t += 10.0
        self.trained += 1
        return {"loss": 1.0}

    async def discard(self, groups: object, reason: str) -> int:
        return 0

    async def publish(self, version: int) -> None:
        pass


async def test_a_stuck_schedule_ends_with_the_stage_it_waits_in() -> None:
    clock = Clock()
    dog = Watchdog(stall_s=60.0, stall_steps=10.0, clock=clock)
    prod, train = SimProduction(), StuckTraining(clock)
    sched = Schedule(schedule_config(steps=4), production=prod, training=train,
                     evaluation=FakeEval({}), checkpoints=FakeCheckpoints(),
                     state=LoopState(), watchdog=dog)
    with pytest.raises(BaseExceptionGroup) as info:  # the task group raises a group
        await asyncio.wait_for(sched.run(), 10.0)
    stall = stalled_in(info.value)
    assert stall is not None, info.value
    assert train.trained == 1
    assert stall.stage.startswith("step 2's training")
