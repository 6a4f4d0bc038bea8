"""The Tic-Tac-Toe recipe (the default `earl train`): a tiny model learns to play against a
random opponent on 2 CPU cores.

What is specific to the task lives in this folder: the agent (one digit per move, per-move
rewards), integer game seeds as tasks (even seed: the agent opens), the warm start on random
*legal* games, the 200-game evaluation (win+draw rate, alternating first move, greedy;
`evaluation.py`), the critic (`critic.py`), and the config that reaches >= 0.90 win+draw in
under 10 minutes: per-turn PPO credit against the tabular critic with a Q(s, a) table and
self-imitation of better replies, KL 0.15 to the warm start. Written against the public API
only, like a user's recipe.
"""

from __future__ import annotations

import numpy as np

from earl import (
    ChatCodec,
    EvalSet,
    Recipe,
    Rollout,
    RolloutConfig,
    SamplingParams,
    SeedTasks,
    SimConfig,
    SimEngine,
    run_agent,
)
from earl.agents.tictactoe import (
    free_squares,
    legal_move_targets,
    play_board_game,
    sim_responder,
)
from earl.envs.tictactoe import TicTacToe
from earl.recipes.tictactoe.critic import TabularCritic
from earl.recipes.tictactoe.evaluation import EVAL_SEED, env_config, summarize

TRAIN_SEED = 10_000  # training game seeds: TRAIN_SEED + cursor (even = the agent opens)
WIN, DRAW, LOSS = 1.0, 1.0, -1.0
_CONFIGS = {first: env_config(first, win=WIN, draw=DRAW, loss=LOSS) for first in (True, False)}


async def agent(rollout: Rollout, seed: int) -> float:
    """One game; even seeds open, odd seeds play second. Returns the summed move rewards."""
    rollout.info["seed"] = seed
    return await play_board_game(rollout, TicTacToe(_CONFIGS[seed % 2 == 0]), seed)


def eval_seeds(split: str, step: int, n: int) -> list[int]:
    """Fresh seeds per eval, disjoint from training: validation evals move with the step,
    the final and start evals use their own ranges."""
    base = {"final": EVAL_SEED, "start": EVAL_SEED + 1_000_000}.get(
        split, EVAL_SEED + 2_000_000 * max(step, 1))
    return [base + i for i in range(n)]


def metric(episodes: list) -> dict[str, float]:  # type: ignore[type-arg]
    """Win/draw/loss/illegal rates; a failed game is a loss."""
    return {k: float(v) for k, v in summarize(episodes).to_dict().items()}  # type: ignore[arg-type]


async def warm_start(codec: ChatCodec, n_games: int, seed: int
                     ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random legal games in the exact token format of training, with soft targets: uniform
    over the legal digits, then 1.0 on the closing token (a legal player, not an expert)."""
    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed), responder=sim_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=4, stop_token_ids=codec.stop_ids))
    trajs = [await run_agent(agent, seed * 7919 + i, engine=engine, codec=codec, config=cfg)
             for i in range(n_games)]
    ids_out, tgt_out = [], []
    for t in trajs:
        rows = legal_move_targets(codec, t, free_squares, lookback=48)
        if rows is not None:
            ids_out.append(np.asarray(t.token_ids, dtype=np.int64))
            tgt_out.append(rows)
    return ids_out, tgt_out


def critic() -> TabularCritic:
    """Each producer's critic: values and a Q(s, a) table over the boards the agent was shown,
    lambda 0.5, step 0.2; Q(s, a) counts as much as the game's return after 2 visits."""
    return TabularCritic(alpha=0.2, lam=0.5, q_weight=2.0)


recipe = Recipe(
    name="tictactoe",
    agent=agent,
    tasks=SeedTasks(TRAIN_SEED),
    eval=EvalSet(make=eval_seeds),
    metric=metric,
    target_key="win_draw_rate",
    max_tokens=4,
    shared_group_task=False,  # the critic learns per game: every game its own seed
    failed_reward=LOSS,
    warm_start=warm_start,
    critic=critic,
    config={
        "steps": 2000, "batch_size": 64, "group_size": 8, "max_policy_lag": 1,
        "time_limit_minutes": 9.0, "target": 0.97, "eval_games": 200, "eval_every": 40,
        "select_best": True, "checkpoint_every": 25,
        "warm_start": {"steps": 120, "batch_size": 32, "lr": 3e-3},
        "algorithm": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.15,
                      "critic": "recipe", "self_imitation": 16},
        "optim": {"lr": 1e-3, "lr_anneal_from": 0.5, "lr_final": 0.1},
    },
)
