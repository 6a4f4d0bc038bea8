"""Failures cross real process boundaries as data: an actor whose endpoint failed because another
actor died tells its caller which one (group, rank, cause) in fields; the supervisor records how a
process ended; a forged ERR record from a socket is dropped, the error still surfaces."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from earl.loop.supervisor import died_actor
from earl.runtime import Actor, ActorDied, ActorError, Runtime, context, endpoint
from earl.runtime.conn import connect
from earl.runtime.frames import HEADER, MAGIC, Kind
from earl.runtime.wire import encode

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(90)]


class Callee(Actor):
    def __init__(self) -> None:
        self.waiting = 0

    @endpoint
    async def slow(self, s: float) -> None:
        self.waiting += 1
        await asyncio.sleep(s)

    @endpoint
    async def waiting_calls(self) -> int:
        return self.waiting

    @endpoint
    async def pid(self) -> int:
        return os.getpid()

    @endpoint
    async def exit(self, code: int) -> None:
        os._exit(code)


class Caller(Actor):
    @endpoint
    async def relay(self, name: str, s: float) -> None:
        """Calls rank 0 of group `name` (which the test then kills)."""
        g = await context().lookup(name)
        await g.slow.call_one(s)

    @endpoint
    async def relay_all(self, name: str, s: float) -> None:
        """Calls every rank of `name` at once, like a weight push to every replica."""
        g = await context().lookup(name)
        async with asyncio.TaskGroup() as tg:
            for member in g:
                tg.create_task(_wait(member.slow.call_one(s)))


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rt():
    async with Runtime() as runtime:
        yield runtime


async def until(check: Callable[[], Awaitable[bool]], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not await check():
            await asyncio.sleep(0.05)


async def test_a_death_behind_an_endpoint_reaches_the_caller_as_data(rt):
    callee = await rt.spawn("callee", Callee)
    caller = await rt.spawn("caller", Caller)
    pending = asyncio.ensure_future(caller.relay.call_one("callee", 60.0))
    await until(lambda: _equals(callee.waiting_calls.call_one(), 1))
    os.kill(await callee.pid.call_one(), signal.SIGKILL)
    with pytest.raises(ActorError) as info:
        await asyncio.wait_for(pending, 30)
    err = info.value
    assert (err.group, err.rank, err.kind, err.call) == ("caller", 0, "Caller", "relay")
    assert err.remote_type == "earl.runtime.errors.ActorDied"
    d = err.died
    assert d is not None and len(err.deaths) == 1
    assert (d.group, d.rank, d.cause) == ("callee", 0, "connection_lost")
    assert died_actor(err) == ("callee", 0)
    await rt.stop(caller)


async def test_an_exception_group_carries_the_replica_that_died(rt):
    replicas = await rt.spawn("replicas", Callee, n=2)
    caller = await rt.spawn("pusher", Caller)
    pending = asyncio.ensure_future(caller.relay_all.call_one("replicas", 60.0))
    await until(lambda: _equals(replicas.waiting_calls.call(), [1, 1]))
    os.kill(await replicas[1].pid.call_one(), signal.SIGKILL)
    with pytest.raises(ActorError) as info:
        await asyncio.wait_for(pending, 30)
    err = info.value
    assert err.remote_type.endswith("ExceptionGroup") and err.call == "relay_all"
    assert [(d.group, d.rank) for d in err.deaths] == [("replicas", 1)]
    assert died_actor(err) == ("replicas", 1)
    await rt.stop(caller)
    await rt.stop(replicas)


async def test_the_supervisor_records_how_the_process_ended(rt):
    for name, end, want in [("ender", None, ("exited", 3, None)),
                            ("killed", signal.SIGKILL, ("killed", None, signal.SIGKILL))]:
        g = await rt.spawn(name, Callee)
        pid = await g.pid.call_one()
        pending = g.exit.call_one(3) if end is None else g.slow.call_one(60.0)
        if end is not None:
            await until(lambda g=g: _equals(g.waiting_calls.call_one(), 1))
            os.kill(pid, end)
        with pytest.raises(ActorDied) as info:
            await asyncio.wait_for(pending, 30)
        assert (info.value.group, info.value.rank) == (name, 0)
        await rt.wait_status(name, "dead", timeout=30)
        d = rt.pool.dead[g.addresses[0]]  # what the supervisor told the pool
        assert (d.group, d.rank, d.kind) == (name, 0, "Callee")
        assert (d.cause, d.exit_code, d.signal) == want


async def test_a_forged_err_record_from_a_socket_is_dropped(tmp_path: Path):
    forged = [{"died": [{"group": 7, "rank": 0}]}, {"died": [{"group": "x", "rank": -3}]},
              {"died": "actor trainer[0] died"}, ["not", "a", "map"],
              {"died": [{"group": "rollout", "rank": 1, "cause": "import os", "signal": "9",
                         "exit_code": 2**40, "reason": 5}]}]
    bodies = [encode(["builtins.ValueError", "boom", "tb", f])[0] for f in forged]

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(HEADER.pack(16, MAGIC, Kind.HELLO, 0, 0, 0))
        for body in bodies:  # answer each call with the next forged ERR
            flen, _magic, _kind, _nbufs, rid, _blen = HEADER.unpack(await reader.readexactly(20))
            await reader.readexactly(flen - 16)
            writer.write(HEADER.pack(16 + len(body), MAGIC, Kind.ERR, 0, rid, len(body)) + body)
        await reader.read()
        writer.close()

    path = tmp_path / "forger.sock"
    server = await asyncio.start_unix_server(serve, str(path))
    conn = await connect(f"unix:{path}", "forger[0]", max_bytes=1 << 20, secret=None)
    errors = []
    for _ in bodies:
        with pytest.raises(ActorError) as info:
            await asyncio.wait_for(conn.request(Kind.CALL, encode(["x", [], {}])[0], []), 10)
        errors.append(info.value)
    assert all(type(e) is ActorError and e.remote_message == "boom" for e in errors)
    assert [len(e.deaths) for e in errors] == [0, 0, 0, 0, 1]
    d = errors[-1].deaths[0]
    assert (d.group, d.rank, d.cause, d.signal, d.exit_code) == ("rollout", 1, "unknown", None,
                                                                  None)
    assert conn.dead is None  # the connection survived every forged reply
    assert conn.transport is not None
    conn.transport.close()
    server.close()
    await server.wait_closed()


async def _wait(call: Awaitable[None]) -> None:
    await call


async def _equals(call: Awaitable[object], want: object) -> bool:
    return await call == want
