"""bench/_peers_trl_async_agentic.py: TRL's async rollout loop playing an agentic episode trains
exactly the model's sampled tokens (with their logprobs), masks the environment's, waits on every
tool, and scores the episode with the workload's reward."""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _agentic_workload as work
import _peers_trl_async_agentic as aga
from peers_fakes import Tok


class Loop(aga.AgenticLoop):
    """The loop without its process plumbing; the server answers every turn with [50, 51]."""

    def __init__(self, tasks: dict[int, dict[str, int]]) -> None:  # no super(): no queues here
        self.tasks, self.tokenizer = tasks, Tok()
        self.render = aga.ag.Episodes(self.tokenizer)
        self._fork_threshold_tokens = 1024
        self._rates: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.pushed: list[dict[str, Any]] = []
        self.prompts: list[list[int]] = []

    async def _generate_one_turn(self, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
        self.prompts.append(list(prompt_ids))
        return [50, 51], [-0.5, -0.25]

    def _push_rollout_metrics(self, **kw: Any) -> None:
        self.pushed.append(kw)


@pytest.mark.timeout(30)
def test_episode_trains_model_tokens_only(monkeypatch: Any) -> None:
    observed: list[int] = []

    async def observe(sample: dict[str, int], turn: int) -> str:
        observed.append(turn)
        if turn == 1:  # the sandbox's wall limit, tripped
            raise RuntimeError("timeout after 5 s")
        return "value 3"

    monkeypatch.setattr(work, "observe", observe)
    sample = {"id": 5, "turns": 3, "seed": 1, "key": 7}
    loop = Loop({5: sample})
    completion, model_ids, rows, calls, fails, reward = asyncio.run(
        loop._generate_one([work.first_message(sample)], {}, []))
    assert observed == [0, 1, 2]  # the last tool is waited on too
    assert model_ids == [50, 51] * 3 and (calls, fails) == (3, 1)
    assert reward == 1.0  # Tok decodes every reply as "7", the key
    assert [m["role"] for m in completion] == ["assistant", "user"] * 2 + ["assistant"]
    assert completion[3]["content"] == "{'error': 'timeout after 5 s'}"  # TRL's tool-error text
    (row,) = rows  # every turn appended cleanly: one training row per episode
    assert row.input_ids == loop.prompts[-1] + [50, 51]
    trained = [t for t, m in zip(row.input_ids, row.completion_mask, strict=True) if m]
    assert trained == model_ids  # the environment's tokens are context
    assert [p for p, m in zip(row.old_log_probs, row.completion_mask, strict=True) if m] == \
        [-0.5, -0.25] * 3
    assert loop.pushed[0]["turns"] == 3 and loop.pushed[0]["completion_ids"] == model_ids
