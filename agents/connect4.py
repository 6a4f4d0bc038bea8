"""Agent loop for Connect Four: one column digit per move (see `earl.agents.tictactoe`)."""

from __future__ import annotations

from earl.agents.chat import ChatCodec
from earl.agents.rollout import Agent
from earl.agents.tictactoe import make_board_game_agent, sim_responder
from earl.engine import Responder
from earl.envs.connect4 import ROWS, ConnectFour, ConnectFourConfig

__all__ = ["connect4_agent", "connect4_sim_responder", "make_connect4_agent"]


def make_connect4_agent(config: ConnectFourConfig | None = None) -> Agent:
    """An agent `(rollout, seed) -> reward` that plays one Connect Four game as X."""
    return make_board_game_agent(lambda: ConnectFour(config), "Connect Four")


connect4_agent = make_connect4_agent()


def _open_columns(tail: str) -> list[str]:
    lines = tail.rsplit("<|im_end|>", 1)[0].split("\n")
    if len(lines) < ROWS + 1:
        return []
    top = lines[-ROWS - 1]
    return [str(i + 1) for i, ch in enumerate(top) if ch == "."]


def connect4_sim_responder(codec: ChatCodec, *, illegal_rate: float = 0.0) -> Responder:
    """Random open column, read off the last board in the prompt."""
    return sim_responder(codec, choices=_open_columns, illegal_rate=illegal_rate, tail_tokens=80)
