"""Agent loops for the board games: Tic-Tac-Toe (and Connect Four via `play_board_game`).

The model sees the board, answers with one digit, the opponent replies, the board is shown
again: one assistant turn per move, so the context grows every move. Each move's reward goes
to `rollout.turn_rewards` (per-move credit) and the episode's outcome to `rollout.info`
({"outcome": "win"|"draw"|"loss", "illegal": 0/1, "moves": n}). The sample is the game seed.
`sim_responder` plays random legal moves for the simulated engine (stress tests).

Example:
    >>> traj = await run_agent(tictactoe_agent, 7, engine=engine, codec=codec)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Protocol

import numpy as np

from earl.agents.chat import ChatCodec
from earl.agents.rollout import Agent, Rollout
from earl.engine import Responder
from earl.envs.base import StepResult
from earl.envs.tictactoe import TicTacToe, TicTacToeConfig
from earl.runtime.types import Trajectory

__all__ = ["free_squares", "legal_move_targets", "make_board_game_agent",
           "make_tictactoe_agent", "play_board_game", "sim_responder", "tictactoe_agent"]


class _Game(Protocol):  # what play_board_game needs from an env
    def reset(self, seed: int = 0) -> str: ...
    def step(self, action: str) -> StepResult: ...


async def play_board_game(rollout: Rollout, env: _Game, seed: int) -> float:
    """Play one game of `env` (reset with `seed`); return the summed per-move rewards."""
    messages = [{"role": "user", "content": env.reset(seed)}]
    total = 0.0
    while True:
        turn = await rollout.generate(messages)
        messages.append(turn.message)
        if turn.finish_reason == "budget":  # trajectory cap: no move was generated
            rollout.info.update(outcome="loss", illegal=0, truncated=1)
            return total
        step = env.step(turn.text)
        rollout.turn_rewards.append(step.reward)
        total += step.reward
        if step.done:
            rollout.info.update(step.info)
            return total
        messages.append({"role": "user", "content": step.observation})


def make_board_game_agent(new_env: Callable[[], _Game], game: str) -> Agent:
    """An agent `(rollout, seed) -> reward` that plays one game of `new_env()` as X."""

    async def board_game_agent(rollout: Rollout, sample: object) -> float:
        if not isinstance(sample, int):
            raise TypeError(f"the {game} sample is the game seed (int), got "
                            f"{type(sample).__name__}")
        return await play_board_game(rollout, new_env(), sample)

    return board_game_agent


def make_tictactoe_agent(config: TicTacToeConfig | None = None) -> Agent:
    """An agent `(rollout, seed) -> reward` that plays one Tic-Tac-Toe game as X."""
    return make_board_game_agent(lambda: TicTacToe(config), "Tic-Tac-Toe")


tictactoe_agent = make_tictactoe_agent()


def sim_responder(codec: ChatCodec, *, choices: Callable[[str], list[str]] | None = None,
                  illegal_rate: float = 0.0, tail_tokens: int = 48) -> Responder:
    """A SimEngine responder that answers with a random legal move read off the last board.

    Args:
        codec: the chat codec (to decode the prompt tail and encode the move).
        choices: legal moves from the decoded prompt tail; default: Tic-Tac-Toe's free digits.
        illegal_rate: probability of answering with an occupied/invalid square instead.
        tail_tokens: how much of the prompt to decode.
    """
    pick = choices or free_squares
    encoded = {ch: codec.encode_text(ch) + [codec.end_id] for ch in "0123456789"}

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        moves = pick(codec.decode(prompt_ids[-tail_tokens:]))
        if not moves or rng.random() < illegal_rate:
            return encoded["0"]
        return encoded[rng.choice(moves)]

    return respond


def free_squares(tail: str) -> list[str]:
    """The free squares' digits on the last board in a decoded prompt tail (either style)."""
    board = tail.rsplit("<|im_end|>", 1)[0].split("\n")[-3:]
    return [ch for row in board for ch in row if ch in "123456789"]


def legal_move_targets(codec: ChatCodec, traj: Trajectory, legal_moves: Callable[[str], list[str]],
                       *, lookback: int) -> np.ndarray | None:
    """Warm-start targets for one game of a random legal player, as `(pos, token, weight)`
    rows: at each move uniform over the legal moves (read from the last `lookback` tokens
    before it), then 1.0 on the closing token. None when no move qualifies."""
    rows: list[tuple[int, int, float]] = []
    for start, end in traj.turn_spans:
        legal = legal_moves(codec.decode(traj.token_ids[max(0, start - lookback):start]))
        if not legal or end - start < 2:
            continue
        rows += [(start, codec.encode_text(d)[0], 1.0 / len(legal)) for d in legal]
        rows.append((start + 1, codec.end_id, 1.0))
    return np.asarray(rows, dtype=np.float64) if rows else None
