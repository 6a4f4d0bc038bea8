"""The experience stage of `earl train`: finished games -> per-sample training columns.

`batch_columns` turns a batch of trajectories into dock columns ("input_ids", "loss_mask",
"advantages", "rollout_logprobs", "versions"): per-move credit from the tabular critic (or
group-relative returns) mapped onto each turn's tokens, plus self-imitation samples.
`warm_start_data` makes the supervised warm start's random legal games. Nothing here starts an
actor or touches the network.
"""

from __future__ import annotations

import numpy as np

from earl.config import RunConfig
from earl.critic import TabularCritic
from earl.trajectory import Trajectory


async def warm_start_data(codec, n_games: int, seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random legal games in the exact token format of training, with soft targets.

    Targets per assistant turn: uniform over the legal digits, then 1.0 on the closing token.
    """
    from earl.agents.rollout import RolloutConfig, run_agent
    from earl.agents.tictactoe import free_squares, sim_responder
    from earl.engine import SamplingParams, SimConfig, SimEngine
    from earl.eval import make_agent

    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed), responder=sim_responder(codec))
    agent = make_agent()
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=4, stop_token_ids=codec.stop_ids))
    trajs = [await run_agent(agent, seed * 7919 + i, engine=engine, codec=codec, config=cfg)
             for i in range(n_games)]
    digit_ids = {d: codec.encode_text(d)[0] for d in "123456789"}
    ids_out, tgt_out = [], []
    for t in trajs:
        rows: list[tuple[int, int, float]] = []
        for start, end in t.turn_spans:
            legal = free_squares(codec.decode(t.token_ids[max(0, start - 48):start]))
            if not legal or end - start < 2:
                continue
            rows += [(start, digit_ids[d], 1.0 / len(legal)) for d in legal]
            rows.append((start + 1, codec.end_id, 1.0))
        if rows:
            ids_out.append(np.asarray(t.token_ids, dtype=np.int64))
            tgt_out.append(np.asarray(rows, dtype=np.float64))
    return ids_out, tgt_out


def batch_columns(trajs: list[Trajectory], cfg: RunConfig, critic: TabularCritic | None = None
                  ) -> tuple[dict[str, list[np.ndarray]], list[float], list[int]]:
    """Reward/advantage stage: per-move credit, mapped onto turn tokens.

    With a critic: lambda-return minus the value of the observation each move answered (the
    critic is then updated with this batch). Without: each move's return centred on its group.
    With a critic and `algorithm.self_imitation` > 0, up to that many extra samples replay a
    turn with the reply the critic's Q(s, a) table rates best there, when it beats the reply
    taken (self-imitation: a rarely sampled good move is learned without waiting to sample it).
    """
    import torch

    from earl.algorithms.advantages import per_turn_advantages, turn_token_values

    a = cfg.algorithm
    turn_rewards = []
    for t in trajs:
        tr = list(t.turn_rewards)
        if t.failed or not tr or len(tr) != len(t.turn_spans):  # a broken game scores a loss
            tr = [0.0] * max(len(t.turn_spans) - 1, 0) + [a.reward_loss]
        turn_rewards.append(tr)
    gids = {g: i for i, g in enumerate(dict.fromkeys(t.group_id for t in trajs))}
    better: list[tuple[int, int, tuple[int, ...], float]] = []
    if critic is not None:
        advs = [torch.tensor(x) for x in critic.advantages(trajs, turn_rewards)]
        better = critic.better_actions(trajs) if a.self_imitation > 0 else []
        critic.update(trajs, turn_rewards)
    else:
        advs = per_turn_advantages(turn_rewards, [gids[t.group_id] for t in trajs],
                                   gamma=a.gamma, normalize_std=a.normalize_std)
    cols: dict[str, list[np.ndarray]] = {"input_ids": [], "loss_mask": [], "advantages": [],
                                         "rollout_logprobs": [], "versions": []}
    first_adv = []
    for t, adv in zip(trajs, advs, strict=True):
        spans = t.turn_spans[:len(adv)] if len(adv) <= len(t.turn_spans) else t.turn_spans
        tok = turn_token_values(adv[:len(spans)], spans, len(t.token_ids)) if spans else \
            torch.zeros(len(t.token_ids))
        cols["input_ids"].append(np.asarray(t.token_ids, dtype=np.int64))
        cols["loss_mask"].append(np.asarray(t.loss_mask, dtype=np.int8))
        cols["advantages"].append(tok.numpy().astype(np.float32))
        cols["rollout_logprobs"].append(np.asarray(t.logprobs, dtype=np.float32))
        cols["versions"].append(np.asarray(t.versions, dtype=np.int32))
        first_adv.append(float(adv[0]) if len(adv) else 0.0)
    sources = list(range(len(trajs)))  # the trajectory each sample comes from
    if critic is not None and a.self_imitation > 0:
        for i, k, tokens, gain in better[:a.self_imitation]:
            _add_imitation(cols, trajs[i], k, tokens, gain)
            sources.append(i)
    return cols, first_adv, sources


def _add_imitation(cols: dict[str, list[np.ndarray]], t: Trajectory, turn: int,
                   tokens: tuple[int, ...], gain: float) -> None:
    """A sample that replays `t` up to `turn` and answers with `tokens` (a reply the critic
    knows beats the one taken there): trained on with advantage `gain`, as on-policy."""
    start = t.turn_spans[turn][0]
    n = len(tokens)
    cols["input_ids"].append(np.asarray(list(t.token_ids[:start]) + list(tokens), np.int64))
    cols["loss_mask"].append(np.concatenate([np.zeros(start, np.int8), np.ones(n, np.int8)]))
    cols["advantages"].append(np.concatenate([np.zeros(start, np.float32),
                                              np.full(n, gain, np.float32)]))
    cols["rollout_logprobs"].append(np.concatenate([np.zeros(start, np.float32),
                                                    np.full(n, np.nan, np.float32)]))
    cols["versions"].append(np.asarray(list(t.versions[:start]) + [-1] * n, np.int32))
