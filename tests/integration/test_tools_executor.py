"""The action-level tool executor: elasticity, timeouts, cancellation, crashes, SEF, baseline."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from earl.agents.tools import Tool
from earl.envs.python_tool import python
from earl.envs.sim_tools import crash_tool, echo_tool, sleep_tool
from earl.runtime.sandbox import isolation_available
from earl.runtime.tools import ExecutorConfig, ToolExecutor
from earl.runtime.tools_static import StaticExecutor

SLEEP, CRASH, ECHO, PY = (Tool.from_function(f) for f in (sleep_tool, crash_tool, echo_tool, python))
pytestmark = pytest.mark.timeout(60)


async def _until(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    return cond()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def test_pool_grows_to_max_and_shrinks_to_min() -> None:
    cfg = ExecutorConfig(min_workers=1, max_workers=3, idle_s=0.3)
    async with ToolExecutor(cfg) as ex:
        results = await asyncio.gather(*(ex.run(SLEEP, {"seconds": 0.3}) for _ in range(9)))
        assert all(r.ok and r.output == "slept 0.300" for r in results)
        stats = ex.statistics()
        assert stats.peak_workers == 3 and stats.completed == 9
        assert await _until(lambda: ex.statistics().workers == 1)  # idle workers closed
        assert (await ex.run(ECHO, {"text": "hi"})).output == "hi"


async def test_timeout_crash_and_bad_results_keep_the_pool_serving() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=2)) as ex:
        r = await ex.run(SLEEP, {"seconds": 30}, timeout_s=0.3)
        assert not r.ok and r.error == "timeout" and "timed out" in r.output
        r = await ex.run(CRASH, {"code": 3})
        assert not r.ok and r.error == "crashed"
        r = await ex.run(ECHO, {"text": "object"})
        assert not r.ok and "not a string" in r.output
        assert (await ex.run(ECHO, {"text": "dict"})).output == '{"echo": "dict"}'
        assert (await ex.run(ECHO, {"text": "héllo ✓"})).output == "héllo ✓"
        assert (await ex.run(ECHO, {"text": "bad \ud800"})).output == "bad \ud800"

        def local(x: int) -> str:
            """Local.

            Args:
                x: x.
            """
            return "no"

        r = await ex.run(Tool.from_function(local), {"x": 1})  # no ref: runs in-process
        assert r.ok and r.output == "no"
        s = ex.statistics()
        assert s.timeouts == 1 and s.crashes == 1


async def test_cancelling_an_action_kills_its_worker() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=1)) as ex:
        await ex.run(ECHO, {"text": "warm"})
        (worker,) = ex._idle
        task = asyncio.create_task(ex.run(SLEEP, {"seconds": 30}))
        await _until(lambda: not ex._idle)
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # killed at once; reaped once it runs (30 s: a niced suite beside a soak on 2 cores
        # took over 10)
        assert await _until(lambda: not _alive(worker.proc.pid), timeout=30.0)
        assert (await ex.run(ECHO, {"text": "next"})).output == "next"


async def test_shortest_expected_first_order() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=1, policy="sef")) as ex:
        await ex.run(SLEEP, {"seconds": 0.2})  # history: sleep is slow, echo is fast
        await ex.run(ECHO, {"text": "x"})
        done: list[str] = []

        async def job(tool: Tool, args: dict, name: str) -> None:
            await ex.run(tool, args)
            done.append(name)

        blocker = asyncio.create_task(job(SLEEP, {"seconds": 0.3}, "blocker"))
        await _until(lambda: not ex._idle)
        jobs = [job(SLEEP, {"seconds": 0.2}, "slow1"), job(SLEEP, {"seconds": 0.2}, "slow2"),
                job(ECHO, {"text": "a"}, "fast1"), job(ECHO, {"text": "b"}, "fast2")]
        await asyncio.gather(blocker, *jobs)
        assert done == ["blocker", "fast1", "fast2", "slow1", "slow2"]


async def test_fifo_policy_keeps_submission_order() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=1, policy="fifo")) as ex:
        await ex.run(SLEEP, {"seconds": 0.2})
        done: list[str] = []

        async def job(tool: Tool, args: dict, name: str) -> None:
            await ex.run(tool, args)
            done.append(name)

        blocker = asyncio.create_task(job(SLEEP, {"seconds": 0.2}, "blocker"))
        await _until(lambda: not ex._idle)
        await asyncio.gather(blocker, job(SLEEP, {"seconds": 0.1}, "slow"),
                             job(ECHO, {"text": "a"}, "fast"))
        assert done == ["blocker", "slow", "fast"]


@pytest.mark.skipif(not isolation_available(), reason="sandbox isolation needs root on Linux")
async def test_hostile_python_through_the_executor() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=2)) as ex:
        hostile = [("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                   "        pass"), "while True:\n    pass", "import os\nos.kill(os.getppid(), 9)",
                   "print(open('/etc/passwd').read())"]
        results = await asyncio.gather(*(ex.run(PY, {"code": c}, timeout_s=20) for c in hostile))
        assert all(not r.ok for r in results), results
        assert (await ex.run(PY, {"code": "print(6*7)"})).output == "42\n"


async def test_static_baseline_pins_a_worker_per_session() -> None:
    async with StaticExecutor(ExecutorConfig(max_workers=1)) as ex:
        a, b = ex.for_session("a"), ex.for_session("b")
        assert (await a.run(ECHO, {"text": "1"})).ok
        pid = ex._owned["a"].proc.pid
        assert (await a.run(ECHO, {"text": "2"})).ok and ex._owned["a"].proc.pid == pid
        waiting = asyncio.create_task(b.run(ECHO, {"text": "b"}))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # b waits: a holds the only sandbox for its whole session
        await ex.release_session("a")
        r = await waiting
        assert r.ok and r.queued_s >= 0.2
        assert ex.statistics().spawned == 2


async def test_static_session_recovers_after_a_timeout() -> None:
    async with StaticExecutor(ExecutorConfig(max_workers=1)) as ex:
        a = ex.for_session("a")
        r = await a.run(SLEEP, {"seconds": 30}, timeout_s=0.3)
        assert r.error == "timeout"
        assert (await a.run(ECHO, {"text": "again"})).output == "again"


async def test_long_waiting_action_is_not_starved() -> None:
    async with ToolExecutor(ExecutorConfig(max_workers=1, policy="sef", max_wait_s=0.2)) as ex:
        await ex.run(SLEEP, {"seconds": 0.1})
        await ex.run(ECHO, {"text": "x"})
        done: list[str] = []

        async def job(tool: Tool, args: dict, name: str) -> None:
            await ex.run(tool, args)
            done.append(name)

        blocker = asyncio.create_task(job(SLEEP, {"seconds": 0.5}, "blocker"))
        await _until(lambda: not ex._idle)
        slow = asyncio.create_task(job(SLEEP, {"seconds": 0.1}, "slow"))
        await asyncio.sleep(0.05)
        await asyncio.gather(blocker, slow, job(ECHO, {"text": "a"}, "fast1"),
                             job(ECHO, {"text": "b"}, "fast2"))
        assert done == ["blocker", "slow", "fast1", "fast2"]  # waited > max_wait_s: goes first


async def test_closing_the_pool_kills_busy_workers() -> None:
    ex = ToolExecutor(ExecutorConfig(max_workers=1))
    async with ex:
        task = asyncio.create_task(ex.run(SLEEP, {"seconds": 30}))
        assert await _until(lambda: ex._pool.size == 1 and not ex._starting)
        await asyncio.sleep(0.1)
        (worker,) = list(ex._live)
    assert await _until(lambda: not _alive(worker.proc.pid))
    res = await task
    assert not res.ok and res.error == "crashed"


async def test_python_agent_through_the_executor_and_sandbox() -> None:
    from earl.agents.calc import python_agent
    from earl.agents.chat import ChatCodec
    from earl.agents.rollout import RolloutConfig, run_agent
    from earl.engine import SamplingParams, SimConfig, SimEngine
    from earl.envs.arithmetic import ArithmeticProblems
    from earl.models.tiny import build_tokenizer

    codec = ChatCodec(build_tokenizer())
    problem = ArithmeticProblems(0).problem(2)
    call = ('<tool_call>{"name": "python", "arguments": {"code": "print(' + problem.expression
            + ')"}}</tool_call>')

    def respond(prompt_ids, rng):
        tail = codec.decode(prompt_ids[-60:])
        if "<tool_response>" not in tail:
            return codec.encode_text(call) + [codec.end_id]
        result = tail.split("<tool_response>")[-1].split("</tool_response>")[0].strip()
        return codec.encode_text(f"It is {result}") + [codec.end_id]

    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=200), tool_timeout_s=20)
    async with ToolExecutor(ExecutorConfig(max_workers=1)) as ex:
        traj = await run_agent(python_agent, problem, engine=engine, codec=codec, config=cfg,
                               executor=ex)
    assert not traj.failed, traj.error
    assert traj.reward == 1.0 and traj.info["tool_calls"] == 1 and traj.info["tool_errors"] == 0
    assert traj.tool_time_s > 0


async def test_stateful_tools_run_in_process_beside_the_pool() -> None:
    """A closure (per-episode state) never reaches a worker, which could not import it: it runs
    in the caller's process with its state; an importable tool still runs on a worker."""
    seen: list[str] = []

    def remember(text: str) -> str:
        """Remember a word.

        Args:
            text: the word.
        """
        seen.append(text)
        return f"{len(seen)} words, pid {os.getpid()}"

    local = Tool.from_function(remember)
    assert local.ref is None
    async with ToolExecutor(ExecutorConfig(max_workers=1)) as ex:
        a = await ex.run(local, {"text": "a"})
        b = await ex.run(local, {"text": "b"})
        assert a.ok and b.ok and b.output == f"2 words, pid {os.getpid()}"
        assert ex.statistics().spawned == 0  # no worker was started for it
        echo = await ex.run(ECHO, {"text": "x"})
        assert echo.ok and echo.output == "x" and ex.statistics().spawned == 1
    assert seen == ["a", "b"]
