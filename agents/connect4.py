"""Agent loop for Connect Four: one column digit per move, the whole game in context.

Like `earl.agents.tictactoe`: one assistant turn per move, each observation (the opponent's
reply and the re-rendered board) appended to the same conversation, so the context holds the
full move history and grows every move (~70 tokens a move with the char-level tokenizer). The
sample is the game seed: even seeds open the game, odd seeds let the random opponent open.
Rewards: win 1, draw 0.5, loss or illegal move -1 (per-move credit in `turn_rewards`);
`rollout.info` gets {"outcome", "illegal", "moves", "seed"}.

Example:
    >>> traj = await run_agent(connect4_agent, 7, engine=engine, codec=codec)
"""

from __future__ import annotations

from earl.agents.chat import ChatCodec
from earl.agents.rollout import Agent, Rollout
from earl.agents.tictactoe import make_board_game_agent, play_board_game, sim_responder
from earl.engine import Responder
from earl.envs.connect4 import ROWS, ConnectFour, ConnectFourConfig

__all__ = ["connect4_agent", "connect4_sim_responder", "game_config", "make_connect4_agent",
           "open_columns"]


def game_config(agent_first: bool) -> ConnectFourConfig:
    """The rules `connect4_agent` plays by (random opponent; an illegal move loses)."""
    return ConnectFourConfig(opponent="random", agent_first=agent_first, win=1.0, draw=0.5,
                             loss=-1.0, illegal=-1.0)


_CONFIGS = {first: game_config(first) for first in (True, False)}


async def connect4_agent(rollout: Rollout, sample: object) -> float:
    """Play one game as X against the random opponent; `sample` is the seed (int)."""
    if not isinstance(sample, int) or isinstance(sample, bool):
        raise TypeError(f"the Connect Four sample is the game seed (int), got "
                        f"{type(sample).__name__}")
    rollout.info["seed"] = sample
    return await play_board_game(rollout, ConnectFour(_CONFIGS[sample % 2 == 0]), sample)


def make_connect4_agent(config: ConnectFourConfig | None = None) -> Agent:
    """An agent `(rollout, seed) -> reward` playing by `config` (in-process use)."""
    return make_board_game_agent(lambda: ConnectFour(config), "Connect Four")


def open_columns(tail: str) -> list[str]:
    """The open columns' digits on the last board in a decoded prompt tail."""
    lines = tail.rsplit("<|im_end|>", 1)[0].split("\n")
    if len(lines) < ROWS + 1:
        return []
    top = lines[-ROWS - 1]
    return [str(i + 1) for i, ch in enumerate(top) if ch == "."]


def connect4_sim_responder(codec: ChatCodec, *, illegal_rate: float = 0.0) -> Responder:
    """Random open column, read off the last board in the prompt."""
    return sim_responder(codec, choices=open_columns, illegal_rate=illegal_rate, tail_tokens=80)
