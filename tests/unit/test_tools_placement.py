"""Where tools run: importable functions may go to the worker pool, stateful callables (closures,
bound methods) run in the session's process with their state, and a tool that cannot run where
it is placed is an error when it is defined. Also: only a final answer scores in the calc loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from earl.agents.calc import calc_agent
from earl.agents.chat import ChatCodec
from earl.agents.rollout import Rollout, RolloutConfig, run_agent
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.arithmetic import calculator
from earl.models.tiny import build_tokenizer
from earl.runtime.tools import run_local
from earl.runtime.types import JSONValue, Tool, ToolResult

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


class _Game:
    """A per-episode secret number behind a bound-method tool."""

    def __init__(self, secret: int) -> None:
        self.secret, self.guesses = secret, 0

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: the guess.
        """
        self.guesses += 1
        return "correct" if number == self.secret else ("higher" if number < self.secret
                                                         else "lower")


def _closure_tool(secret: int):
    tries: list[int] = []

    def guess(number: int) -> str:
        """Guess the secret number.

        Args:
            number: the guess.
        """
        tries.append(number)
        return f"{'correct' if number == secret else 'wrong'} after {len(tries)}"

    return guess


class _RecordingPool:
    """A ToolRunner that stands in for the worker pool and records what it was sent."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult:
        self.sent.append(tool.name)
        return ToolResult(ok=True, output=f"pool ran {tool.name}")


def test_refs_name_only_what_a_worker_can_import() -> None:
    assert Tool.from_function(calculator).ref == "earl.envs.arithmetic:calculator"
    assert Tool.from_function(_closure_tool(3)).ref is None
    assert Tool.from_function(_Game(3).guess).ref is None  # bound method: carries its state
    assert Tool.from_function(calculator, where="local").ref is None
    with pytest.raises(TypeError, match="cannot run on a worker.*where='local'"):
        Tool.from_function(_closure_tool(3), where="worker")
    with pytest.raises(TypeError, match="cannot run on a worker"):
        Tool.from_function(_Game(3).guess, where="worker")
    with pytest.raises(ValueError, match="where="):
        Tool.from_function(calculator, where="gpu")


def test_stateful_tools_keep_their_state_beside_a_pool(codec: ChatCodec) -> None:
    game = _Game(secret=7)
    closure = _closure_tool(secret=4)
    pool = _RecordingPool()
    rollout = Rollout(SimEngine(SimConfig(time_scale=0.0)), codec, sample_id="s", group_id="g",
                      executor=pool)
    rollout._set_tools([Tool.from_function(game.guess), Tool.from_function(closure, name="probe"),
                        calculator])

    def call(name: str, **args: JSONValue):
        from earl.agents.tools import ToolCall
        return asyncio.run(rollout.call_tool(ToolCall(name=name, arguments=args)))

    assert call("guess", number=3)["content"] == "higher"
    assert call("guess", number=7)["content"] == "correct"
    assert game.guesses == 2  # the episode's own object saw both calls
    assert call("probe", number=1)["content"] == "wrong after 1"
    assert call("probe", number=4)["content"] == "correct after 2"
    assert call("calculator", expression="2+2")["content"] == "pool ran calculator"
    assert pool.sent == ["calculator"]  # only the importable tool reached the pool
    assert rollout.tool_errors == 0


def test_run_local_reports_failures_and_timeouts() -> None:
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: anything.
        """
        raise RuntimeError("no")

    async def slow(x: int) -> str:
        """Sleep.

        Args:
            x: anything.
        """
        await asyncio.sleep(10)
        return "late"

    res = asyncio.run(run_local(Tool.from_function(boom), {"x": 1}, timeout_s=5))
    assert not res.ok and res.output == "boom raised RuntimeError: no"
    res = asyncio.run(run_local(Tool.from_function(slow), {"x": 1}, timeout_s=0.05))
    assert not res.ok and res.error == "timeout" and "timed out" in res.output



def test_a_stalled_sync_tool_times_out_without_blocking_the_loop() -> None:
    import threading

    from earl.runtime.tools import stalled_threads

    release = threading.Event()

    def hang(x: int) -> str:
        """Block like a network read that never returns (until released).

        Args:
            x: anything.
        """
        release.wait(30)
        return "late"

    async def main() -> tuple[ToolResult, int, int]:
        ticks = 0

        async def tick() -> None:  # another session on the same loop
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(tick())
        res = await run_local(Tool.from_function(hang), {"x": 1}, timeout_s=0.3)
        t.cancel()
        return res, ticks, stalled_threads()

    res, ticks, stalled = asyncio.run(main())
    assert not res.ok and res.error == "timeout" and "timed out after 0.3 s" in res.output
    assert ticks >= 5  # the loop kept running while the tool hung
    assert stalled == 1
    release.set()
    for _ in range(200):
        if stalled_threads() == 0:
            break
        threading.Event().wait(0.01)
    assert stalled_threads() == 0  # the thread ended once the call returned
    # a sync tool's result and failure still come back
    res = asyncio.run(run_local(Tool.from_function(hang), {"x": 1}, timeout_s=5))
    assert res.ok and res.output == "late"

def _tool_call_only(codec: ChatCodec):
    call = json.dumps({"name": "calculator", "arguments": {"expression": "2+3"}})

    def respond(prompt_ids: list[int], rng: object) -> list[int]:
        return codec.encode_text(f"<tool_call>{call}</tool_call>") + [codec.end_id]

    return respond


def test_a_policy_that_only_calls_the_tool_scores_zero(codec: ChatCodec) -> None:
    # The tool's output ("5") is the last message when the loop runs out of turns: it must not
    # be read as the answer.
    engine = SimEngine(SimConfig(time_scale=0.0), responder=_tool_call_only(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=200))
    t = asyncio.run(run_agent(calc_agent, {"question": "2 and 3 more?", "answer": 5},
                              engine=engine, codec=codec, config=cfg))
    assert not t.failed and t.info["tool_calls"] == 3 and t.info["tool_errors"] == 0
    assert t.reward == 0.0 and t.info["answered"] == 0 and t.info["correct"] == 0


def test_a_final_answer_scores(codec: ChatCodec) -> None:
    call = json.dumps({"name": "calculator", "arguments": {"expression": "2+3"}})

    def respond(prompt_ids: list[int], rng: object) -> list[int]:
        done = "<tool_response>" in codec.decode(prompt_ids[-30:])
        text = "It is 5" if done else f"<tool_call>{call}</tool_call>"
        return codec.encode_text(text) + [codec.end_id]

    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=200))
    t = asyncio.run(run_agent(calc_agent, {"question": "2 and 3 more?", "answer": 5},
                              engine=engine, codec=codec, config=cfg))
    assert t.reward == 1.0 and t.info["answered"] == 1 and len(t.turn_spans) == 2
    t = asyncio.run(run_agent(calc_agent, {"question": "2 and 3 more?", "answer": 6},
                              engine=engine, codec=codec, config=cfg))
    assert t.reward == 0.0 and t.info["answered"] == 1


def test_the_calc_agents_calculator_is_a_per_episode_stateful_tool() -> None:
    from earl.agents.calc import problem_calculator

    tool = problem_calculator("Ann has 3 bags of 4 pens and gets 5 more.")
    assert tool.ref is None and tool.name == "calculator"  # never sent to a worker
    assert tool.fn(expression="a*b+c") == "17" and tool.fn(expression="2*(a+1)") == "8"
    other = problem_calculator("Bob has 9 cups and loses 2.")
    assert other.fn(expression="a-b") == "7" and other.schema is tool.schema
    with pytest.raises(ValueError, match="unknown name 'c'"):
        other.fn(expression="a+c")
