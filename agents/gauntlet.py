"""Agent loop for a Tic-Tac-Toe gauntlet: game after game in one conversation, until a loss.

One episode is a run of Tic-Tac-Toe games against the random opponent in ONE context: each new
game is opened by a short user message (the last game's result) and the fresh board, the
earlier games stay in the conversation, and the gauntlet ends at the agent's first loss (an
illegal move loses) or after `max_games` games. A better policy survives more games, so its
contexts grow because it plays better, not because a schedule says so.

Game k of the episode with seed s is a fresh `TicTacToe` reset with seed `s * SEED_STRIDE + k`;
who opens it is `GauntletConfig.opens` (the agent, the opponent, or alternating). Rewards (per
move, in `rollout.turn_rewards`): 0 for a move that does not end its game, `survive` for the
last move of a won or drawn game, `loss` for a losing or illegal move; the episode's reward is
their sum. `rollout.info` gets {"games": played, "survived": won + drawn, "wins", "draws",
"outcome": the last game's ("win", "draw", "loss"; "none" before any game ended), "illegal":
0/1, "truncated": 0/1, "moves", "seed"} (counts, not a per-game string: the run's metrics
count every distinct string value of an info key). When the trajectory cap cuts the conversation
(`finish_reason == "budget"`) the unfinished game counts neither as survived nor as lost.
This module plays; it does not train, evaluate or know about critics.

Example:
    >>> traj = await run_agent(gauntlet_agent, 8, engine=engine, codec=codec)
    >>> traj.info["games"], traj.info["survived"], traj.info["outcome"]
    (4, 3, 'loss')
"""

from __future__ import annotations

from dataclasses import dataclass

from earl.agents.chat import Message
from earl.agents.rollout import Agent, Rollout
from earl.envs.tictactoe import TicTacToe, TicTacToeConfig

__all__ = ["OPENS", "SEED_STRIDE", "GauntletConfig", "game_seed", "gauntlet_agent",
           "make_gauntlet_agent", "play_gauntlet"]

SEED_STRIDE = 1000  # game seeds of episode s: s * SEED_STRIDE + k, k < max_games <= SEED_STRIDE
OPENS = ("agent", "opponent", "alternate")
_HEADER = {"win": "Win. Next game:\n", "draw": "Draw. Next game:\n"}


@dataclass(kw_only=True, slots=True)
class GauntletConfig:
    """Length and rewards of a gauntlet.

    Args:
        max_games: the gauntlet ends after this many games even without a loss.
        survive: reward of the last move of a won or drawn game.
        loss: reward of a losing or illegal move (it ends the gauntlet).
        opens: who makes the first move of each game: "agent", "opponent", or "alternate"
            (game k of the episode with seed s: the agent when s + k is even).
    """

    max_games: int = 24
    survive: float = 1.0
    loss: float = -1.0
    opens: str = "alternate"

    def __post_init__(self) -> None:
        if not 1 <= self.max_games <= SEED_STRIDE:
            raise ValueError(f"GauntletConfig.max_games must be in [1, {SEED_STRIDE}], got "
                             f"{self.max_games}")
        if self.survive <= 0 or self.loss >= 0:
            raise ValueError(f"GauntletConfig needs survive > 0 and loss < 0 (got survive="
                             f"{self.survive}, loss={self.loss}): surviving must pay and a "
                             "loss must cost")

        if self.opens not in OPENS:
            raise ValueError(f"GauntletConfig.opens must be one of {OPENS}, got {self.opens!r}")

    def agent_opens(self, seed: int, k: int) -> bool:
        """Whether the agent makes the first move of game `k` of episode `seed`."""
        return self.opens == "agent" or (self.opens == "alternate" and (seed + k) % 2 == 0)

    def game(self, agent_first: bool) -> TicTacToeConfig:
        """The rules of one game of the gauntlet (a draw survives like a win)."""
        return TicTacToeConfig(opponent="random", agent_first=agent_first, win=self.survive,
                               draw=self.survive, loss=self.loss, illegal=self.loss)


def game_seed(seed: int, k: int) -> int:
    """The seed of game `k` of the gauntlet with episode seed `seed`."""
    return seed * SEED_STRIDE + k


async def play_gauntlet(rollout: Rollout, seed: int, config: GauntletConfig) -> float:
    """Play one gauntlet (see the module docstring); return the summed move rewards."""
    rules = {first: config.game(first) for first in (True, False)}
    messages: list[Message] = []
    outcomes: list[str] = []
    moves, total = 0, 0.0
    rollout.info.update(seed=seed, illegal=0, truncated=0)
    for k in range(config.max_games):
        env = TicTacToe(rules[config.agent_opens(seed, k)])
        first = env.reset(game_seed(seed, k))
        messages.append({"role": "user", "content": first if k == 0 else
                         _HEADER[outcomes[-1]] + env.render()})
        while True:
            turn = await rollout.generate(messages)
            messages.append(turn.message)
            if turn.finish_reason == "budget":  # trajectory cap: no move was generated
                rollout.info["truncated"] = 1
                return _close(rollout, outcomes, moves, total)
            step = env.step(turn.text)
            moves += 1
            rollout.turn_rewards.append(step.reward)
            total += step.reward
            if step.done:
                break
            messages.append({"role": "user", "content": step.observation})
        outcomes.append(str(step.info["outcome"]))
        if outcomes[-1] == "loss":
            rollout.info["illegal"] = int(step.info["illegal"])
            break
    return _close(rollout, outcomes, moves, total)


def _close(rollout: Rollout, outcomes: list[str], moves: int, total: float) -> float:
    wins, draws = outcomes.count("win"), outcomes.count("draw")
    rollout.info.update(games=len(outcomes), survived=wins + draws, wins=wins, draws=draws,
                        outcome=outcomes[-1] if outcomes else "none", moves=moves)
    return total


def make_gauntlet_agent(config: GauntletConfig | None = None) -> Agent:
    """An agent `(rollout, seed) -> reward` playing gauntlets by `config` (in-process use;
    a producer process imports a module-level agent instead)."""
    cfg = config or GauntletConfig()

    async def agent(rollout: Rollout, sample: object) -> float:
        if not isinstance(sample, int) or isinstance(sample, bool):
            raise TypeError(f"the gauntlet sample is the episode seed (int), got "
                            f"{type(sample).__name__}")
        return await play_gauntlet(rollout, sample, cfg)

    return agent


gauntlet_agent = make_gauntlet_agent()
