"""The `gauntlet` recipe: Tic-Tac-Toe games in one context until the first loss; contexts grow
because the agent learns.

One episode is a gauntlet (`earl.agents.gauntlet`): game after game against the random
opponent in one conversation, the opponent opening every game, ending at the agent's first loss
(an illegal move loses) or after `GAUNTLET.max_games` games. A random legal player survives 42%
of its games as the second player, so its gauntlets stop after ~1.7 games (p95 ~630 tokens); a
player that takes wins and blocks survives 93% and often reaches the cap (~3,700 tokens, ~130
per game). The length comes only from how the policy plays: no schedule lengthens anything.
The second move is the harder side against a random player (and the shorter start), which
leaves the 4,096 positions of the tiny model room for a growth of more than 4x.

What is specific to the task lives here: integer episode seeds as tasks (one seed per gauntlet;
`shared_group_task=False`, the critic learns per game), the warm start on random *legal*
gauntlets with soft targets, the greedy evaluation's metric (`games_survived`: mean games
survived per gauntlet, the target; per-game win+draw and illegal rates; mean context tokens),
the per-game critic (`critic.py`), and the config. Written against the public API only.

The config: PPO against the per-game critic with self-imitation, as Tic-Tac-Toe's, but no KL
anchor (it held the policy near the random warm start: in 15 minutes the sampled survival
stayed at 0.62 while the greedy one reached 0.85) and sampling at temperature 0.5, so the
gauntlets played for training are about as long as the policy's greedy ones. The 15 minutes
include start-up and the warm start (350 steps of 4 transcripts, ~1 min; it leaves the policy
choosing an occupied square now and then: 16% of the first tenth's gauntlets end on one, 5% of
the last tenth's). Measured on a loaded 2-core machine
(2026-11-26, `earl train --recipe gauntlet`, 378 steps in 15.3 min): eval `games_survived`
0.77 -> 10.4 (per-game win+draw 0.43 -> 0.92, 276 -> 1,583 tokens per gauntlet); p95
trajectory tokens 896 over the first tenth of steps -> 3,628 over the last (4.05x; 1 of 1,184
gauntlets cut by the 4,096-token window). With 8 transcripts per warm-start step and lr 1e-3
the same machine gave 2.9x (0.69 -> 9.7 survived): the result depends on the steps per minute.
"""

from __future__ import annotations

import numpy as np

from earl import (
    ChatCodec,
    Episode,
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
from earl.agents.gauntlet import GauntletConfig, play_gauntlet
from earl.agents.tictactoe import free_squares, legal_move_targets, sim_responder
from earl.envs.tictactoe import winner
from earl.recipes.gauntlet.critic import GameCritic

__all__ = ["EVAL_SEED", "GAUNTLET", "TRAIN_SEED", "agent", "critic", "eval_seeds", "metric",
           "recipe", "safe_squares", "warm_start"]

GAUNTLET = GauntletConfig(max_games=28, survive=1.0, loss=-1.0, opens="opponent")
TRAIN_SEED = 10_000          # training gauntlets: TRAIN_SEED + cursor
EVAL_SEED = 1_000_000_000    # even; evaluation gauntlets never share a seed with training
MAX_MODEL_LEN = 4096         # the tiny model's positions: 28 games of ~130 tokens fit


async def agent(rollout: Rollout, seed: int) -> float:
    """One gauntlet; returns the summed move rewards (games survived minus a loss)."""
    return await play_gauntlet(rollout, seed, GAUNTLET)


def eval_seeds(split: str, step: int, n: int) -> list[object]:
    """`n` held-out episode seeds; "start" and "final" play the same gauntlets, validation
    evals fresh ones per step."""
    base = EVAL_SEED if split in ("start", "final") else EVAL_SEED + 1_000_000 * max(step, 1)
    return list(range(base, base + n))


def metric(episodes: list[Episode]) -> dict[str, float]:
    """Per gauntlet: games survived (the target), games played, context tokens, and the shares
    that reached the cap or were cut; per game played: win, draw, win+draw, loss, illegal.
    A failed gauntlet counts as one game lost."""
    n = max(len(episodes), 1)

    def count(e: Episode, key: str, failed: int = 0) -> int:
        return failed if e.failed else int(e.info.get(key, 0))

    games = max(sum(count(e, "games", 1) for e in episodes), 1)
    wins = sum(count(e, "wins") for e in episodes)
    draws = sum(count(e, "draws") for e in episodes)
    survived = sum(count(e, "survived") for e in episodes)
    return {"episodes": float(len(episodes)), "games_survived": survived / n,
            "games": games / n, "tokens": sum(e.tokens for e in episodes) / n,
            "win_rate": wins / games, "draw_rate": draws / games,
            "win_draw_rate": survived / games, "loss_rate": 1.0 - survived / games,
            "illegal_rate": sum(count(e, "illegal") for e in episodes) / games,
            "cap_rate": sum(count(e, "survived") == GAUNTLET.max_games for e in episodes) / n,
            "truncated_rate": sum(count(e, "truncated") for e in episodes) / n}


def safe_squares(tail: str) -> list[str]:
    """The squares a cautious player picks on the last board of a decoded prompt tail ("cells"
    style): the winning ones if any, else the ones that block O's win, else every free one."""
    free = free_squares(tail)
    rows = tail.rsplit("<|im_end|>", 1)[0].split("\n")[-3:]
    board = "".join("X" if ch.islower() else "O" if ch.isupper() else " "
                    for row in rows for ch in row)
    if len(board) != 9:
        return free

    def completes(square: str, mark: str) -> bool:
        i = int(square) - 1
        return winner(board[:i] + mark + board[i + 1:]) == mark

    return ([s for s in free if completes(s, "X")] or [s for s in free if completes(s, "O")]
            or free)


async def warm_start(codec: ChatCodec, n: int, seed: int) -> tuple[list[object], list[object]]:
    """`n` gauntlets in the exact token format of training with soft targets: at each move
    uniform over the free squares, then 1.0 on the closing token (a random legal player).

    Half are played by a random legal player (its gauntlets end after ~1.7 games); half by one
    that also takes wins and blocks (`safe_squares`), so that the transcripts reach the long
    contexts a learning policy will play in. The targets stay uniform over the legal moves
    either way: the warm start teaches legal play at every context length, not strategy.
    """
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=recipe.max_tokens,
                                                stop_token_ids=codec.stop_ids))
    engines = [SimEngine(SimConfig(time_scale=0.0, seed=seed + j),
                         responder=sim_responder(codec, choices=choices))
               for j, choices in enumerate((free_squares, safe_squares))]
    ids_out: list[object] = []  # int64 token ids per transcript
    tgt_out: list[object] = []  # float64 (pos, token, weight) rows per transcript
    for i in range(n):
        t = await run_agent(agent, seed * 7919 + i, engine=engines[i % 2], codec=codec,
                            config=cfg)
        rows = legal_move_targets(codec, t, free_squares, lookback=48)
        if rows is not None:
            ids_out.append(np.asarray(t.token_ids, dtype=np.int64))
            tgt_out.append(rows)
    return ids_out, tgt_out


def critic() -> GameCritic:
    """Each producer's critic: the Tic-Tac-Toe table over the boards, credited per game."""
    return GameCritic(alpha=0.2, lam=0.5, q_weight=2.0)


recipe = Recipe(
    name="gauntlet",
    agent=agent,
    tasks=SeedTasks(TRAIN_SEED),
    eval=EvalSet(make=eval_seeds),
    metric=metric,
    target_key="games_survived",
    max_tokens=4,
    shared_group_task=False,  # every gauntlet its own seed: the critic learns per game
    failed_reward=GAUNTLET.loss,
    warm_start=warm_start,
    critic=critic,
    config={
        "model": {"max_model_len": MAX_MODEL_LEN},
        "steps": 3000, "batch_size": 32, "group_size": 8, "max_policy_lag": 1,
        "time_limit_minutes": 15.0, "eval_games": 64, "eval_every": 150,
        "checkpoint_every": 50,
        "warm_start": {"steps": 350, "batch_size": 4, "lr": 3e-3},
        "algorithm": {"name": "ppo", "clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0,
                      "critic": "recipe", "self_imitation": 16, "temperature": 0.5},
        "optim": {"lr": 2e-3, "lr_anneal_from": 0.5, "lr_final": 0.1},
    },
)
