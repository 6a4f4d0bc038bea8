"""Agent loops for tool use: arithmetic word problems with the `calculator` or `python` tool.

The model may call tools for a few turns, then answers. Only a final assistant answer scores:
the reward is 1 when the last integer of an answer *without* a tool call is right, and 0 when
the session ends on a tool call (out of turns), a truncated turn or a wrong answer. The sample
is a task dict `{"question": str, "answer": int}` (a JSONL line; `earl.envs.arithmetic.CalcTasks`)
or an `earl.envs.arithmetic.Problem`. `calc_agent`'s calculator is built per episode and also
knows the question's numbers by name (a, b, c): a stateful tool, run in the agent's process. `tool_sim_responder` scripts a model for stress tests:
one tool call, then an answer.

Example:
    >>> traj = await run_agent(calc_agent, {"question": "2+3?", "answer": 5}, engine=engine,
    ...                        codec=codec)
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Mapping

from earl.agents.chat import ChatCodec, Message
from earl.agents.rollout import Agent, Rollout
from earl.agents.tools import Tool
from earl.engine import Responder
from earl.envs.arithmetic import Problem, evaluate, quantities, score
from earl.envs.python_tool import python

__all__ = ["MAX_TURNS", "calc_agent", "make_tool_agent", "problem_calculator", "python_agent",
           "solve", "tool_sim_responder"]

MAX_TURNS = 3  # assistant turns per session: tool calls, then the answer


def _task(sample: object) -> tuple[str, int]:
    if isinstance(sample, Problem):
        return sample.question, sample.answer
    if isinstance(sample, Mapping) and isinstance(sample.get("question"), str):
        try:
            return sample["question"], int(sample["answer"])
        except (KeyError, TypeError, ValueError):
            pass
    raise TypeError(f"the sample must be a task {{'question': str, 'answer': int}} (or an "
                    f"earl.envs.arithmetic.Problem), got {sample!r:.80}")


async def solve(rollout: Rollout, sample: object, tools: list[Callable[..., object] | Tool],
                max_turns: int = MAX_TURNS) -> float:
    """Let the model call `tools` for up to `max_turns` turns; score its final answer.

    `rollout.info` gets `correct` (0/1) and `answered` (1 when the last turn was an answer,
    0 when the session ended on a tool call or a truncated turn).
    """
    question, answer = _task(sample)
    messages: list[Message] = [{"role": "user", "content": question}]
    answered = False
    for _ in range(max_turns):
        turn = await rollout.generate(messages, tools=tools)
        messages.append(turn.message)
        if turn.truncated:
            break
        if not turn.tool_calls:
            answered = True
            break
        for call in turn.tool_calls:
            messages.append(await rollout.call_tool(call))
    # A tool's output is never an answer: only a final assistant turn without a call scores.
    reward = score(str(messages[-1].get("content") or ""), answer) if answered else 0.0
    rollout.info.update(correct=int(reward), answered=int(answered))
    return reward


def _problem_calculator_doc(expression: str) -> str:
    """Arithmetic (+ - * / // % ** ( )) on numbers and on a, b, c: the problem's numbers.

    Args:
        expression: e.g. a*b+c
    """
    raise NotImplementedError  # only its signature and docstring are used (the schema)


_PROBLEM_SCHEMA = Tool.from_function(_problem_calculator_doc, name="calculator").schema


def problem_calculator(question: str) -> Tool:
    """The calculator of one problem: arithmetic on numbers and on the question's numbers by
    name (a, b, c, ... in order). A per-episode stateful tool (a closure over this question's
    numbers): it runs in the agent's process, never on the shared worker pool."""
    names = quantities(question)

    def run(expression: str) -> str:
        return evaluate(expression, names)

    return Tool(name="calculator", fn=run, schema=_PROBLEM_SCHEMA)


async def calc_agent(rollout: Rollout, sample: object) -> float:
    """Solve one task with its problem's `calculator` (the `calc` recipe's agent): the model
    may write the question's numbers or their names a, b, c ("a*b+c")."""
    question, _ = _task(sample)
    return await solve(rollout, sample, [problem_calculator(question)])


async def python_agent(rollout: Rollout, sample: object) -> float:
    """Solve one task with the sandboxed `python` tool."""
    return await solve(rollout, sample, [python])


def make_tool_agent(tools: list[Callable[..., object] | Tool], max_turns: int = MAX_TURNS
                    ) -> Agent:
    """An agent `(rollout, task) -> reward` that may call `tools` for up to `max_turns` turns
    (in-process use: a closure cannot be named by `earl train --agent`)."""

    async def tool_agent(rollout: Rollout, sample: object) -> float:
        return await solve(rollout, sample, tools, max_turns)

    return tool_agent


_EXPR = re.compile(r"\d+")
_RESP = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


def tool_sim_responder(codec: ChatCodec, tool: str = "calculator", *,
                       calls: int = 1) -> Responder:
    """Call `tool` `calls` times on numbers of the question, then answer with the last result."""

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        tail = codec.decode(prompt_ids)
        done = _RESP.findall(tail)
        if len(done) >= calls:
            text = f"The answer is {done[-1].strip()}"
        else:
            question = tail.rsplit("<|im_start|>user\n", 1)[-1]
            nums = _EXPR.findall(question) or ["1", "1"]
            expr = f"{rng.choice(nums)}*{rng.choice(nums)}"
            args = {"expression": expr} if tool == "calculator" else {"code": f"print({expr})"}
            text = "<tool_call>" + json.dumps({"name": tool, "arguments": args}) + "</tool_call>"
        return codec.encode_text(text) + [codec.end_id]

    return respond
