"""The `connect4` recipe: Connect Four against the random opponent, the whole game in context.

EARL's evaluation game for growing contexts: one assistant turn per move, every board kept in
the conversation (`earl.agents.connect4.connect4_agent`), so trajectories run from ~100 to
~1,500 tokens. Samples are game seeds (even: the agent opens; odd: the opponent does); a GRPO
group plays one seed. The warm start imitates random *legal* games (soft targets uniform over
the open columns, as Tic-Tac-Toe's does); evals play greedy games on seeds no training game
uses, alternating the first move, and report Tic-Tac-Toe's keys (`win_draw_rate` is the target).

Written against the public API only (`earl`, and the task's agent in `earl.agents`).
"""

from __future__ import annotations

import numpy as np

from earl import (
    ChatCodec,
    Episode,
    EvalSet,
    Recipe,
    RolloutConfig,
    SamplingParams,
    SeedTasks,
    SimConfig,
    SimEngine,
    run_agent,
)
from earl.agents.connect4 import connect4_agent, connect4_sim_responder, open_columns
from earl.agents.tictactoe import legal_move_targets

__all__ = ["EVAL_SEED", "connect4_metric", "eval_seeds", "recipe", "warm_start"]

EVAL_SEED = 2_000_000_000  # even; training seeds (SeedTasks) stay far below it
_SPLIT_OFFSET = {"start": 0, "final": 0, "validation": 100_000}


def eval_seeds(split: str, step: int, n: int) -> list[object]:
    """`n` held-out seeds, half opening and half second. "start" and "final" play the same
    games; "validation" (model selection) plays others."""
    base = EVAL_SEED + _SPLIT_OFFSET.get(split, 200_000)
    return list(range(base, base + n))


def _outcome(e: Episode) -> str:
    return "loss" if e.failed else str(e.info.get("outcome", "loss"))


def connect4_metric(episodes: list[Episode]) -> dict[str, float]:
    """Outcome rates (a failed episode is a loss), the illegal-move rate, win+draw overall and
    when opening / playing second, and the mean moves per game."""
    n = max(len(episodes), 1)
    out = {k: sum(_outcome(e) == k for e in episodes) / n for k in ("win", "draw", "loss")}
    first = [e for e in episodes if int(e.info.get("seed", 0)) % 2 == 0]
    second = [e for e in episodes if int(e.info.get("seed", 0)) % 2 == 1]

    def wd(es: list[Episode]) -> float:
        return sum(_outcome(e) in ("win", "draw") for e in es) / max(len(es), 1)

    return {"games": float(len(episodes)), "win_rate": out["win"], "draw_rate": out["draw"],
            "loss_rate": out["loss"],
            "illegal_rate": sum(int(e.info.get("illegal", 0)) for e in episodes) / n,
            "win_draw_rate": out["win"] + out["draw"],
            "first_win_draw": wd(first), "second_win_draw": wd(second),
            "moves": sum(int(e.info.get("moves", 0)) for e in episodes) / n}


async def warm_start(codec: ChatCodec, n: int, seed: int
                     ) -> tuple[list[object], list[object]]:
    """`n` random legal games in the exact token format of training, with soft targets:
    uniform over the open columns at each move, then 1.0 on the turn's closing token."""
    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed),
                       responder=connect4_sim_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=recipe.max_tokens,
                                                stop_token_ids=codec.stop_ids))
    ids_out: list[object] = []  # int64 token ids per transcript
    tgt_out: list[object] = []  # float64 (pos, token, weight) rows per transcript
    for i in range(n):
        t = await run_agent(connect4_agent, seed * 7919 + i, engine=engine, codec=codec,
                            config=cfg)
        rows = legal_move_targets(codec, t, open_columns, lookback=80)
        if rows is not None:
            ids_out.append(np.asarray(t.token_ids, dtype=np.int64))
            tgt_out.append(rows)
    return ids_out, tgt_out


recipe = Recipe(
    name="connect4",
    agent=connect4_agent,
    tasks=SeedTasks(offset=0),
    eval=EvalSet(make=eval_seeds),
    metric=connect4_metric,
    target_key="win_draw_rate",
    max_tokens=4,
    shared_group_task=True,
    warm_start=warm_start,
    config={
        "model": {"max_model_len": 2048},
        "batch_size": 32,
        "group_size": 8,
        "warm_start": {"steps": 100, "batch_size": 16, "lr": 3e-3},
        "algorithm": {"name": "grpo", "critic": "none"},
    },
)
