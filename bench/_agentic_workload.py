"""The agentic workload of `bench/async_vs_sync.py --workload agentic`: tools that wait.

Each episode is a multi-turn session whose turn count is heavy-tailed (most take 2-3 turns, a
few take 12). After every model turn the environment answers through a tool with real latency:
every third turn the sandboxed `python` tool (a real process in the sandbox, ~0.1 s), otherwise
a lookup whose latency is lognormal (mean 0.3 s, a remote API's shape). The model's job is
simple (answer each turn with a digit); the point is the waiting: a synchronous pipeline idles
while its slowest trajectories wait on tools, an asynchronous one keeps other batches going.

`tasks(n, seed)` makes the samples (plain dicts); `agent` is the coroutine both modes train.
"""

from __future__ import annotations

import asyncio
import json
import random

from earl.envs.python_tool import python

MAX_TURNS = 12


def tasks(n: int, seed: int) -> list[dict[str, int]]:
    """`n` samples with heavy-tailed turn counts (Pareto, alpha 1.5, capped at MAX_TURNS)."""
    rng = random.Random(seed)
    return [{"id": i, "turns": min(MAX_TURNS, int(rng.paretovariate(1.5)) + 1),
             "seed": rng.randrange(1 << 30)} for i in range(n)]


async def lookup(key: int) -> str:
    """A latency-distributed tool: lognormal wait, mean ~0.3 s."""
    rng = random.Random(key)
    await asyncio.sleep(min(rng.lognormvariate(-1.7, 0.9), 3.0))
    return f"value {key % 97}"


def first_message(sample: dict[str, int]) -> dict[str, str]:
    """The user message that opens an episode (it names the task id)."""
    return {"role": "user", "content": f"Task {sample['id']}: reply with one digit."}


def answered(reply: str) -> bool:
    """Whether a model turn counts toward the reward: it holds a digit."""
    return any(ch.isdigit() for ch in reply)


async def observe(sample: dict[str, int], turn: int) -> str:
    """The environment's answer after model turn `turn`: the sandboxed `python` tool every
    third turn, else the lookup (the tool output, stripped and cut to 40 characters)."""
    if turn % 3 == 2:
        obs = await asyncio.to_thread(python, f"print({sample['seed'] % 1000} * {turn})")
    else:
        obs = await lookup(sample["seed"] + turn)
    return obs.strip()[:40]


async def agent(rollout, sample: dict[str, int]) -> float:
    messages = [first_message(sample)]
    digits = 0
    for turn in range(sample["turns"]):
        reply = await rollout.generate(messages)
        messages.append(reply.message)
        digits += answered(reply.content)
        messages.append({"role": "user", "content": await observe(sample, turn)})
    return digits / sample["turns"]


def write_tasks(path: str, n: int, seed: int) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks(n, seed))
    return path
