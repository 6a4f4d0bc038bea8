"""The agentic task of `bench/peers.py` and `bench/async_vs_sync.py --workload agentic`: tools
that wait, and a reward for answers that are right.

Each episode is a multi-turn session whose turn count is heavy-tailed (most take 2-3 turns, a
few take 12). After every model turn the environment answers through a tool with real latency:
every third turn the sandboxed `python` tool (a real process in the sandbox, ~0.1 s), otherwise
a lookup whose latency is lognormal (mean 0.3 s, a remote API's shape). The task's first
message states its key, a digit written four times ("Task cfo: key 7777"); every turn the model
must answer that key, while the tools' outputs (each holding some other digit) pile up in the
context between the key and the answer. A turn is right when the first digit of the reply is
the key (text around it is ignored; a reply with no digit is wrong); the reward is the share of
turns right. Keys are uniform over the ten digits, so a policy that guesses scores ~0.1, one
that always says the same digit ~0.1, and the untrained model ~0: to score more the model must
read the key. The key is written four times (and the task id in letters, not digits) so that a
tiny model trained from random weights starts reading it within minutes; learning it for every
turn, past the tools' digits, takes longer, so the eval does not saturate at the benchmarks'
budgets. The point of the workload is still the waiting: a synchronous pipeline idles while its
slowest trajectories wait on tools, an asynchronous one keeps other batches going.

`tasks(n, seed)` makes the samples (plain dicts); `agent` is the coroutine EARL trains;
`episode_reward` scores an episode's replies, the one rule EARL's agent and TRL's rollout loop
(`bench/_peers_trl_agentic.py`) both apply.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
from collections.abc import Sequence
from typing import Any

from earl.envs.python_tool import python

MAX_TURNS = 12
DIGITS = "0123456789"  # ASCII only: str.isdigit() also takes "٣" and the like


def tasks(n: int, seed: int) -> list[dict[str, int]]:
    """`n` samples with heavy-tailed turn counts (Pareto, alpha 1.5, capped at MAX_TURNS) and a
    uniform key digit."""
    rng = random.Random(seed)
    return [{"id": i, "turns": min(MAX_TURNS, int(rng.paretovariate(1.5)) + 1),
             "seed": rng.randrange(1 << 30), "key": rng.randrange(10)} for i in range(n)]


async def lookup(key: int) -> str:
    """A latency-distributed tool: lognormal wait, mean ~0.3 s."""
    rng = random.Random(key)
    await asyncio.sleep(min(rng.lognormvariate(-1.7, 0.9), 3.0))
    return f"value {key % 10}"


def task_name(i: int) -> str:
    """Task id `i` in letters (base 26, "a" = 0): a digit in it would be one more to ignore."""
    out = ""
    while True:
        i, r = divmod(i, 26)
        out = chr(ord("a") + r) + out
        if not i:
            return out


_TASK = re.compile(r"Task ([a-z]+):")


def task_id(message: str) -> int:
    """The id of the task whose first message is `message` (inverse of `first_message`)."""
    m = _TASK.match(message)
    if m is None:
        raise ValueError(f"message {message!r} names no task: it must open with 'Task <letters>:'")
    return sum(26 ** k * (ord(c) - ord("a")) for k, c in enumerate(reversed(m.group(1))))


def first_message(sample: dict[str, int]) -> dict[str, str]:
    """The user message that opens an episode: the task and its key."""
    k = sample["key"]
    return {"role": "user", "content": f"Task {task_name(sample['id'])}: key {k}{k}{k}{k}"}


def correct(reply: str, key: int) -> bool:
    """Whether a reply answers `key`: its first digit is the key. `reply` is the turn's text as
    decoded with special tokens written out (EARL's `AssistantTurn.text`); a special token is
    not a character the model wrote, so the digits in its name ("<|reserved_7|>") do not count."""
    return next((ch for ch in _SPECIAL.sub("", reply) if ch in DIGITS), None) == str(key)


_SPECIAL = re.compile(r"<\|[^<>|]*\|>")


def episode_reward(sample: dict[str, int], replies: Sequence[str]) -> float:
    """The share of the episode's turns answered right (`replies[t]`: model turn t's text)."""
    assert len(replies) == sample["turns"], (len(replies), sample["turns"])
    return sum(correct(r, sample["key"]) for r in replies) / len(replies)


async def observe(sample: dict[str, int], turn: int) -> str:
    """The environment's answer after model turn `turn`: the sandboxed `python` tool every
    third turn, else the lookup (the tool output, stripped and cut to 40 characters)."""
    if turn % 3 == 2:
        obs = await asyncio.to_thread(python, f"print(({sample['seed'] % 1000} + {turn}) % 10)")
    else:
        obs = await lookup(sample["seed"] + turn)
    return obs.strip()[:40]


async def agent(rollout: Any, sample: dict[str, int]) -> float:
    """One episode: every model turn, then the tool's answer; returns `episode_reward`."""
    messages = [first_message(sample)]
    replies: list[str] = []
    for turn in range(sample["turns"]):
        reply = await rollout.generate(messages)
        messages.append(reply.message)
        replies.append(reply.text)
        # the last observation is never shown, but its tool is waited on like the others
        messages.append({"role": "user", "content": await observe(sample, turn)})
    return episode_reward(sample, replies)


def write_tasks(path: str, n: int, seed: int) -> str:
    with open(path, "w") as f:
        f.writelines(json.dumps(t) + "\n" for t in tasks(n, seed))
    return path
