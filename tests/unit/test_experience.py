"""earl.experience.batch_columns: per-move advantages on turn tokens, plus self-imitation samples."""

from __future__ import annotations

import numpy as np

from earl.config import RunConfig
from earl.critic import TabularCritic
from earl.experience import batch_columns
from earl.trajectory import Trajectory


def game(first_move: int, second_obs: int, rewards: list[float], sid: str) -> Trajectory:
    ids = [1, 3, 4]                       # observation of turn 0
    spans = [(3, 5)]
    ids += [first_move, 2]
    ids += [5, second_obs]                # observation of turn 1
    spans.append((len(ids), len(ids) + 2))
    ids += [7, 2]
    n = len(ids)
    mask = [0] * n
    for s, e in spans:
        mask[s:e] = [1] * (e - s)
    return Trajectory(sample_id=sid, group_id=sid, token_ids=ids, loss_mask=mask,
                      logprobs=[-0.5 * m for m in mask], versions=[0] * n, turn_spans=spans,
                      turn_rewards=rewards)


def test_self_imitation_adds_the_better_reply() -> None:
    cfg = RunConfig()
    critic = TabularCritic(alpha=0.2, lam=0.5, q_weight=2.0)
    # move 8 loses half its games, move 9 always wins: seen often enough to be trusted
    history = [game(8, 10 + i, [0.0, -1.0 if i % 2 else 1.0], f"a{i}") for i in range(6)]
    history += [game(9, 50 + i, [0.0, 1.0], f"b{i}") for i in range(6)]
    batch_columns(history, cfg, critic)
    cols, first_adv, sources = batch_columns([game(8, 99, [0.0, 1.0], "lucky")], cfg, critic)
    assert len(first_adv) == 1 and len(cols["input_ids"]) == 2  # the game + one imitation
    assert sources == [0, 0]
    ids, mask, adv, roll = (cols[k][1] for k in ("input_ids", "loss_mask", "advantages",
                                                  "rollout_logprobs"))
    assert ids.tolist() == [1, 3, 4, 9, 2]  # the turn's observation, then the better reply
    assert mask.tolist() == [0, 0, 0, 1, 1] and (adv[3:] > 0.1).all() and (adv[:3] == 0).all()
    assert np.isnan(roll[3:]).all() and (roll[:3] == 0).all()
    cfg.algorithm.self_imitation = 0
    cols, _, _ = batch_columns([game(8, 98, [0.0, 1.0], "lucky2")], cfg, critic)
    assert len(cols["input_ids"]) == 1
