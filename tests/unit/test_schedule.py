"""earl.loop.schedule with SimEngine and fakes, no processes: the staleness bound holds, a batch
is trained only once its reference scores exist, stop rules fire, the resume cursor is exact,
and a consistent state is checkpointed."""

from __future__ import annotations

import asyncio
import random

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.tictactoe import sim_responder
from earl.config import AlgorithmConfig, RunConfig
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.loop.gate import StalenessGate
from earl.loop.schedule import LoopState, NothingToTrain, Schedule
from earl.models.tiny import build_tokenizer
from earl.runtime.dock_index import DockIndex, SampleInfo, WouldBlock
from earl.stages.advantages import Estimator
from earl.stages.batch_types import BatchResult, GroupTask, episode_of

pytestmark = pytest.mark.timeout(60)

GROUPS, G = 2, 4
CODEC = ChatCodec(build_tokenizer())

def schedule_config(*, time_limit_s: float = float("inf"), eval_every: int = 0,
                    partial_rollouts: str = "off", **kw: object) -> RunConfig:
    """The run settings the schedule reads (no evals, no time limit unless given; whole
    batches unless `partial_rollouts` says otherwise: `test_partial_rollouts.py`)."""
    return RunConfig(time_limit_minutes=time_limit_s / 60, eval_every=eval_every,
                     partial_rollouts=partial_rollouts, **kw)  # type: ignore[arg-type]



class SimProduction:
    """Plays real agent coroutines on a SimEngine and "puts" rows in a fake dock."""

    def __init__(self, version: int = 0, seed: int = 0) -> None:
        self.engine = SimEngine(SimConfig(time_scale=0.0, seed=seed),
                                responder=sim_responder(CODEC))
        self.engine.set_policy_version(version)
        self.estimator = Estimator(AlgorithmConfig(name="grpo"))
        self.dock: dict[str, int] = {}       # sample id -> batch
        self.scored: set[str] = set()
        self.started: dict[int, int] = {}    # batch -> policy version when it started
        self.tasks: dict[int, list[object]] = {}
        self.rng = random.Random(seed)

    def groups(self, b: int) -> list[GroupTask]:
        return [GroupTask(group_id=f"g{b * GROUPS + g}", samples=[b * GROUPS + g] * G)
                for g in range(GROUPS)]

    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        from earl.agents.rollout import RolloutConfig, run_agent
        from earl.recipes.tictactoe import agent

        self.started[batch] = self.engine.policy_version
        groups = self.groups(batch)
        self.tasks[batch] = [s for g in groups for s in g.samples]
        cfg = RolloutConfig(sampling=SamplingParams(max_tokens=4,
                                                    stop_token_ids=CODEC.stop_ids))
        trajs = await asyncio.gather(*(
            run_agent(agent, s, engine=self.engine, codec=CODEC, config=cfg,
                      sample_id=f"{g.group_id}-{i}", group_id=g.group_id)
            for g in groups for i, s in enumerate(g.samples)))
        rows, sources = self.estimator.columns(list(trajs))
        assert len(rows["input_ids"]) == len(trajs) and sources == list(range(len(trajs)))
        for t in trajs:
            self.dock[t.sample_id] = batch
        return BatchResult(batch=batch, episodes=[episode_of(t) for t in trajs],
                           samples=len(trajs), seconds=0.0,
                           row_groups=[t.group_id for t in trajs])

    async def note_version(self, version: int) -> None:
        self.engine.set_policy_version(version)

    async def reference(self) -> None:  # scores what is in the dock, a little later
        while True:
            for sid in list(self.dock):
                if sid not in self.scored:
                    await asyncio.sleep(self.rng.random() * 0.002)
                    self.scored.add(sid)
            await asyncio.sleep(0.001)


class FakeTraining:
    def __init__(self, prod: SimProduction) -> None:
        self.prod = prod
        self.trained: list[int] = []
        self.published: list[int] = []
        self.max_lag = 0

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: object = None) -> dict[str, float]:
        assert groups == [g.group_id for g in self.prod.groups(batch)]  # its batch's own
        mine = [sid for sid, b in self.prod.dock.items() if b == batch]
        assert len(mine) == samples
        while not all(s in self.prod.scored for s in mine):  # the dock's lease waits
            await asyncio.sleep(0.001)
        for sid in mine:
            del self.prod.dock[sid]
        self.max_lag = max(self.max_lag, len(self.published) - self.prod.started[batch])
        self.trained.append(batch)
        return {"loss": 1.0 / (batch + 1)}

    async def publish(self, version: int) -> None:
        self.published.append(version)


class FakeEval:
    def __init__(self, values: dict[int, float]) -> None:
        self.values, self.calls = values, []

    async def evaluate(self, split: str, version: int) -> dict[str, float]:
        self.calls.append((split, version))
        return {"reward": self.values.get(version, 0.0)}


class FakeCheckpoints:
    def __init__(self) -> None:
        self.saved: list[tuple[int, int | None]] = []

    async def save(self, state: LoopState, critic_batch: int | None) -> None:
        self.saved.append((state.step, critic_batch))


async def run_schedule(cfg: RunConfig, state: LoopState | None = None,
                       evals: dict[int, float] | None = None, clock=None):
    state = state or LoopState()
    prod = SimProduction(state.step)
    train, ev, ck = FakeTraining(prod), FakeEval(evals or {}), FakeCheckpoints()
    sched = Schedule(cfg, production=prod, training=train, evaluation=ev, checkpoints=ck,
                     state=state, clock=clock)
    ref = asyncio.create_task(prod.reference())
    try:
        stopped = await sched.run()
    finally:
        ref.cancel()
    return stopped, prod, train, ev, ck, state


@pytest.mark.parametrize("lag", [0, 1, 2])
async def test_staleness_bound_and_reference_before_training(lag: int) -> None:
    stopped, prod, train, _, _, state = await run_schedule(
        schedule_config(steps=8, max_policy_lag=lag, checkpoint_every=100))
    assert stopped == "steps" and state.step == 8 and train.trained == list(range(8))
    # batch b started under a policy at most `lag` versions older than the one training it
    assert all(b - v <= lag for b, v in prod.started.items())
    assert train.max_lag <= lag
    if lag == 0:
        assert all(prod.started[b] == b for b in range(8))  # synchronous: on-policy
    assert state.episodes == 8 * GROUPS * G and not prod.dock


async def test_target_stop_trains_batches_in_flight_and_checkpoints_consistently() -> None:
    stopped, prod, train, ev, ck, state = await run_schedule(
        schedule_config(steps=50, max_policy_lag=2, eval_every=2, checkpoint_every=3,
                       target=0.9), evals={2: 0.5, 4: 0.95})
    assert stopped == "target"
    assert ev.calls == [("validation", 2), ("validation", 4)]
    # batches already started when the target fired were trained too: nothing left behind
    assert train.trained == list(range(state.step)) and not prod.dock
    assert set(prod.started) == set(range(state.step))
    assert state.step <= 4 + 2 and state.best == (4, 0.95)
    # periodic checkpoints take the critic snapshot of the batch just trained; the final one
    # takes the live state, which has seen exactly the trained batches
    assert (3, 2) in ck.saved and ck.saved[-1] == (state.step, None)


async def test_time_limit_stop() -> None:
    t = [0.0]

    def clock() -> float:
        t[0] += 1.0
        return t[0]

    stopped, _, train, _, _, state = await run_schedule(
        schedule_config(steps=1000, max_policy_lag=0, time_limit_s=10), clock=clock)
    assert stopped == "time_limit" and 1 <= state.step < 20
    assert train.trained == list(range(state.step))


async def test_resume_cursor_is_exact() -> None:
    _, full, *_ = await run_schedule(schedule_config(steps=6, max_policy_lag=1,
                                                    checkpoint_every=100))
    _, first, *_ = await run_schedule(schedule_config(steps=3, max_policy_lag=1,
                                                     checkpoint_every=100))
    _, rest, train, _, _, state = await run_schedule(
        schedule_config(steps=6, max_policy_lag=1, checkpoint_every=100),
        state=LoopState(step=3, episodes=3 * GROUPS * G))
    assert train.trained == [3, 4, 5] and state.episodes == 6 * GROUPS * G
    assert {**first.tasks, **rest.tasks} == full.tasks  # the same tasks, none twice


async def test_gate() -> None:
    gate = StalenessGate(1, version=0)
    assert gate.may_start(1) and not gate.may_start(2)
    waiter = asyncio.create_task(gate.wait_may_start(2))
    await asyncio.sleep(0)
    assert not waiter.done()
    await gate.advance(1)
    assert await waiter is True
    with pytest.raises(ValueError, match="went back"):
        await gate.advance(0)
    late = asyncio.create_task(gate.wait_may_start(10))
    await gate.close()
    assert await late is False


def test_trainer_lease_waits_for_reference_column() -> None:
    ix = DockIndex(stages=["reference", "train"], capacity=8)
    ix.register(SampleInfo(sample_id="s0", group_id="g", group_size=1, length=4, version=0,
                           shard="p:0", columns={"input_ids": 32, "loss_mask": 4,
                                                 "advantages": 16}))
    cols = ["input_ids", "loss_mask", "advantages", "ref_logprobs"]
    with pytest.raises(WouldBlock):
        ix.take("train", cols, 1)
    ref = ix.take("reference", ["input_ids"], 1, whole_groups=False, at_least=1)
    ix.add_columns("s0", "reference:0", {"ref_logprobs": 16})
    ix.ack(ref.lease_id)
    assert [s.sample_id for s in ix.take("train", cols, 1).samples] == ["s0"]


async def test_a_step_trains_its_own_batch_when_a_later_batch_is_ready_first() -> None:
    """Seed 333 of `earl chaos --draw 3`: a producer's shard died with batches 3 and 4 in
    the dock; both were re-played, batch 4's came back first, and step 4 took the oldest ready
    groups (batch 4's), so the checkpoint of step 4 held batch 4 and not batch 3, and the
    rewind to it lost batch 3. Here batch 1's groups reach the dock after batch 2's."""
    dock = DockIndex(stages=["train"], capacity=64)
    late = asyncio.Event()

    class Replayed(SimProduction):
        async def play(self, batch: int, snapshot: bool) -> BatchResult:
            res = await super().play(batch, snapshot)
            if batch == 1:
                await late.wait()  # batch 1 comes back only once batch 2 is in the dock
            for j, gid in enumerate(res.row_groups):
                dock.register(SampleInfo(sample_id=f"b{batch}-{j}", group_id=gid, group_size=G,
                                         length=1, version=batch, shard="p0",
                                         columns={"input_ids": 1}))
            if batch == 2:
                late.set()
            return res

    class DockTraining(FakeTraining):
        def __init__(self, prod: SimProduction) -> None:
            super().__init__(prod)
            self.steps: list[list[int]] = []  # the batches of each step's samples

        async def train(self, batch: int, samples: int, lr_scale: float,
                        groups: object = None) -> dict[str, float]:
            while True:  # the dock's take, which waits for what it asks
                try:
                    lease = dock.take("train", ["input_ids"], samples,
                                      group_ids=groups)  # type: ignore[arg-type]
                    break
                except WouldBlock:
                    await asyncio.sleep(0.001)
            dock.ack(lease.lease_id)
            self.trained.append(batch)
            self.steps.append(sorted({int(loc.sample_id[1:].split("-")[0])
                                      for loc in lease.samples}))
            return {"loss": 1.0}

    prod = Replayed()
    train = DockTraining(prod)
    sched = Schedule(schedule_config(steps=4, max_policy_lag=2, checkpoint_every=100),
                     production=prod, training=train, evaluation=None,
                     checkpoints=FakeCheckpoints(), state=LoopState())
    assert await sched.run() == "steps"
    assert train.steps == [[0], [1], [2], [3]]


async def test_a_batch_with_nothing_to_train_is_a_clear_error() -> None:
    from earl.runtime.types import Trajectory

    class Cut(SimProduction):
        async def play(self, batch: int, snapshot: bool) -> BatchResult:
            t = Trajectory(sample_id="s", group_id="g", reward=0.0, truncated=True,
                           info={"cut": "context_window", "cut_need_tokens": 751})
            return BatchResult(batch=batch, episodes=[episode_of(t)], samples=0, seconds=0.0)

    prod = Cut()
    sched = Schedule(schedule_config(steps=2), production=prod, training=FakeTraining(prod),
                     evaluation=None, checkpoints=FakeCheckpoints(), state=LoopState())
    with pytest.raises(ExceptionGroup) as info:
        await sched.run()
    err = info.value.exceptions[0]
    assert isinstance(err, NothingToTrain) and err.need_tokens == 751
    for words in ("--model.max_model_len", "at least 751", "context_window", "--max_tokens"):
        assert words in str(err), (words, str(err))
    assert "resume" not in str(err)


async def test_a_trained_batch_is_let_go() -> None:
    """A long run's driver holds no batch it trained: each batch's episodes are freed once its
    step is done (the driver's memory grew by every batch's episodes until the run ended)."""
    import dataclasses
    import gc
    import weakref

    from earl.stages.batch_types import Episode

    class Ep(Episode):  # an Episode that can be watched for its release
        pass

    refs: dict[int, weakref.ref[Ep]] = {}

    class Watched(SimProduction):
        async def play(self, batch: int, snapshot: bool) -> BatchResult:
            res = await super().play(batch, snapshot)
            eps = [Ep(**{f.name: getattr(e, f.name) for f in dataclasses.fields(e)})
                   for e in res.episodes]
            refs[batch] = weakref.ref(eps[0])
            return dataclasses.replace(res, episodes=eps)

    held: list[int] = []

    class Checking(FakeTraining):
        async def train(self, batch: int, samples: int, lr_scale: float,
                        groups: object = None) -> dict[str, float]:
            gc.collect()
            held.extend(b for b, r in refs.items() if b < batch - 1 and r() is not None)
            return await super().train(batch, samples, lr_scale, groups)

    prod = Watched(0)
    train = Checking(prod)
    sched = Schedule(schedule_config(steps=10, max_policy_lag=1, checkpoint_every=100),
                     production=prod, training=train, evaluation=FakeEval({}),
                     checkpoints=FakeCheckpoints(), state=LoopState())
    ref = asyncio.create_task(prod.reference())
    try:
        assert await sched.run() == "steps"
    finally:
        ref.cancel()
    assert len(refs) == 10 and not held, f"batches still held at a later step: {held}"
