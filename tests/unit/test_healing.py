"""The supervisor and healing without processes: which actor a failure names, the sample
ledger, restart limits, the producer-side engine guard, failed checkpoints, re-played shares
and lost groups."""

from __future__ import annotations

import asyncio
import errno
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from earl.commands.chaos_oracle import judge, read_ledger
from earl.loop.checkpoint import CheckpointStore
from earl.loop.ledger import Ledger
from earl.loop.production import ActorProduction
from earl.loop.schedule import LoopState
from earl.loop.supervisor import HealingConfig, HealingError, Supervisor, died_actor
from earl.runtime.dock import DockFetchError
from earl.runtime.dock_index import Location, LostSample
from earl.runtime.errors import ActorDied, ActorError
from earl.stages.batch_types import BatchResult
from earl.stages.healing_engine import HealingEngine

pytestmark = pytest.mark.timeout(30)


def test_died_actor_finds_the_dead_actor_through_groups_and_remote_errors() -> None:
    assert died_actor(ActorDied("producer[1]", "pid 3 killed by SIGKILL")) == ("producer", 1)
    rollout = ActorDied("rollout[0]", "connection lost", cause="connection_lost")
    remote = ActorError("producer[0]", "earl.runtime.errors.ActorDied", str(rollout),
                        deaths=(rollout,))
    assert died_actor(ExceptionGroup("x", [ValueError("a"), remote])) == ("rollout", 0)
    lost = ActorDied("reference[0]", "killed", cause="killed", signal=9)
    fetch = ActorError("trainer[0]", "earl.runtime.dock.DockFetchError", "boom",
                       deaths=(DockFetchError.of("reference:0", 3, lost).died,))
    assert died_actor(fetch) == ("reference", 0)
    assert died_actor(DockFetchError.of("producer:1", 3, KeyError("x"))) == ("producer", 1)
    try:
        try:
            raise ActorDied("dock[0]", "gone")
        except ActorDied as e:
            raise RuntimeError("wrapped") from e
    except RuntimeError as e:
        assert died_actor(e) == ("dock", 0)
    # text that reads like a death is no death; a death without a rank names no one to heal,
    # and a rank its owner stopped is not healed
    assert died_actor(ActorError("trainer[0]", "earl.runtime.errors.ActorDied",
                                 "actor x[0] died")) is None
    assert died_actor(ActorDied("rollout", "no replica", cause="unavailable")) is None
    assert died_actor(ActorDied("producer[0]", "stopped", cause="stopped")) is None
    assert died_actor(ValueError("nothing")) is None


def test_restart_policy_per_stage_and_limit_validation() -> None:
    from earl.loop.stages import STAGES

    c = Supervisor(max_restarts=2, log=lambda s: None)
    for stage in STAGES:  # each stage is adopted as it is spawned, with its own healing
        c.adopt(stage.name, stage.heals)
    assert c.policy("rollout").max_restarts == 2 and c.policy("producer").max_restarts == 2
    assert c.policy("trainer").max_restarts == 0  # rewound, not restarted in place
    assert c.policy("dock").max_restarts == 0
    assert c.stages == ("trainer", "dock", "reference", "rollout", "producer")
    assert c.policy("unknown").max_restarts == 0  # never adopted: not restarted
    with pytest.raises(ValueError, match="heals"):
        c.adopt("x", "sometimes")
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(max_restarts=-1, log=lambda s: None)


def _loc(sid: str, gid: str) -> Location:
    return Location(sample_id=sid, group_id=gid, length=4, version=0, columns={})


def test_ledger_judges_by_the_trainers_records_not_the_acks(tmp_path: Path) -> None:
    led = Ledger(tmp_path / "ledger.jsonl")
    led.add_produced(["b000000-0000", "b000000-0001", "b000001-0000"], ["g0", "g0", "g1"])
    led.add_acked((_loc("b000000-0000", "g0"), _loc("b000000-0001", "g0")))
    # acked both, the trainer recorded one: the other is lost, whatever the ack said
    s = judge(led.path, ["b000000-0000"], resident=["b000001-0000"])
    assert s["samples_lost"] == 1 and s["lost_ids"] == ["b000000-0001"]
    assert s["samples_acked"] == 2 and s["samples_acked_untrained"] == 1
    trained = ["b000000-0000", "b000000-0001"]
    assert judge(led.path, trained)["samples_lost"] == 1  # b000001-0000: not in the dock now
    assert judge(led.path, trained, resident=["b000001-0000"])["samples_lost"] == 0
    led.add_dropped([LostSample("b000001-0000", "g1", ("input_ids",))], "shard died")
    assert judge(led.path, trained)["samples_lost"] == 0
    assert judge(led.path, trained)["samples_dropped"] == {"shard died": 1}
    # the same group trained from a second play is a duplicate, as is a sample trained twice
    led.add_produced(["b000001-x1-0000"], ["g1"])
    trained += ["b000001-x1-0000", "b000000-0000"]
    assert judge(led.path, trained)["samples_duplicated"] == 1
    trained += ["b000001-0000"]
    assert judge(led.path, trained)["samples_duplicated"] == 2
    led.rewind(1)  # the trainer went back to step 1: batch 1 is played and trained again
    assert judge(led.path, [])["samples_rewound"] == 2
    assert set(read_ledger(led.path).acked) == {"b000000-0000", "b000000-0001"}
    # what the driver holds meanwhile: nothing but the file's handle; a run not judged by
    # `earl chaos` keeps no ledger at all
    assert not any(hasattr(led, k) for k in ("produced", "acked", "dropped"))
    off = Ledger()
    off.add_produced(["b000000-0000"], ["g0"])
    with pytest.raises(ValueError, match="record_trained"):
        judge(off.path, [])


def test_the_oracle_reads_what_the_trainers_recorded(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from earl.commands.chaos_oracle import read_trained

    (tmp_path / "trained.0.jsonl").write_text(
        '{"step": 1, "rank": 0, "sample_ids": ["a", "b"]}\n{"step": 2, "ra')  # cut mid-write
    (tmp_path / "trained.2.jsonl").write_text('{"step": 1, "rank": 2, "sample_ids": ["c"]}\n')
    assert sorted(read_trained(tmp_path)) == ["a", "b", "c"]


def test_the_oracle_names_a_sample_trained_at_another_batchs_step(tmp_path: Path) -> None:
    from earl.commands.chaos_oracle import out_of_step, read_records
    from earl.stages.id_runs import pack

    ids = lambda b: [f"b{b:06d}-p0-{i:04d}" for i in range(3)]
    lines = [{"step": 1, "rank": 0, "sample_ids": pack(ids(0))},
             {"step": 2, "rank": 0, "sample_ids": pack(ids(1))}]
    (tmp_path / "trained.0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert out_of_step(read_records(tmp_path)) == []
    # step 3 trained batch 3's re-play, not batch 2 (seed 333's schedule before the fix)
    lines.append({"step": 3, "rank": 0, "sample_ids": pack([*ids(3)[:1], *ids(2)[1:]])})
    (tmp_path / "trained.0.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert out_of_step(read_records(tmp_path)) == ["b000003-p0-0000"]


def test_a_lost_sample_leaves_the_plan_and_only_once() -> None:
    from earl.commands.chaos_oracle import drop_one
    from earl.runtime.dispatch import DispatchPlan, ReplicaPlan
    from earl.runtime.layout import Layout

    r = ReplicaPlan(dp=0, leader=0, ranks=(0,), sample_ids=("a", "b", "c"),
                    micro_batches=(("a",), ("b", "c")), fetches=(), tokens=12)
    plan = DispatchPlan(step=1, issuers=(), layout=Layout(dp=1), columns=(), replicas=(r,))
    cut = drop_one(plan)
    assert cut is not None
    new, gone = cut
    assert gone == "c" and new.replicas[0].sample_ids == ("a", "b")
    assert new.replicas[0].micro_batches == (("a",), ("b",))
    assert drop_one(new) is None  # no micro-batch of two left


@dataclass
class _Gen:
    versions: list[int]


@dataclass
class _Client:
    """A rollout client whose replica dies once, then serves old weights once."""

    script: list[Any]
    policy_version: int = 3
    calls: int = 0

    async def generate(self, prompt_ids: list[int], params: Any, *,
                       session_id: str | None = None) -> _Gen:
        self.calls += 1
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def note_version(self, v: int) -> None:
        self.policy_version = max(self.policy_version, v)


async def test_engine_retries_a_dead_replica_and_refuses_older_weights() -> None:
    client = _Client([ActorDied("rollout[0]", "killed"), _Gen([0, 0]), _Gen([3, 3])])
    eng = HealingEngine(client, wait_s=10)
    gen = await eng.generate([1, 2], None, session_id="s")
    assert gen.versions == [3, 3] and client.calls == 3 and eng.retries == 2
    eng.note_version(5)  # delegated to the client
    assert client.policy_version == 5


async def test_engine_gives_up_after_wait_s() -> None:
    client = _Client([ActorDied("rollout[0]", "x")] * 100)
    with pytest.raises(ActorDied):
        await HealingEngine(client, wait_s=0.0).generate([1], None)


async def test_failed_checkpoint_is_skipped(tmp_path: Path) -> None:
    lines: list[str] = []
    sup = Supervisor(log=lines.append)
    sup.adopt("trainer", "rewind")
    sup.adopt("producer", "in_place")
    fail: list[BaseException] = [OSError(errno.ENOSPC, "No space left on device")]

    async def save_trainer(folder: str) -> None:
        raise fail[0]

    async def save_producers(folder: str, batch: int | None) -> None:
        return None

    store = CheckpointStore(tmp_path, save_trainer=save_trainer, save_producers=save_producers,
                            wall=lambda: 0.0, skip_failed=sup.checkpoint_failed)
    await store.save(LoopState(step=4), None)  # skipped: the run goes on
    assert "No space left" in lines[-1] and store.step_in_force() is None
    assert sup.events[-1]["event"] == "checkpoint_failed" and sup.events[-1]["step"] == 4
    fail[0] = ActorDied("producer[0]", "killed")  # an in-place stage's death: skipped too
    await store.save(LoopState(step=5), None)
    fail[0] = ActorDied("trainer[0]", "killed")  # a trainer death is not skipped: rewind
    with pytest.raises(ActorDied):
        await store.save(LoopState(step=6), None)
    fail[0] = ValueError("a bug")  # not a fault the run goes on after
    with pytest.raises(ValueError):
        await store.save(LoopState(step=7), None)


class _Handle:
    def __init__(self, owner: _Producers, rank: int) -> None:
        self.owner, self.rank = owner, rank
        self.play = _Ep(self, "play")
        self.replay = _Ep(self, "replay")
        self.note_version = _Ep(self, "note_version")


class _Ep:
    def __init__(self, h: _Handle, name: str) -> None:
        self.h, self.name = h, name

    async def call_one(self, *args: Any) -> Any:
        o = self.h.owner
        o.calls.append((self.name, self.h.rank, args))
        if o.die_next:
            o.die_next -= 1
            raise ActorDied(f"producer[{self.h.rank}]", "killed")
        if self.name == "note_version":
            return None
        # play(batch, share, snapshot, need); replay(batch, share, tag, snapshot[, need])
        groups = args[1]
        need = args[3] if self.name == "play" else (args[4] if len(args) > 4 else None)
        kept = groups if need is None else groups[:need]
        return BatchResult(batch=args[0], episodes=[], samples=sum(len(g.samples) for g in kept),
                           seconds=0, cut=[g.group_id for g in groups[len(kept):]],
                           row_groups=[g.group_id for g in kept for _ in g.samples])


class _Producers:
    def __init__(self, n: int) -> None:
        self.handles = [_Handle(self, r) for r in range(n)]
        self.calls: list[tuple[str, int, tuple[Any, ...]]] = []
        self.die_next = 0

    def __len__(self) -> int:
        return len(self.handles)

    def __getitem__(self, r: int) -> _Handle:
        return self.handles[r]


class _Tasks:
    def sample(self, k: int) -> int:
        return k


def _production(n: int, sup: Supervisor, lost: list[LostSample] | None = None,
                over_sample: int = 0) -> Any:
    """A real `ActorProduction` (dealing, cursors, merging, re-plays) over fake producers."""
    return ActorProduction(_Producers(n), _Tasks(), groups_per_batch=2,  # type: ignore[arg-type]
                           group_size=2, shared=True, over_sample=over_sample,
                           supervisor=sup, dock=_Dock(lost or []))  # type: ignore[arg-type]


def _supervisor(tmp_path: Path, **kw: Any) -> Supervisor:
    return Supervisor(log=lambda s: None, ledger=tmp_path / "ledger.jsonl", rt=_Rt(), **kw)


class _Dock:
    def __init__(self, lost: list[LostSample]) -> None:
        self.lost = lost

    async def take_lost(self) -> list[LostSample]:
        out, self.lost = self.lost, []
        return out


class _Rt:
    async def dir_call(self, method: str, name: str, *a: Any) -> Any:
        @dataclass
        class Rec:
            status: list[str]
            restarts: list[int]
            reasons: list[str]
        return Rec(["up", "up"], [1, 1], ["", ""])


async def test_a_producer_death_replays_its_share_with_fresh_ids(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    sup._rebuilt[("producer", 0)] = 1  # the restart is rebuilt
    prod = _production(1, sup)
    prod.producers.die_next = 1
    res = await asyncio.wait_for(prod.play(3, False), 5)
    assert res.samples == 4
    assert [c[0] for c in prod.producers.calls] == ["play", "replay"]
    tag = prod.producers.calls[1][2][2]
    assert sorted(read_ledger(sup.ledger.path).produced) == [f"b000003-p0-{tag}-{j:04d}" for j in range(4)]
    assert [e["event"] for e in sup.events] == ["replay_share"]


async def test_lost_groups_are_replayed_except_a_share_being_replayed(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    lost = [LostSample("b000001-p0-0000", "g2", ()), LostSample("b000001-p0-0001", "g2", ()),
            LostSample("b000002-p0-0000", "g4", ()), LostSample("b000002-p1-x3-0000", "g5", ()),
            LostSample("b000003-p0-x2-g0-0000", "g6", ())]
    prod = _production(2, sup, lost)
    prod.playing.add("b000002-p0")  # producer 0's share of batch 2 is re-played by `play`
    prod.playing.add("b000003-p0-x2-g0")  # and a group of batch 3 by `play_groups`
    # ...but g5, of producer 1's share of batch 2 (done), and g2 are played again
    assert await prod.reproduce_lost("shard producer:0 died") == 2
    replays = sorted((c[2][0], c[2][1][0].group_id) for c in prod.producers.calls
                     if c[0] == "replay")
    assert replays == [(1, "g2"), (2, "g5")]
    assert set(read_ledger(sup.ledger.path).dropped) == {x.sample_id for x in lost}


async def test_over_sampled_batches_keep_each_producers_share_and_record_only_it(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    prod = _production(2, sup, over_sample=2)  # 4 groups played, the first 2 to finish kept
    assert prod.deal(1) == [(0, prod.groups(1)[0::2], 1), (1, prod.groups(1)[1::2], 1)]
    assert [g.group_id for g in prod.groups(1)] == ["g4", "g5", "g6", "g7"]
    res = await asyncio.wait_for(prod.play(1, False), 5)
    assert res.samples == 4 and sorted(res.cut) == ["g6", "g7"]
    assert [c[2][3] for c in prod.producers.calls] == [1, 1]  # need, per producer
    assert sorted(read_ledger(sup.ledger.path).produced.values()) == ["g4", "g4", "g5", "g5"]
    # a lost group maps back to its batch through the stride of 4 groups per batch
    prod.dock.lost = [LostSample("b1", "g6", ())]
    assert await prod.reproduce_lost("shard died") == 1
    name, _, (batch, groups, *_) = prod.producers.calls[-1]
    assert (name, batch, [g.group_id for g in groups]) == ("replay", 1, ["g6"])
    assert len(prod.producers.calls[-1][2]) == 4  # no `need`: a lost group is played whole
    three = _production(3, sup)  # 2 groups, 3 producers: the third has nothing to keep
    assert three.deal(0) == [(0, three.groups(0)[:1], None), (1, three.groups(0)[1:], None)]


@dataclass
class Rec:
    status: list[str]
    restarts: list[int]
    reasons: list[str]


class DirRt:
    """A runtime whose directory always answers `rec` for a lookup."""

    def __init__(self, rec: Rec) -> None:
        self.rec = rec

    async def dir_call(self, method: str, name: str, *a: Any) -> Any:
        return self.rec


async def test_wait_rebuilt_names_a_dead_actor_and_the_limit() -> None:
    sup = Supervisor(max_restarts=2, log=lambda s: None,
                     rt=DirRt(Rec(["dead"], [2], ["pid 9 killed by SIGKILL"])))
    with pytest.raises(HealingError, match=r"producer\[0\].*restart limit 2"):
        await sup.wait_healed("producer", 0)


async def test_a_death_while_the_run_ends_is_not_waited_for() -> None:
    """After `close` (the run is over) nothing is rebuilt: waiting for it fails at once instead
    of for `wait_s`, and the reference's serve loop just ends."""
    up = DirRt(Rec(["up"], [0], [""]))  # the directory has not even seen the death yet
    sup = Supervisor(HealingConfig(wait_s=60.0), log=lambda s: None, rt=up)
    sup.adopt("reference", "in_place")
    sup.close()
    with pytest.raises(HealingError, match=r"reference\[0\] died while the run was ending"):
        await asyncio.wait_for(sup.wait_healed("reference", 0), 5)

    async def serve() -> object:
        raise ActorDied("reference[0]", "connection lost")

    sup._reopen()  # the death is seen first, then the run ends while waiting
    async with asyncio.TaskGroup() as tg:
        waiting = tg.create_task(sup.serve("reference", serve))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        sup.close()
        await asyncio.wait_for(waiting, 5)  # ends quietly


class LiveDir:
    """A directory of groups whose `wait_status` waits like the runtime's."""

    def __init__(self) -> None:
        self.groups: dict[str, Rec] = {}
        self.changed = asyncio.Event()

    def set(self, name: str, rec: Rec) -> None:
        self.groups[name] = rec
        self.changed.set()
        self.changed = asyncio.Event()

    async def dir_call(self, method: str, name: str, *a: Any) -> Any:
        if method == "lookup":
            return self.groups.get(name)
        rank, status, _timeout, min_restarts = a
        while True:
            rec = self.groups.get(name)
            if rec and rank < len(rec.status) and rec.status[rank] == status \
                    and rec.restarts[rank] >= min_restarts:
                return True
            await self.changed.wait()


async def test_a_group_a_move_recreated_is_watched_with_its_new_ranks() -> None:
    """A selector move re-creates the rollout with more replicas (restart counts from 0):
    a restart of an added replica, and one of a replica that had restarted before the move,
    are rebuilt; the group as the move built it is not."""
    rt, rebuilt = LiveDir(), []
    rt.set("rollout", Rec(["up"], [0], [""]))
    sup = Supervisor(max_restarts=3, log=lambda s: None, rt=rt)

    async def rebuild(name: str, rank: int) -> None:
        assert name == "rollout"
        rebuilt.append(rank)

    watching = asyncio.ensure_future(sup.watch({"rollout": 1}, rebuild))
    await asyncio.sleep(0.05)
    rt.set("rollout", Rec(["up"], [1], ["killed"]))  # a restart before the move
    await asyncio.sleep(0.05)
    assert rebuilt == [0]
    rt.set("rollout", Rec(["up", "up"], [0, 0], ["", ""]))  # the move: 2 new replicas
    sup.follow("rollout", 2)
    await asyncio.sleep(0.05)
    assert rebuilt == [0]  # what the move built needs no rebuild
    rt.set("rollout", Rec(["up", "up"], [1, 1], ["killed", "killed"]))
    await asyncio.wait_for(sup.wait_healed("rollout", 1), 5)
    await asyncio.wait_for(sup.wait_healed("rollout", 0), 5)
    assert sorted(rebuilt) == [0, 0, 1] and sup.restarts["rollout"] == 3
    sup.close()
    await asyncio.wait_for(watching, 5)
