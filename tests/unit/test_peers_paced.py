"""bench/_peers_trl_agentic.py: TRL's multi-turn loop at each episode's own pace generates for
whichever episodes are waiting, so a fast episode never waits for a slow episode's tool."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _agentic_workload as work
import _peers_trl_agentic as ag
from peers_fakes import Tok


@pytest.mark.parametrize("paced", [True, False])
@pytest.mark.timeout(60)
def test_episodes_play_every_turn_and_mask_only_model_tokens(paced: bool,
                                                             monkeypatch: Any) -> None:
    """Episode 0's first tool call is slow. Paced, it returns only once the three fast
    episodes have observed all 4 of their turns: they never waited for it (a player that made
    them wait would hang here until the test's timeout). In lockstep every turn waits for it,
    so only the first batch was generated when it returned."""
    batches: list[int] = []
    fast_observed = 0
    fast_done = asyncio.Event()
    generated_when_slow_returned: list[int] = []

    async def observe(sample: dict[str, int], turn: int) -> str:
        nonlocal fast_observed
        if sample["id"] != 0:
            fast_observed += 1
            if fast_observed == 3 * 4:
                fast_done.set()
        elif turn == 0:
            if paced:
                await fast_done.wait()
            else:
                await asyncio.sleep(0.05)  # any wait: lockstep cannot generate meanwhile
            generated_when_slow_returned.append(sum(batches))
        return "obs"

    monkeypatch.setattr(work, "observe", observe)
    samples = [{"id": 0, "turns": 2, "seed": 0, "key": 7}] + [
        {"id": i, "turns": 4, "seed": i, "key": 7} for i in range(1, 4)]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        batches.append(len(prompts))
        return [[50, 51] for _ in prompts]

    player = ag.PacedEpisodes(Tok()) if paced else ag.Episodes(Tok())
    out = player.play(samples, generate)
    for s, mask, comp in zip(samples, out["env_mask"], out["completion_ids"], strict=True):
        assert len(mask) == len(comp) and sum(mask) == 2 * s["turns"]  # model tokens only
        assert mask[:2] == [1, 1] and 0 in mask  # observations follow the turns, masked
    assert out["episode_reward"] == [1.0] * 4  # every reply ("7") says the key
    assert sum(batches) == sum(s["turns"] for s in samples)
    if paced:  # the fast episodes ran their 4 turns while the slow one waited on its tool
        assert generated_when_slow_returned == [1 + 3 * 4]
    else:  # lockstep: one batch per turn, each turn waits for the slow tool
        assert len(batches) == 4 and generated_when_slow_returned == [4]
