"""Agent loops for tool use: arithmetic word problems with the `calculator` or `python` tool.

The model may call tools for a few turns, then answers; the reward is 1 when the last integer
of its final answer is right. The sample is an `earl.envs.arithmetic.Problem`.
`tool_sim_responder` scripts a model for stress tests: one tool call, then an answer.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

from earl.agents.chat import ChatCodec
from earl.agents.rollout import Agent, Rollout
from earl.engine import Responder
from earl.envs.arithmetic import Problem, calculator, score
from earl.envs.python_tool import python

__all__ = ["calc_agent", "make_tool_agent", "python_agent", "tool_sim_responder"]

SYSTEM = "Solve the problem. Use the tool if it helps. End with the number."


def make_tool_agent(tools: list[Callable[..., object]], max_turns: int = 4) -> Agent:
    """An agent `(rollout, problem) -> reward` that may call `tools` for up to `max_turns`."""

    async def tool_agent(rollout: Rollout, sample: object) -> float:
        if not isinstance(sample, Problem):
            raise TypeError(f"the sample must be an earl.envs.arithmetic.Problem, got "
                            f"{type(sample).__name__}")
        messages = [{"role": "system", "content": SYSTEM},
                    {"role": "user", "content": sample.question}]
        for _ in range(max_turns):
            turn = await rollout.generate(messages, tools=tools)
            messages.append(turn.message)
            if not turn.tool_calls or turn.truncated:
                break
            for call in turn.tool_calls:
                messages.append(await rollout.call_tool(call))
        reward = score(messages[-1].get("content") or "", sample.answer)  # type: ignore[arg-type]
        rollout.info["correct"] = int(reward)
        return reward

    return tool_agent


calc_agent = make_tool_agent([calculator])
python_agent = make_tool_agent([python])
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
