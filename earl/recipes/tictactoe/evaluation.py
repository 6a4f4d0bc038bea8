"""The Tic-Tac-Toe recipe's evaluation: N games against the random opponent, greedy decoding.

Games alternate the first move (even game index: the agent opens; odd: the opponent opens). An
illegal or unparseable move loses the game (the environment's rule). `summarize` turns finished
games into the rates the recipe's metric reports; `evaluate` plays a whole greedy evaluation
through any `earl.Engine` with the same agent loop used for training (`earl train` instead
plays the recipe's eval seeds on its rollout actors). This module does not train and does not
start actors.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from earl import ChatCodec, Engine, RolloutConfig, SamplingParams, Trajectory, run_agent
from earl.agents.tictactoe import play_board_game
from earl.envs.tictactoe import TicTacToe, TicTacToeConfig

EVAL_SEED = 1_000_000_000  # even; eval games never share a seed with training games


@dataclass(kw_only=True, slots=True)
class EvalResult:
    """Outcome rates over `games` games (`win_rate + draw_rate + loss_rate == 1`)."""

    games: int
    win_rate: float
    draw_rate: float
    loss_rate: float
    illegal_rate: float
    first_win_draw: float
    second_win_draw: float

    @property
    def win_draw(self) -> float:
        return self.win_rate + self.draw_rate

    def to_dict(self) -> dict[str, float | int]:
        d = asdict(self)
        d["win_draw_rate"] = self.win_draw
        return d


def env_config(agent_first: bool, *, win: float = 1.0, draw: float = 0.5, loss: float = -1.0,
               opponent: str = "random") -> TicTacToeConfig:
    """The Tic-Tac-Toe rules used for training and evaluation (illegal = loss = `loss`)."""
    return TicTacToeConfig(opponent=opponent, agent_first=agent_first, win=win, draw=draw,
                           loss=loss, illegal=loss)


def make_agent(win: float = 1.0, draw: float = 0.5, loss: float = -1.0):
    """Agent `(rollout, seed) -> reward`: even seeds open the game, odd seeds play second."""
    configs = {first: env_config(first, win=win, draw=draw, loss=loss) for first in (True, False)}

    async def agent(rollout, seed: int) -> float:
        return await play_board_game(rollout, TicTacToe(configs[seed % 2 == 0]), seed)

    return agent


def summarize(trajs: list[Trajectory]) -> EvalResult:
    """Rates from finished games; a failed trajectory counts as a loss."""
    n = len(trajs)
    if n == 0:
        raise ValueError("summarize() needs at least one game")

    def outcome(t: Trajectory) -> str:
        return "loss" if t.failed else str(t.info.get("outcome", "loss"))

    first = [t for t in trajs if int(t.info.get("seed", 0)) % 2 == 0]
    second = [t for t in trajs if int(t.info.get("seed", 0)) % 2 == 1]

    def wd(ts: list[Trajectory]) -> float:
        return sum(outcome(t) in ("win", "draw") for t in ts) / max(len(ts), 1)

    return EvalResult(
        games=n,
        win_rate=sum(outcome(t) == "win" for t in trajs) / n,
        draw_rate=sum(outcome(t) == "draw" for t in trajs) / n,
        loss_rate=sum(outcome(t) == "loss" for t in trajs) / n,
        illegal_rate=sum(int(t.info.get("illegal", 0)) for t in trajs) / n,
        first_win_draw=wd(first),
        second_win_draw=wd(second),
    )


async def evaluate(engine: Engine, codec: ChatCodec, *, games: int = 200,
                   seed: int = EVAL_SEED, max_tokens: int = 4) -> EvalResult:
    """Play `games` greedy games (temperature 0) against the random opponent."""
    if games < 2 or games % 2:
        raise ValueError(f"games={games} must be an even number >= 2 (first/second alternate)")
    agent = make_agent()
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                stop_token_ids=list(codec.stop_ids)))

    async def one(i: int) -> Trajectory:
        s = seed - seed % 2 + i  # even seed: the agent opens; odd: the opponent opens
        t = await run_agent(agent, s, engine=engine, codec=codec, config=cfg,
                            sample_id=f"eval-{i}")
        t.info["seed"] = s
        return t

    trajs = await asyncio.gather(*(one(i) for i in range(games)))
    return summarize(list(trajs))
