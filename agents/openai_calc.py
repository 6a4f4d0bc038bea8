"""A calculator tool-use agent written only against the `openai` client.

Nothing here is EARL-specific except where the client comes from: the agent gets its base URL
and key from the rollout (`rollout.openai_client()` is `AsyncOpenAI(base_url=rollout.base_url,
api_key=rollout.api_key)`) and runs its own tool calls, as an agent written for OpenAI's API
would. EARL records every request token-exactly behind the endpoint. Train it with
`earl train --agent agents/openai_calc.py:agent --tasks FILE.jsonl` (tasks are
`{"question": ..., "answer": ...}` lines, e.g. from `earl.envs.arithmetic.CalcTasks`).
`warm_start_transcripts` writes supervised transcripts in this agent's own format for
`--warm_start.data` (a model that never calls tools learns the call format from them first).
"""

from __future__ import annotations

import json
import random

from earl.envs.arithmetic import calculator, demo_expression, score

__all__ = ["MODEL", "SYSTEM", "TOOLS", "agent", "warm_start_transcripts"]

MODEL = "earl-policy"  # the name the endpoint serves (EndpointConfig.model)
SYSTEM = "Solve the problem. Use the tool if it helps. End with the number."
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": 'e.g. "3 * (4 + 5)"'}},
            "required": ["expression"],
        },
    },
}]


def _run_tool(name: str, arguments: str) -> str:
    if name != "calculator":
        return f"Error: unknown tool {name!r}; the only tool is calculator"
    try:
        return calculator(str(json.loads(arguments)["expression"]))
    except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation
        return f"Error: {type(exc).__name__}: {exc}"


async def agent(rollout, sample, max_turns: int = 4) -> float:  # type: ignore[no-untyped-def]
    """Answer `sample` ({"question", "answer"} or an arithmetic Problem); reward 1.0 if right."""
    question = sample["question"] if isinstance(sample, dict) else sample.question
    answer = sample["answer"] if isinstance(sample, dict) else sample.answer
    client = rollout.openai_client()
    messages: list[dict[str, object]] = [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": question}]
    final = ""
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        final = msg.content or ""
        if not msg.tool_calls or reply.choices[0].finish_reason == "length":
            break
        for call in msg.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": _run_tool(call.function.name, call.function.arguments)})
        final = ""  # the reward reads the model's last answer, never a tool's output
    return score(final, int(answer))


def warm_start_transcripts(tasks: list[dict[str, object]], seed: int = 0
                           ) -> list[dict[str, object]]:
    """One `warm_start.data` line per task, as this agent's session would look: the system
    prompt and `TOOLS`, a calculator call by an imperfect demonstrator
    (`earl.envs.arithmetic.demo_expression`: the question's two numbers, the right operator for
    half the wordings, a random one for the rest), the tool's result, and that result as the
    answer."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for task in tasks:
        question = str(task["question"])
        expression = demo_expression(question, rng)
        call = {"name": "calculator", "arguments": {"expression": expression}}
        result = calculator(expression)
        out.append({"tools": TOOLS, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": question},
            {"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
            {"role": "tool", "content": result}, {"role": "assistant", "content": result}]})
    return out
