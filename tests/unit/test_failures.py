"""Failures as data: healing reads who died from fields, so rewording any message changes nothing.

Each failure shape (a local death, a remote error carrying one, a remote exception group, a dock
fetch that lost a warehouse shard, causes and contexts, two actors away) is built many times with
random and hostile message text (text that reads like another actor's death included); ERR
replies go through the real server encoder and the real client callback. Forged or garbled ERR
records are dropped field by field, never raised.
"""

from __future__ import annotations

import asyncio
import pickle
import random
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from earl.loop.supervisor import died_actor
from earl.runtime.conn import Connection
from earl.runtime.dock import DockFetchError
from earl.runtime.errors import (
    CAUSES,
    MAX_DEATHS,
    ActorDied,
    ActorError,
    BadCall,
    Cause,
    CausedByDeath,
    deaths_in,
)
from earl.runtime.frames import Kind
from earl.runtime.server import _error_body
from earl.runtime.wire import encode

pytestmark = pytest.mark.timeout(60)

LOOKALIKES = ["actor evil[7] died", "warehouse evil:7 failed", "actor trainer[0] died: gone",
              "actor producer[3] died", "evil[7]", "warehouse dock:0 failed during fetch", "died",
              "", "\x00\xff", "[", "]", "rollout[", "[0]", "actor  died", "💥" * 50]


def garble(rng: random.Random) -> str:
    """A message: random text, text that names another actor's death, or both, or nothing."""
    parts = [rng.choice(LOOKALIKES) if rng.random() < 0.6 else
             "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(0, 40)))
             for _ in range(rng.randrange(0, 4))]
    return " ".join(parts)


def who(rng: random.Random) -> tuple[str, int]:
    return rng.choice(["rollout", "producer", "reference", "trainer", "dock"]), rng.randrange(8)


def died(rng: random.Random, group: str, rank: int) -> ActorDied:
    cause: Cause = rng.choice(["exited", "killed", "oom", "connection_lost", "failed",
                               "shutdown", "unknown"])
    return ActorDied(f"{group}[{rank}]", garble(rng), cause=cause,
                     signal=9 if cause in ("killed", "oom") else None,
                     exit_code=rng.randrange(256) if cause == "exited" else None)


def raised(exc: BaseException, cause: BaseException | None = None) -> BaseException:
    """`exc` as it is when caught: raised (from `cause`, if given), with a traceback."""
    try:
        raise exc from cause
    except BaseException as e:  # noqa: BLE001
        return e


async def over_the_wire(exc: BaseException, actor: str = "producer[0]",
                        call: str = "play") -> ActorError:
    """What the caller gets when `actor`'s endpoint `call` raised `exc`: the server's ERR body,
    through the client connection's receive callback."""
    conn = Connection(actor, max_bytes=1 << 22, secret=None)
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    conn.pending[1] = fut
    conn.frame_received(Kind.ERR, 1, memoryview(_error_body(exc, "Producer", call)), [])
    err = fut.exception()
    assert isinstance(err, ActorError) and not isinstance(err, BadCall)
    assert (err.kind, err.call) == ("Producer", call)
    return err


Shape = Callable[[random.Random], Any]


async def local_death(rng: random.Random) -> tuple[BaseException, tuple[str, int]]:
    g, r = who(rng)
    return raised(died(rng, g, r)), (g, r)


async def remote_death(rng: random.Random) -> tuple[BaseException, tuple[str, int]]:
    g, r = who(rng)  # e.g. the producer's call to the rollout raised ActorDied
    return await over_the_wire(raised(died(rng, g, r))), (g, r)


async def remote_group(rng: random.Random) -> tuple[BaseException, tuple[str, int]]:
    g, r = who(rng)  # e.g. a weight push where one replica died
    members = [raised(ValueError(garble(rng))), raised(died(rng, g, r)),
               raised(KeyError(garble(rng)))]
    rng.shuffle(members)
    exc = raised(ExceptionGroup(garble(rng), members))  # type: ignore[type-var]
    return await over_the_wire(exc, "trainer[0]", "publish"), (g, r)


async def dock_fetch(rng: random.Random) -> tuple[BaseException, tuple[str, int]]:
    g, r = who(rng)  # the warehouse on g[r] died, raised, or was not found mid-fetch
    cause = rng.choice([died(rng, g, r), KeyError(garble(rng)),
                        ActorError(f"{g}[{r}]", garble(rng), garble(rng), garble(rng)),
                        ActorError(f"{g}[{r}]", "x.ActorDied", garble(rng),
                                   deaths=(died(rng, "evil", 7),))])
    exc = raised(DockFetchError.of(f"{g}:{r}", rng.randrange(99), cause), cause)
    if rng.random() < 0.5:  # raised in the trainer's endpoint, read at the driver
        exc = await over_the_wire(exc, "trainer[0]", "train_step")
    return exc, (g, r)


async def nested(rng: random.Random) -> tuple[BaseException, tuple[str, int]]:
    inner, where = await rng.choice([local_death, remote_death, remote_group, dock_fetch])(rng)
    outer = RuntimeError(garble(rng))
    if rng.random() < 0.5:
        outer = raised(outer, inner)  # __cause__
    else:
        try:
            raise inner
        except BaseException:  # noqa: BLE001
            outer = raised(outer)  # __context__
    if rng.random() < 0.5:  # and once more across the wire: two actors away
        outer = await over_the_wire(outer, "producer[1]", "replay")
    return outer, where


async def no_death(rng: random.Random) -> tuple[BaseException, None]:
    text = garble(rng) + " actor evil[7] died warehouse evil:7 failed"
    exc = rng.choice([ValueError(text), ActorError("evil[7]", "earl.runtime.errors.ActorDied",
                                                   text, text),
                      ExceptionGroup(text, [KeyError(text), RuntimeError(text)]),
                      ActorDied("rollout", text, cause="unavailable"),  # no rank: no one
                      ActorDied(f"evil[{text}]", text),
                      ActorDied("producer[2]", text, cause="stopped")])
    if rng.random() < 0.5:
        exc = await over_the_wire(raised(exc))
    return exc, None


def reword(exc: BaseException, rng: random.Random) -> None:
    """Rewrite every text of `exc` and of everything behind it: messages, reasons, remote types
    and tracebacks, even the "name[rank]" labels meant for people."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        e.args = (garble(rng),)
        if isinstance(e, ActorDied):
            e.actor, e.reason = garble(rng), garble(rng)
        if isinstance(e, ActorError):
            e.actor, e.remote_type = garble(rng), rng.choice(["builtins.ValueError", garble(rng)])
            e.remote_message, e.remote_traceback = garble(rng), garble(rng)
            todo += e.deaths
        if isinstance(e, CausedByDeath):
            todo.append(e.died)
        if isinstance(e, BaseExceptionGroup):
            todo += e.exceptions
        todo += [n for n in (e.__cause__, e.__context__) if n is not None]


@pytest.mark.parametrize("shape", [local_death, remote_death, remote_group, dock_fetch, nested,
                                   no_death])
async def test_healing_reads_fields_whatever_the_messages_say(shape: Shape) -> None:
    rng = random.Random(f"{shape.__name__}-2024")
    for _ in range(150):
        exc, expected = await shape(rng)
        assert died_actor(exc) == expected, exc
        reword(exc, rng)
        assert died_actor(exc) == expected, exc


async def test_a_death_keeps_its_fields_across_the_wire() -> None:
    oom = ActorDied("rollout[3]", "out of memory in slot gpu0", kind="RolloutActor", cause="oom",
                    signal=9, call="generate")
    err = await over_the_wire(raised(RuntimeError("push failed"), oom), "trainer[0]", "publish")
    assert (err.group, err.rank, err.kind, err.call) == ("trainer", 0, "Producer", "publish")
    d = err.died
    assert d is not None and d is not oom
    assert (d.group, d.rank, d.kind, d.cause, d.signal, d.exit_code, d.call, d.reason) == (
        "rollout", 3, "RolloutActor", "oom", 9, None, "generate", "out of memory in slot gpu0")
    # every death of a group travels, nearest first, at most MAX_DEATHS
    many = ExceptionGroup("push", [ActorDied(f"rollout[{i}]", "x") for i in range(40)])
    err = await over_the_wire(raised(many))
    assert [d.rank for d in err.deaths] == list(range(MAX_DEATHS))
    assert [d.rank for d in deaths_in(many)] == list(range(40))


def test_dock_fetch_error_names_the_shard_and_its_death() -> None:
    dead = ActorDied("reference[1]", "gone", cause="killed", signal=9)
    e = DockFetchError.of("reference:1", 4, dead)
    assert (e.shard, e.lease_id, e.died) == ("reference:1", 4, dead)
    assert "warehouse reference:1 failed during fetch (lease 4 released)" in str(e)
    e = DockFetchError.of("producer:2", 5, KeyError("no group"))
    assert (e.died.group, e.died.rank, e.died.cause, e.died.call) == ("producer", 2, "failed",
                                                                       "dock_send")


def test_failures_pickle_with_their_fields() -> None:
    d = ActorDied("rollout[1]", "r", kind="K", cause="exited", exit_code=3, call="c")
    e = ActorError("producer[0]", "T", "m", "tb", kind="P", call="play", deaths=(d,))
    f = DockFetchError.of("producer:2", 5, d)
    for x in (d, e, f):
        y = pickle.loads(pickle.dumps(x))
        assert type(y) is type(x) and str(y) == str(x)
    assert vars(pickle.loads(pickle.dumps(d))) == vars(d)
    e2 = pickle.loads(pickle.dumps(e))
    assert (e2.kind, e2.call, e2.deaths[0].exit_code) == ("P", "play", 3)
    assert (pickle.loads(pickle.dumps(f)).died.group, f.died.group) == ("producer", "producer")


GOOD = {"group": "rollout", "rank": 1, "kind": "R", "cause": "killed", "exit_code": None,
        "signal": 9, "call": "generate", "reason": "gone"}


async def received(body: bytes) -> ActorError:
    conn = Connection("producer[0]", max_bytes=1 << 22, secret=None)
    fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    conn.pending[1] = fut
    conn.frame_received(Kind.ERR, 1, memoryview(body), [])
    err = fut.exception()
    assert isinstance(err, ActorError)
    return err


@pytest.mark.parametrize("record, deaths", [
    ("not a map", []), (None, []), ({"died": "rollout[1]"}, []), ({"died": {"0": GOOD}}, []),
    ({"died": [GOOD, 7, None, [GOOD]]}, [("rollout", 1, "killed")]),
    ({"died": [{**GOOD, "group": 5}]}, []), ({"died": [{**GOOD, "group": ""}]}, []),
    ({"died": [{**GOOD, "group": "x" * 5000}]}, []),
    ({"died": [{**GOOD, "rank": -1}]}, []), ({"died": [{**GOOD, "rank": True}]}, []),
    ({"died": [{**GOOD, "rank": "1"}]}, []), ({"died": [{**GOOD, "rank": 2**40}]}, []),
    ({"died": [{**GOOD, "rank": 1.0}]}, []),
    ({"died": [{**GOOD, "rank": None}]}, [("rollout", None, "killed")]),
    ({"died": [{**GOOD, "cause": "os.system('rm')"}]}, [("rollout", 1, "unknown")]),
    ({"died": [{**GOOD, "cause": ["killed"]}]}, [("rollout", 1, "unknown")]),
    ({"died": [{"group": "rollout", "rank": 1}]}, [("rollout", 1, "unknown")]),
    ({"died": [{**GOOD, "exit_code": "3", "signal": 10**6, "kind": 1, "call": b"x",
                "reason": {"a": 1}}]}, [("rollout", 1, "killed")]),
    ({"died": [GOOD] * 100}, [("rollout", 1, "killed")] * MAX_DEATHS),
])
async def test_a_forged_or_garbled_record_is_dropped_not_raised(record: object,
                                                                deaths: list[Any]) -> None:
    err = await received(encode(["builtins.ValueError", "boom", "tb", record])[0])
    assert type(err) is ActorError and err.remote_message == "boom"
    assert [(d.group, d.rank, d.cause) for d in err.deaths] == deaths
    for d in err.deaths:  # whatever was kept has the declared types
        assert d.kind in (None, "R") and d.call in (None, "generate")
        assert d.exit_code is None and d.signal in (None, 9) and isinstance(d.reason, str)


@pytest.mark.parametrize("body", [encode("just a string")[0], encode([1, 2, 3])[0],
                                  encode(["T", "m"])[0], encode({"a": 1})[0], b"\xc1",
                                  msgpack.packb([b"T", "m", "tb"])])
async def test_a_malformed_err_body_is_a_bad_call(body: bytes) -> None:
    assert isinstance(await received(body), BadCall)


def _junk(rng: random.Random, depth: int = 0) -> Any:
    leaves = [None, True, -1, 0, 1, 2**31, 2**63 - 1, -(2**63), 1.5, "", "rollout", "killed",
              "x" * 300, b"\x00", (1, "a")]
    if depth > 3 or rng.random() < 0.5:
        return rng.choice(leaves)
    if rng.random() < 0.5:
        return [_junk(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = list(GOOD) + ["died", "kind", "call", 1, ""]
    return {rng.choice(keys): _junk(rng, depth + 1) for _ in range(rng.randrange(6))}


async def test_random_records_never_crash_the_receiver() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        record = _junk(rng)
        if rng.random() < 0.5:
            record = {"died": [{**GOOD, rng.choice(list(GOOD)): _junk(rng)}, _junk(rng)],
                      "kind": _junk(rng), "call": _junk(rng)}
        err = await received(encode(["T", "m", "tb", record])[0])
        assert type(err) is ActorError
        assert err.kind is None or isinstance(err.kind, str)
        for d in err.deaths:
            assert isinstance(d.group, str) and d.cause in CAUSES
            assert d.rank is None or type(d.rank) is int and d.rank >= 0
