"""The actor runtime end to end: real processes, real sockets (local launcher)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import psutil
import pytest
import pytest_asyncio

from earl.runtime import (
    Actor,
    ActorDied,
    ActorError,
    ActorGroup,
    RestartPolicy,
    Runtime,
    context,
    endpoint,
    wire,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")


@wire.message
@dataclass(kw_only=True, slots=True)
class Job:
    job_id: str
    weights: np.ndarray


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.n = start

    @endpoint
    async def incr(self, k: int) -> int:
        self.n += k
        return self.n

    @endpoint
    async def get(self) -> int:
        return self.n

    @endpoint
    async def whoami(self) -> tuple[str, int, int, int]:
        return (self.name, self.rank, self.world_size, os.getpid())

    @endpoint
    async def tokens(self, n: int):
        for i in range(n):
            self.produced = i + 1
            yield i

    @endpoint
    async def get_produced(self) -> int:
        return getattr(self, "produced", 0)

    @endpoint
    async def fail(self, msg: str) -> None:
        raise KeyError(msg)

    @endpoint
    async def slow(self, s: float) -> float:
        await asyncio.sleep(s)
        return s

    @endpoint
    async def scale(self, job: Job, t: torch.Tensor) -> tuple[Job, torch.Tensor]:  # noqa: F821
        return Job(job_id=job.job_id + "!", weights=job.weights * 2), t + 1


class Relay(Actor):
    """Uses the runtime from inside an actor: lookup, handles as arguments, nested spawn."""

    @endpoint
    async def via_lookup(self, name: str) -> int:
        g = await context().lookup(name)
        return await g[0].incr.call_one(100)

    @endpoint
    async def via_handle(self, g: ActorGroup) -> list[int]:
        return await g.get.call()

    @endpoint
    async def spawn_child(self) -> int:
        child = await context().spawn("grandchild", Counter, 41)
        return await child.incr.call_one(1)

    @endpoint
    async def child_pid(self) -> int:
        g = await context().lookup("grandchild")
        return (await g.whoami.call_one())[3]


class Holder(Actor):
    """Takes a registered message in its constructor (decoded only after this module loads)."""

    def __init__(self, job: Job) -> None:
        self.job = job

    @endpoint
    async def job_id(self) -> str:
        return self.job.job_id


class BadInit(Actor):
    def __init__(self) -> None:
        raise ValueError("model file missing")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rt():
    async with Runtime() as runtime:
        yield runtime


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def counters(rt):
    return await rt.spawn("counters", Counter, 5, n=2, env={"OMP_NUM_THREADS": "1"})


async def test_delivery_adverbs(counters):
    assert len(counters) == 2
    assert await counters[1].incr.call_one(0) == 5
    assert await counters.incr.call(1) == [6, 6]
    assert counters.incr.broadcast(10) is None
    assert await counters.get.call() == [16, 16]  # same connection: arrives after broadcast
    picked = await asyncio.gather(*[counters.incr.choose(1) for _ in range(10)])
    assert sum(await counters.get.call()) == 32 + 10 and len(picked) == 10
    assert [x async for x in counters[0].tokens.stream(4)] == [0, 1, 2, 3]
    names = await counters.whoami.call()
    assert [(n, r, w) for n, r, w, _ in names] == [("counters", 0, 2), ("counters", 1, 2)]
    assert names[0][3] != names[1][3] != os.getpid()


async def test_spawn_arguments_may_be_registered_messages(rt):
    g = await rt.spawn("holder", Holder, Job(job_id="j7", weights=np.ones(3)))
    try:
        assert await g.job_id.call_one() == "j7"
    finally:
        await rt.stop(g)


async def test_remote_exception_carries_traceback(counters):
    with pytest.raises(ActorError) as info:
        await counters[0].fail.call_one("missing-key")
    err = info.value
    assert err.remote_type == "builtins.KeyError" and "missing-key" in err.remote_message
    assert "in fail" in err.remote_traceback and "raise KeyError(msg)" in err.remote_traceback
    assert err.actor == "counters[0]"
    assert await counters[0].get.call_one() >= 0  # still serving


async def test_arrays_tensors_and_typed_messages_cross(counters):
    import torch  # not at module top: actor processes import this module and stay light

    job = Job(job_id="j", weights=np.arange(6, dtype=np.float32).reshape(2, 3))
    out_job, out_t = await counters[0].scale.call_one(job, torch.ones(3, dtype=torch.bfloat16))
    assert isinstance(out_job, Job) and out_job.job_id == "j!"
    np.testing.assert_array_equal(out_job.weights, job.weights * 2)
    assert out_t.dtype == torch.bfloat16 and torch.equal(out_t, torch.full((3,), 2.0,
                                                                           dtype=torch.bfloat16))


async def test_streams_have_backpressure_and_early_exit_cancels(counters):
    from earl.runtime.frames import STREAM_WINDOW

    async for x in counters[0].tokens.stream(10**9):
        if x == 3:
            # the generator never awaits, yet it may only run one window ahead of us
            for _ in range(20):
                await asyncio.sleep(0.01)
            assert 4 <= await counters[0].get_produced.call_one() <= STREAM_WINDOW + 1
            break
    assert [x async for x in counters[1].tokens.stream(3 * STREAM_WINDOW)] == list(
        range(3 * STREAM_WINDOW))
    assert await counters[0].get.call_one() >= 0


async def test_lookup_handles_as_arguments_and_nested_spawn(rt, counters):
    found = await rt.lookup("counters")
    assert found.endpoints == counters.endpoints and len(found) == 2
    relay = await rt.spawn("relay", Relay)
    before = await counters[0].get.call_one()
    assert await relay.via_lookup.call_one("counters") == before + 100
    assert await relay.via_handle.call_one(counters) == await counters.get.call()
    assert await relay.spawn_child.call_one() == 42
    grandchild = await relay.child_pid.call_one()
    relay_pid = (await rt.dir_call("lookup", "relay")).pids[0]
    gproc = psutil.Process(grandchild)
    assert gproc.ppid() == relay_pid  # a child of the relay actor
    await rt.stop(relay)
    _, alive = psutil.wait_procs([gproc], timeout=10)
    assert not alive
    with pytest.raises(KeyError, match="relay"):
        await rt.lookup("relay")


async def test_failed_init_reports_traceback_and_leaves_no_process(rt):
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ActorError, match="model file missing") as info:
        await rt.spawn("bad", BadInit, n=2)
    assert "raise ValueError" in info.value.remote_traceback
    await asyncio.sleep(0)  # let the reaper run
    after = {p.pid for p in psutil.Process().children(recursive=True)
             if p.status() != psutil.STATUS_ZOMBIE}
    assert after <= before


async def test_dead_actor_fails_pending_and_new_calls(rt):
    g = await rt.spawn("victim", Counter)
    pid = (await g.whoami.call_one())[3]
    pending = g.slow.call_one(60.0)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ActorDied, match=r"victim\[0\]"):
        await pending
    with pytest.raises(ActorDied):
        await g.incr.call_one(1)
    again = await rt.lookup("victim")  # a fresh handle fails fast too
    with pytest.raises(ActorDied, match=r"victim\[0\]"):
        await again.incr.call_one(1)
    await rt.wait_status("victim", "dead", timeout=30)  # the supervisor records why
    assert "SIGKILL" in (await rt.dir_call("lookup", "victim")).reasons[0]


async def test_restart_policy_brings_the_actor_back(rt):
    g = await rt.spawn("phoenix", Counter, 7, restart=RestartPolicy(max_restarts=1,
                                                                    backoff_s=0.05))
    pid = (await g.whoami.call_one())[3]
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ActorDied):
        await g.slow.call_one(60.0)
    await rt.wait_status(g, "up", min_restarts=1)  # the new process' handshake, no polling
    assert await g.incr.call_one(1) == 8  # fresh state: __init__ ran again
    new_pid = (await g.whoami.call_one())[3]
    assert new_pid != pid
    os.kill(new_pid, signal.SIGKILL)  # no restarts left
    await rt.wait_status("phoenix", "dead")
    rec = await rt.dir_call("lookup", "phoenix")
    assert rec.restarts[0] == 1
    assert rt.statistics().restarts >= 1
    with pytest.raises(ActorDied):
        await g.incr.call_one(1)


async def test_restarts_count_within_their_window(rt):
    """One restart allowed per 8 s: a death after the window has passed is restarted again
    (a long run survives faults that come now and then), two within it are not (a crash loop
    stops). The window is wide enough to hold a restart on 2 loaded cores (a 1.5 s one did
    not: the third death came after it, beside a soak and a sweep)."""
    g = await rt.spawn("window", Counter, 7, restart=RestartPolicy(max_restarts=1,
                                                                   window_s=8.0, backoff_s=0.0))
    for n in (1, 2):
        os.kill((await g.whoami.call_one())[3], signal.SIGKILL)
        await rt.wait_status(g, "up", min_restarts=n, timeout=30)
        assert await g.incr.call_one(1) == 8
        if n == 1:
            await asyncio.sleep(8.1)  # the first restart leaves the window
    os.kill((await g.whoami.call_one())[3], signal.SIGKILL)  # the second is still in it
    await rt.wait_status("window", "dead", timeout=30)
    assert (await rt.dir_call("lookup", "window")).restarts[0] == 2


async def test_a_connection_lost_with_calls_in_flight_counts_as_a_death(rt):
    g = await rt.spawn("cut", Counter, 3, restart=RestartPolicy(max_restarts=1, backoff_s=0.05))
    pid = (await g.whoami.call_one())[3]
    pending = g.slow.call_one(60.0)
    await asyncio.sleep(0.2)  # the call is on the actor now; its reply will be lost
    rt.pool.conns[g.addresses[0]].transport.abort()
    with pytest.raises(ActorDied, match="connection"):
        await pending
    await rt.wait_status(g, "up", min_restarts=1, timeout=30)
    new_pid = (await g.whoami.call_one())[3]
    assert new_pid != pid and await g.get.call_one() == 3  # a new process, fresh state
    rt.pool.conns[g.addresses[0]].transport.abort()  # nothing in flight: just reconnected
    await asyncio.sleep(1.0)
    assert (await g.whoami.call_one())[3] == new_pid
    assert (await rt.dir_call("lookup", "cut")).restarts[0] == 1


async def test_graceful_shutdown_leaves_no_processes():
    async with Runtime() as inner:
        g = await inner.spawn("tmp", Counter, n=2)
        relay = await inner.spawn("tmprelay", Relay)
        await relay.spawn_child.call_one()
        pids = [p for *_, p in await g.whoami.call()] + [await relay.child_pid.call_one()]
        run_dir = inner.run_dir
    _gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                    timeout=10)
    assert not alive
    assert not os.path.exists(run_dir)


DRIVER = textwrap.dedent("""
    import asyncio, json, sys
    sys.path.insert(0, {testdir!r})
    from test_actor import Counter, Relay
    from earl.runtime import Runtime

    async def main():
        async with Runtime() as rt:
            g = await rt.spawn("c", Counter, n=2)
            relay = await rt.spawn("r", Relay)
            await relay.spawn_child.call_one()
            pids = [p for *_, p in await g.whoami.call()] + [await relay.child_pid.call_one()]
            print(json.dumps(pids), flush=True)
            await asyncio.sleep(3600)

    if __name__ == "__main__":
        asyncio.run(main())
""")


async def test_sigkill_of_the_driver_kills_every_actor(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(testdir=os.path.dirname(__file__)))
    proc = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 60)
        pids = json.loads(line)
        assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)],
                                 timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
