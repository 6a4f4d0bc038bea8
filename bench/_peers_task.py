"""The task both sides of `bench/peers.py` train on: the agent, the reward rule and the data.

Single-turn "echo the digit": the user says e.g. "Say 7" and the assistant should answer "7".
The tiny char-level model starts from random weights, so the reward is graded to give GRPO a
signal from the first step: 0.25 x the share of digits in the answer, +0.5 if the answer starts
with the right digit, +0.25 if it is exactly that digit (1.0 = exact). EARL imports `agent` and
`reward` from this file by path (`--agent`, `--reward`); TRL's side wraps the same `reward` in
its reward-function signature. This module is the task only: it runs nothing and imports
nothing heavy.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

TEMPLATES = ("Say {d}", "Echo {d}", "Repeat {d}", "Print {d}")
DIGITS = "0123456789"


def reward(sample: dict[str, Any], response: str) -> float:
    """Scores the final assistant text against `sample["answer"]` (a digit); 1.0 = exact."""
    text, target = response.strip(), str(sample["answer"])
    if not text:
        return 0.0
    r = 0.25 * sum(c in DIGITS for c in text) / len(text)
    if text.startswith(target):
        r += 0.5
    if text == target:
        r += 0.25
    return r


async def agent(rollout: Any, sample: dict[str, Any]) -> float:
    """One turn: the question, one generated answer, scored by `reward`."""
    turn = await rollout.generate([{"role": "user", "content": sample["question"]}])
    return reward(sample, turn.content or "")


def samples(n: int, seed: int) -> list[dict[str, str]]:
    """`n` training samples drawn with `seed` (template and digit uniform)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        d = rng.choice(DIGITS)
        out.append({"question": rng.choice(TEMPLATES).format(d=d), "answer": d})
    return out


def eval_samples() -> list[dict[str, str]]:
    """Every template with every digit: 40 prompts, scored greedily on both sides."""
    return [{"question": t.format(d=d), "answer": d} for t in TEMPLATES for d in DIGITS]


def write_data(folder: Path, n_train: int, seed: int) -> tuple[Path, Path]:
    """Writes train.jsonl and eval.jsonl into `folder`; returns their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    train, ev = folder / "train.jsonl", folder / "eval.jsonl"
    train.write_text("".join(json.dumps(s) + "\n" for s in samples(n_train, seed)))
    ev.write_text("".join(json.dumps(s) + "\n" for s in eval_samples()))
    return train, ev
