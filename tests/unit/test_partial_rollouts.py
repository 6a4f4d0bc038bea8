"""Partial rollouts in `earl.loop.schedule`, with fakes and no processes: a step trains the
groups done first whatever batch started them, a slow group is carried into a later step (not
cut, not waited on), a group with no token inside the staleness bound is dropped whole and
counted, one whose late turns are inside it trains (its early tokens out of the loss), groups
whose episodes all scored alike are skipped with `algorithm.filter_groups`, and every group
started is trained once or dropped with a reason."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest

from earl.config import RunConfig
from earl.loop.pool import GroupPool
from earl.loop.schedule import (
    NO_SIGNAL,
    RUN_ENDED,
    STALE,
    LoopState,
    Schedule,
    StepRecord,
)
from earl.stages.batch_types import BatchResult, Episode, GroupTask

pytestmark = pytest.mark.timeout(60)

G = 4  # episodes per group; 2 groups per step


def config(**kw: object) -> RunConfig:
    return RunConfig(time_limit_minutes=1e9, eval_every=0, batch_size=2 * G, group_size=G,
                     checkpoint_every=1000, partial_rollouts="continue",
                     **kw)  # type: ignore[arg-type]


class GroupProduction:
    """Each group sleeps for its planned seconds (a tool that waits), its tokens sampled at the
    version current when it started; with `last_turn`, also at the version current when it
    finished (a turn after the wait: the episode spans the updates in between)."""

    def __init__(self, seconds: Callable[[int, int], float], last_turn: bool = False,
                 rewards: Callable[[int], list[float]] = lambda n: [1.0] * G) -> None:
        self.seconds, self.version, self.last_turn = seconds, 0, last_turn
        self.rewards = rewards  # group number -> its episodes' rewards
        self.started: dict[str, int] = {}  # group id -> version at its start
        self.dock: dict[str, int] = {}     # group id -> rows

    async def play(self, batch: int, snapshot: bool) -> BatchResult:
        raise AssertionError("partial rollouts play group by group")

    async def play_groups(self, batch: int, done: Callable[[BatchResult], None]
                          ) -> BatchResult:
        async def one(g: int) -> BatchResult:
            gid, v = f"g{batch * 2 + g}", self.version
            self.started[gid] = v
            await asyncio.sleep(self.seconds(batch, g))
            last = self.version if self.last_turn else v
            eps = [Episode(sample_id=f"{gid}-{i}", group_id=gid, reward=r, generated=3,
                           version_sum=2 * v + last, first_version=v, last_version=last,
                           info={"episode_s": 0.01})
                   for i, r in enumerate(self.rewards(batch * 2 + g))]
            res = BatchResult(batch=batch, episodes=eps, samples=G, seconds=0.01,
                              row_groups=[gid] * G)
            self.dock[gid] = G
            done(res)
            return res

        parts = await asyncio.gather(one(0), one(1))
        return BatchResult(batch=batch, episodes=[e for p in parts for e in p.episodes],
                           samples=2 * G, seconds=0.0)

    async def note_version(self, version: int) -> None:
        self.version = version


class GroupTraining:
    def __init__(self, prod: GroupProduction, train_s: float = 0.005) -> None:
        self.prod, self.train_s = prod, train_s
        self.steps: list[list[str]] = []
        self.dropped: list[str] = []  # stale
        self.left: list[str] = []  # not a whole step's worth when the run ended
        self.alike: list[str] = []  # skipped by algorithm.filter_groups

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: Sequence[str] | None = None) -> dict[str, float]:
        assert groups is not None and samples == sum(self.prod.dock[g] for g in groups)
        for g in groups:
            del self.prod.dock[g]  # a group trained twice would fail here
        self.steps.append(list(groups))
        await asyncio.sleep(self.train_s)  # a step takes time
        return {}

    async def discard(self, groups: Sequence[str], reason: str) -> int:
        for g in groups:
            del self.prod.dock[g]
        if reason == STALE:
            self.dropped += groups
        elif reason == NO_SIGNAL:
            self.alike += groups
        else:
            assert reason == RUN_ENDED
            self.left += groups
        return len(groups) * G

    async def publish(self, version: int) -> None:
        pass


class NoCheckpoints:
    async def save(self, state: LoopState, critic_batch: int | None) -> None:
        assert critic_batch is None  # the critic saw groups as they finished: its live state


async def run(cfg: RunConfig, seconds: Callable[[int, int], float], last_turn: bool = False,
              rewards: Callable[[int], list[float]] | None = None, train_s: float = 0.005
              ) -> tuple[GroupProduction, GroupTraining, list[StepRecord]]:
    prod = GroupProduction(seconds, last_turn, *([rewards] if rewards else []))
    train, records = GroupTraining(prod, train_s), []

    async def observe(r: StepRecord) -> None:
        records.append(r)

    sched = Schedule(cfg, production=prod, training=train, evaluation=None,
                     checkpoints=NoCheckpoints(), state=LoopState(), observe=observe)
    assert await sched.run() == "steps"
    return prod, train, records


async def test_a_slow_group_is_carried_over_not_waited_on() -> None:
    # group 0 of batch 0 takes 0.2 s, every other group 0.01 s
    prod, train, records = await run(config(steps=60, max_policy_lag=100, max_concurrent_groups=4),
                                     lambda b, g: 0.2 if (b, g) == (0, 0) else 0.01)
    assert train.steps[0] != ["g0", "g1"]  # step 0 did not wait for batch 0's slow group
    assert any("g0" in s for s in train.steps[1:])  # carried into a later step
    trained = [g for s in train.steps for g in s]
    assert len(trained) == len(set(trained)) and not train.dropped
    # nothing lost, none twice: every started group trained or left over at the end
    assert set(trained) | set(train.left) == set(prod.started) and not prod.dock
    assert all(r.straggler_wait_s < 0.3 for r in records)


async def test_a_group_over_the_staleness_bound_is_dropped_whole_and_counted() -> None:
    prod, train, records = await run(config(steps=60, max_policy_lag=1),
                                     lambda b, g: 0.2 if (b, g) == (0, 0) else 0.01)
    assert train.dropped == ["g0"]  # started at version 0, done after step 1
    assert sum(r.stale_groups for r in records) == 1
    for step, groups in enumerate(train.steps):  # every trained group within the bound
        assert all(step - prod.started[g] <= 1 for g in groups)
    trained = [g for s in train.steps for g in s]
    assert set(trained) | set(train.dropped) | set(train.left) == set(prod.started)


async def test_a_group_whose_late_turns_are_inside_the_bound_trains() -> None:
    # the same slow group, but it samples a turn after its wait: its early tokens leave the
    # loss (the trainer's token floor), its late ones train, and nothing is dropped
    prod, train, records = await run(config(steps=60, max_policy_lag=1),
                                     lambda b, g: 0.2 if (b, g) == (0, 0) else 0.01,
                                     last_turn=True)
    assert not train.dropped and not sum(r.stale_groups for r in records)
    step = next(i for i, s in enumerate(train.steps) if "g0" in s)
    assert step - prod.started["g0"] > 1  # its first turn is over the bound: masked, not dropped


def test_tokens_before_the_floor_leave_the_loss_and_stay_in_the_context() -> None:
    import numpy as np

    from earl.stages.trainer_batch import TrainBatch, bound_staleness

    # prompt (-1), turn 1 by version 3, a tool reply (-1), turn 2 by version 9
    versions = np.array([-1, -1, 3, 3, -1, 9, 9, 9], np.int32)
    mask = np.array([0, 0, 1, 1, 0, 1, 1, 1], np.int8)
    s = {"input_ids": np.arange(8), "loss_mask": mask, "advantages": np.ones(8, np.float32),
         "versions": versions}
    rows, masked, oldest = bound_staleness([s, {**s, "versions": versions + 10}], floor=5)
    assert masked == 2 and oldest == 9
    b = TrainBatch.from_samples(rows)
    assert b.loss_mask.tolist() == [0, 0, 0, 0, 0, 1, 1, 1] + mask.tolist()
    assert b.input_ids.tolist() == list(range(8)) * 2  # the context is whole
    assert bound_staleness([s], floor=20)[1:] == (5, -1)  # nothing left to train
    with pytest.raises(ValueError, match="versions"):
        bound_staleness([{"input_ids": [1], "loss_mask": [1]}], floor=0)


def _mixed_every_third(n: int) -> list[float]:
    """Group n's rewards: mixed for every third group, else all alike (all 0)."""
    return [1.0, 0.0, 0.0, 1.0] if n % 3 == 0 else [0.0] * G


async def test_groups_that_scored_alike_are_skipped_while_others_wait() -> None:
    # the trainer is the slow side (0.05 s a step, a group 0.005 s): groups queue while it
    # trains, and a step skips the alike ones among them
    cfg = config(steps=20, max_policy_lag=100, max_concurrent_groups=12)
    cfg.algorithm.filter_groups = True
    prod, train, records = await run(cfg, lambda b, g: 0.005, rewards=_mixed_every_third,
                                     train_s=0.05)
    number = {f"g{n}": n for n in range(1000)}
    trained = [g for s in train.steps for g in s]
    assert len(train.steps) == 20 and train.alike and all(number[g] % 3 for g in train.alike)
    # a third of the groups played are mixed; most of those trained are
    assert sum(number[g] % 3 == 0 for g in trained) > 0.75 * len(trained)
    # every group started: trained once, skipped with its reason, or left at the run's end
    assert len(trained) == len(set(trained)) and not prod.dock
    assert set(trained) | set(train.alike) | set(train.left) == set(prod.started)
    assert sum(len({e.group_id for e in r.filtered}) for r in records) == len(train.alike)
    from earl.loop.step_log import step_row

    r = next(r for r in reversed(records) if r.filtered)
    row = step_row(r, steps=20)
    assert row["filtered_groups"] == len({e.group_id for e in r.filtered})
    assert row["reward_played"] < row["reward"]  # the skipped groups scored 0


async def test_a_skipped_group_frees_its_place_before_the_step_is_whole() -> None:
    # two steps' groups out at most (the least filter_groups allows): the mixed groups a step
    # needs can only start once the alike ones before them have left
    cfg = config(steps=6, max_policy_lag=100, max_concurrent_groups=4)
    cfg.algorithm.filter_groups = True
    _, train, _ = await asyncio.wait_for(
        run(cfg, lambda b, g: 0.01, rewards=_mixed_every_third), timeout=20)
    assert len(train.steps) == 6 and train.alike


async def test_a_policy_that_always_scores_alike_still_makes_steps() -> None:
    cfg = config(steps=10, max_policy_lag=100, max_concurrent_groups=12)
    cfg.algorithm.filter_groups = True
    _, train, _ = await asyncio.wait_for(
        run(cfg, lambda b, g: 0.01, rewards=lambda n: [0.0] * G), timeout=20)
    assert len(train.steps) == 10  # with nothing else waiting an alike group trains


async def test_skipping_never_makes_a_step_wait() -> None:
    # the rollout is the slow side (a group 0.03 s, a step 0.005 s): a step that finds no
    # other group waiting trains an alike one rather than wait for a mixed one
    cfg = config(steps=8, max_policy_lag=100, max_concurrent_groups=4)
    cfg.algorithm.filter_groups = True
    _, train, _ = await run(cfg, lambda b, g: 0.03, rewards=_mixed_every_third)
    trained = [int(g[1:]) for s in train.steps for g in s]
    assert len(train.steps) == 8 and any(n % 3 for n in trained)


def test_filter_groups_needs_grpo_and_partial_rollouts() -> None:
    from earl.config import AlgorithmConfig

    with pytest.raises(ValueError, match="filter_groups"):
        AlgorithmConfig(name="ppo", filter_groups=True)
    with pytest.raises(ValueError, match="filter_groups"):
        RunConfig(partial_rollouts="off", algorithm=AlgorithmConfig(filter_groups=True))
    with pytest.raises(ValueError, match="max_concurrent_groups"):  # one step's groups out
        RunConfig(max_policy_lag=0, algorithm=AlgorithmConfig(filter_groups=True))
    with pytest.raises(ValueError, match="max_concurrent_groups"):
        config(max_concurrent_groups=3, algorithm=AlgorithmConfig(filter_groups=True))
    assert config(max_policy_lag=1, algorithm=AlgorithmConfig(filter_groups=True))


def _done(pool: GroupPool, gid: str, first_version: int) -> None:
    pool.add(BatchResult(batch=0, samples=1, seconds=0.0, episodes=[
        Episode(sample_id=f"{gid}-0", group_id=gid, reward=0.0, first_version=first_version)]))


async def test_pool_takes_the_oldest_group_first_then_the_first_done() -> None:
    pool = GroupPool()
    waiter = asyncio.ensure_future(pool.wait_take())
    await asyncio.sleep(0)
    assert not waiter.done()
    _done(pool, "g5", 3)
    assert (await waiter).group_id == "g5"  # a waiting trainer takes what comes
    for gid, version in (("g6", 4), ("g2", 3), ("g9", 4), ("g0", -1), ("g1", 3)):
        _done(pool, gid, version)
    order = [(await pool.wait_take()).group_id for _ in range(5)]
    # no token (nothing to go stale) first, then the oldest, ties in the order they finished
    assert order == ["g0", "g2", "g1", "g6", "g9"]


async def test_a_long_group_queued_behind_fresh_ones_is_trained_not_dropped() -> None:
    # group 0 of batch 0 takes 0.1 s (~20 versions at ~0.005 s a step) while 40 short groups
    # finish and queue: first-done-first it would go stale in the queue at lag 30
    _, train, _ = await run(
        config(steps=60, max_policy_lag=30, max_concurrent_groups=40),
        lambda b, g: 0.1 if (b, g) == (0, 0) else 0.001)
    assert not train.dropped
    assert any("g0" in s for s in train.steps)


def test_partial_rollouts_default_and_conflicts() -> None:
    from earl.config import load_config

    assert RunConfig().partial_rollouts == "continue"
    assert load_config(None, ["--partial_rollouts=off"]).partial_rollouts == "off"
    assert RunConfig(over_sample_groups=2).partial_rollouts == "off"
    with pytest.raises(ValueError, match="partial_rollouts"):
        RunConfig(partial_rollouts="interrupt")
    with pytest.raises(ValueError, match="over_sample_groups"):
        RunConfig(partial_rollouts="continue", over_sample_groups=2)


_ = GroupTask  # the type the producer gets per group (see ActorProduction.play_groups)


def test_a_dead_holders_lease_goes_back_and_named_groups_are_taken_whole() -> None:
    from earl.runtime.dock_index import DockIndex, SampleInfo, WouldBlock

    ix = DockIndex(stages=["reference", "train"], capacity=16)
    for gid in ("g1", "g2"):
        for i in range(2):
            ix.register(SampleInfo(sample_id=f"{gid}-{i}", group_id=gid, group_size=2, length=4,
                                   version=0, shard="producer:0",
                                   columns={"input_ids": 16, "versions": 16}))
    held = ix.take("reference", ["input_ids"], 4, whole_groups=False, holder="reference:0")
    with pytest.raises(WouldBlock):  # g2 is leased by the reference
        ix.take("reference", ["input_ids"], 2, group_ids=["g2"])
    ix.drop_shard("reference:0")  # the reference died holding the lease: it goes back
    again = ix.take("reference", ["input_ids"], 1, group_ids=["g2"])
    assert sorted(loc.sample_id for loc in again.samples) == ["g2-0", "g2-1"]
    assert held.lease_id != again.lease_id
