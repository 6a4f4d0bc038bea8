"""bench/_peers_trl_agentic.py: TRL's multi-turn loop at each episode's own pace generates for
whichever episodes are waiting, so a fast episode never waits for a slow episode's tool."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _agentic_workload as work
import _peers_trl_agentic as ag
from peers_fakes import Tok


@pytest.mark.parametrize("paced", [True, False])
def test_episodes_play_every_turn_and_mask_only_model_tokens(paced: bool,
                                                             monkeypatch: Any) -> None:
    slow = {0}

    async def observe(sample: dict[str, int], turn: int) -> str:
        await asyncio.sleep(0.2 if sample["id"] in slow else 0.0)
        return "obs"

    monkeypatch.setattr(work, "observe", observe)
    samples = [{"id": 0, "turns": 2, "seed": 0, "key": 7}] + [
        {"id": i, "turns": 4, "seed": i, "key": 7} for i in range(1, 4)]
    batches: list[int] = []
    when: list[float] = []
    t0 = time.perf_counter()

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        batches.append(len(prompts))
        when.append(time.perf_counter() - t0)
        time.sleep(0.01)
        return [[50, 51] for _ in prompts]

    player = ag.PacedEpisodes(Tok()) if paced else ag.Episodes(Tok())
    out = player.play(samples, generate)
    for s, mask, comp in zip(samples, out["env_mask"], out["completion_ids"], strict=True):
        assert len(mask) == len(comp) and sum(mask) == 2 * s["turns"]  # model tokens only
        assert mask[:2] == [1, 1] and 0 in mask  # observations follow the turns, masked
    assert out["episode_reward"] == [1.0] * 4  # every reply ("7") says the key
    assert sum(batches) == sum(s["turns"] for s in samples)
    early = sum(n for n, t in zip(batches, when, strict=True) if t < 0.15)
    if paced:  # the fast episodes ran their 4 turns while the slow one waited on its tool
        assert early == 1 + 3 * 4
    else:  # lockstep: one batch per turn, each turn waits for the slow tool
        assert len(batches) == 4 and early == 4
