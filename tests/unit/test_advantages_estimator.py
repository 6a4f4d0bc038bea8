"""earl.stages.advantages.Estimator: per-turn credit on turn tokens (GRPO, PPO, PPO against a
recipe's critic with self-imitation), failed and rejected episodes."""

from __future__ import annotations

import numpy as np
import pytest

from earl.config import AlgorithmConfig
from earl.recipes.tictactoe.critic import TabularCritic
from earl.runtime.types import Trajectory
from earl.stages.advantages import Estimator


def game(first_move: int, second_obs: int, rewards: list[float], sid: str, gid: str = "",
         reward: float | None = None, failed: bool = False) -> Trajectory:
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
    return Trajectory(sample_id=sid, group_id=gid or sid, token_ids=ids, loss_mask=mask,
                      logprobs=[-0.5 * m for m in mask], versions=[0] * n, turn_spans=spans,
                      turn_rewards=rewards, reward=sum(rewards) if reward is None else reward,
                      failed=failed)


def with_critic(self_imitation: int) -> Estimator:
    """The Tic-Tac-Toe recipe's critic (with a Q table) behind PPO credit."""
    return Estimator(AlgorithmConfig(name="ppo", critic="recipe", self_imitation=self_imitation),
                     TabularCritic(q_weight=2.0), failed_reward=-1.0)


def test_self_imitation_adds_the_better_reply() -> None:
    est = with_critic(16)
    # move 8 loses half its games, move 9 always wins: seen often enough to be trusted
    history = [game(8, 10 + i, [0.0, -1.0 if i % 2 else 1.0], f"a{i}") for i in range(6)]
    history += [game(9, 50 + i, [0.0, 1.0], f"b{i}") for i in range(6)]
    est.columns(history)
    cols, sources = est.columns([game(8, 99, [0.0, 1.0], "lucky")])
    assert len(cols["input_ids"]) == 2 and sources == [0, 0]  # the game + one imitation
    ids, mask, adv, roll = (cols[k][1] for k in ("input_ids", "loss_mask", "advantages",
                                                  "rollout_logprobs"))
    assert ids.tolist() == [1, 3, 4, 9, 2]  # the turn's observation, then the better reply
    assert mask.tolist() == [0, 0, 0, 1, 1] and (adv[3:] > 0.1).all() and (adv[:3] == 0).all()
    assert np.isnan(roll[3:]).all() and (roll[:3] == 0).all()
    est.config.self_imitation = 0
    cols, _ = est.columns([game(8, 98, [0.0, 1.0], "lucky2")])
    assert len(cols["input_ids"]) == 1


def test_grpo_is_group_relative_on_every_generated_token() -> None:
    est = Estimator(AlgorithmConfig(name="grpo"))
    g = [game(8, 10, [], "a", "g", reward=1.0), game(8, 11, [], "b", "g", reward=0.0),
         game(8, 12, [], "c", "h", reward=1.0), game(8, 13, [], "d", "h", reward=1.0)]
    cols, sources = est.columns(g)
    assert sources == [0, 1, 2, 3]
    adv = cols["advantages"]
    assert adv[0][3] == pytest.approx(0.5) and adv[1][3] == pytest.approx(-0.5)
    assert (adv[2] == 0).all() and (adv[3] == 0).all()  # equal rewards: no signal
    mask = cols["loss_mask"][0].astype(bool)
    assert (adv[0][mask] == pytest.approx(0.5)) and (adv[0][~mask] == 0).all()
    assert cols["input_ids"][0].dtype == np.int64 and cols["advantages"][0].dtype == np.float32


def test_ppo_credits_turns_and_failed_or_rejected_episodes() -> None:
    est = Estimator(AlgorithmConfig(name="ppo"), failed_reward=-1.0)
    a = game(8, 10, [0.0, 1.0], "a", "g")
    b = game(8, 11, [0.0, 0.0], "b", "g", failed=True)     # failed: scores failed_reward
    cols, _ = est.columns([a, b])
    assert est.turn_rewards(b) == [0.0, -1.0]
    # turn returns: a = [1, 1], b = [-1, -1]; group mean 0
    assert cols["advantages"][0][3] == pytest.approx(1.0)
    assert cols["advantages"][1][7] == pytest.approx(-1.0)
    rejected = game(8, 12, [], "r", "k", reward=None)
    rejected.reward = None
    other = game(8, 13, [], "o", "k", reward=1.0)
    cols, _ = est.columns([rejected, other])
    assert (cols["advantages"][0] == 0).all()  # the agent rejected it: no gradient


def test_critic_state_round_trips() -> None:
    est = with_critic(0)
    est.columns([game(8, 10, [0.0, 1.0], "a")])
    other = with_critic(0)
    other.load_state_dict(est.state_dict())
    assert other.state_dict() == est.state_dict() and est.state_dict()["values"]


def test_episodes_cut_before_a_generated_token_are_not_trained() -> None:
    cut = Trajectory(sample_id="c", group_id="g", reward=0.0, truncated=True)
    ok = game(8, 10, [], "a", "g", reward=1.0)
    cols, sources = Estimator(AlgorithmConfig(name="grpo")).columns([cut, ok])
    assert sources == [1] and len(cols["input_ids"]) == 1
