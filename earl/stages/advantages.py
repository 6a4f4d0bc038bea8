"""Experience preparation on the producer: finished trajectories -> the dock's training columns.

`Estimator.columns(trajs)` computes per-token advantages with the configured algorithm and
returns one row of columns per sample ("input_ids", "loss_mask", "advantages",
"rollout_logprobs", "versions"; dtypes from `earl.runtime.types.COLUMNS`):
- "grpo": critic-free, group-relative; each trajectory's reward minus its group's mean
  (optionally / std) on every generated token. Works for any agent.
- "ppo": per-turn credit; each turn's discounted return-to-go (the agent's per-turn rewards, or
  the final reward on the last turn) centred on the group's turns, or, given a critic (the
  recipe's `earl.Critic`, built by the producer), the critic's per-turn advantages; the critic
  learns from each batch after scoring it. With a critic and `self_imitation > 0`, up to that
  many extra samples replay a turn with the reply the critic rates best there.
Failed trajectories score `failed_reward`; rejected ones (reward None) get zero advantage;
ones without a generated token (the first prompt did not fit the context) are not trained on.
This module knows no task: what a critic keys on (a board, a prompt) is the recipe's business.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from earl.runtime.types import COLUMNS, Trajectory

if TYPE_CHECKING:
    from earl.config import AlgorithmConfig
    from earl.recipe import Critic

__all__ = ["Estimator", "SampleRows"]

SampleRows = dict[str, list[np.ndarray]]


class Estimator:
    """Advantage estimator, one per producer actor; stateful when it holds a critic (used with
    "ppo"; its state is what `state_dict` checkpoints).

    Args:
        config: the run's algorithm (`name`, `gamma`, `normalize_std`, `self_imitation`).
        critic: the recipe's critic (with "ppo"), or None.
        failed_reward: what a failed trajectory scores (the recipe's).
    """

    def __init__(self, config: AlgorithmConfig, critic: Critic | None = None, *,
                 failed_reward: float = 0.0) -> None:
        self.config, self.critic, self.failed_reward = config, critic, failed_reward

    def turn_rewards(self, t: Trajectory) -> list[float]:
        """Per-turn rewards: the agent's own, or the final reward on the last turn."""
        k = len(t.turn_spans)
        if t.failed:
            return [0.0] * max(k - 1, 0) + [self.failed_reward]
        if t.turn_rewards and len(t.turn_rewards) == k:
            return list(t.turn_rewards)
        return [0.0] * max(k - 1, 0) + [t.reward or 0.0]

    def columns(self, trajs: list[Trajectory]) -> tuple[SampleRows, list[int]]:
        """Training columns of `trajs` (plus self-imitation samples) and, per sample, the index
        of the trajectory it comes from."""
        import torch

        from earl.algorithms.advantages import (
            grpo_advantages,
            per_turn_advantages,
            turn_token_values,
        )

        c = self.config
        gids = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
        labels = [gids[t.group_id] for t in trajs]
        better: list[tuple[int, int, tuple[int, ...], float]] = []
        if c.name == "grpo":
            rewards = torch.tensor([self.failed_reward if t.failed else (t.reward or 0.0)
                                    for t in trajs], dtype=torch.float32)
            seq = grpo_advantages(rewards, group_ids=torch.tensor(labels),
                                  normalize_std=c.normalize_std)
            advs = [seq[i].repeat(len(t.turn_spans)) for i, t in enumerate(trajs)]
        elif self.critic is not None:
            turn_rewards = [self.turn_rewards(t) for t in trajs]
            advs = [torch.tensor(x) for x in self.critic.advantages(trajs, turn_rewards)]
            better = self.critic.better_actions(trajs) if c.self_imitation > 0 else []
            self.critic.update(trajs, turn_rewards)
        else:
            advs = per_turn_advantages([self.turn_rewards(t) for t in trajs], labels,
                                       gamma=c.gamma, normalize_std=c.normalize_std)
        rows: SampleRows = {k: [] for k in
                            ("input_ids", "loss_mask", "advantages", "rollout_logprobs",
                             "versions")}
        sources = []
        for i, (t, adv) in enumerate(zip(trajs, advs, strict=True)):
            if not any(t.loss_mask):  # cut before the model generated a token: nothing to train
                continue
            sources.append(i)
            spans = t.turn_spans[:len(adv)]
            if t.reward is None and not t.failed:  # rejected by the agent: no gradient
                adv = torch.zeros(len(spans))
            tok = turn_token_values(adv[:len(spans)], spans, len(t.token_ids)) if spans else \
                torch.zeros(len(t.token_ids))
            _append(rows, t.token_ids, t.loss_mask, tok.numpy(), t.logprobs, t.versions)
        for i, k, tokens, gain in better[:c.self_imitation]:
            _add_imitation(rows, trajs[i], k, tokens, gain)
            sources.append(i)
        return rows, sources

    def state_dict(self) -> dict[str, object]:
        return self.critic.state_dict() if self.critic is not None else {}

    def load_state_dict(self, d: dict[str, object]) -> None:
        if self.critic is not None and d:
            self.critic.load_state_dict(d)


def _append(rows: SampleRows, ids: list[int], mask: list[int], adv: np.ndarray,
            logprobs: list[float], versions: list[int]) -> None:
    rows["input_ids"].append(np.asarray(ids, dtype=COLUMNS["input_ids"]))
    rows["loss_mask"].append(np.asarray(mask, dtype=COLUMNS["loss_mask"]))
    rows["advantages"].append(np.asarray(adv, dtype=COLUMNS["advantages"]))
    rows["rollout_logprobs"].append(np.asarray(logprobs, dtype=COLUMNS["rollout_logprobs"]))
    rows["versions"].append(np.asarray(versions, dtype=COLUMNS["versions"]))


def _add_imitation(rows: SampleRows, t: Trajectory, turn: int, tokens: tuple[int, ...],
                   gain: float) -> None:
    """A sample that replays `t` up to `turn` and answers with `tokens` (a reply the critic
    knows beats the one taken there), trained on with advantage `gain` as on-policy (its
    behaviour log-probs are unknown: NaN)."""
    start = t.turn_spans[turn][0]
    n = len(tokens)
    _append(rows, list(t.token_ids[:start]) + list(tokens), [0] * start + [1] * n,
            np.concatenate([np.zeros(start), np.full(n, gain)]),
            [0.0] * start + [float("nan")] * n, list(t.versions[:start]) + [-1] * n)
