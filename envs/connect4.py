"""Connect Four (7 columns x 6 rows) against a scripted opponent, one column digit per move.

The model plays X and answers with a column 1-7 (`agent_first=False`: the opponent opens). Each
observation names the opponent's reply and re-renders the board top row first, "." for empty,
with the column digits underneath. An unparseable move or a full column
loses. The "minimax" opponent searches a few plies for forced wins and blocks; "random" plays
any open column. Plain synchronous code; `earl.agents.connect4` plays it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from earl.envs.base import GameConfig, StepResult, first_digit

_UNSEEDED = random.Random(0)  # placeholder until reset(seed); step() refuses before it
__all__ = ["ConnectFour", "ConnectFourConfig"]

ROWS, COLS = 6, 7
INTRO = "ConnectFour. You are X. Reply with a column digit 1-7.\n"


@dataclass(kw_only=True, slots=True)
class ConnectFourConfig(GameConfig):
    """Rules and rewards (see `GameConfig`).

    Args:
        depth: the minimax opponent's search depth in plies.
        agent_first: X moves first; otherwise the opponent opens.
    """

    depth: int = 3
    agent_first: bool = True

    def __post_init__(self) -> None:
        GameConfig.__post_init__(self)  # zero-arg super() fails in slotted dataclasses
        if not 1 <= self.depth <= 6:
            raise ValueError(f"ConnectFourConfig.depth must be in 1..6, got {self.depth}")


class ConnectFour:
    """One game; `grid[r][c]` with row 0 at the bottom."""

    def __init__(self, config: ConnectFourConfig | None = None) -> None:
        self.config = config or ConnectFourConfig()
        self.grid = [[" "] * COLS for _ in range(ROWS)]
        self.rng = _UNSEEDED  # replaced by reset(seed)
        self.moves = 0
        self.done = True

    def render(self) -> str:
        rows = ["".join(c if c != " " else "." for c in self.grid[r]) for r in range(ROWS - 1, -1, -1)]
        return "\n".join(rows) + "\n1234567"

    def open_columns(self) -> list[int]:
        return [c for c in range(COLS) if self.grid[ROWS - 1][c] == " "]

    def _drop(self, c: int, mark: str) -> int:
        for r in range(ROWS):
            if self.grid[r][c] == " ":
                self.grid[r][c] = mark
                return r
        raise AssertionError("column is full")

    def _wins(self, r: int, c: int) -> bool:
        mark = self.grid[r][c]
        for dr, dc in ((0, 1), (1, 0), (1, 1), (1, -1)):
            n = 1
            for s in (1, -1):
                rr, cc = r + s * dr, c + s * dc
                while 0 <= rr < ROWS and 0 <= cc < COLS and self.grid[rr][cc] == mark:
                    n += 1
                    rr, cc = rr + s * dr, cc + s * dc
            if n >= 4:
                return True
        return False

    def _negamax(self, mark: str, depth: int) -> int:
        """Value for `mark` to move: +1 forced win, -1 forced loss, 0 unknown, within `depth`."""
        cols = self.open_columns()
        if depth == 0 or not cols:
            return 0
        other = "O" if mark == "X" else "X"
        best = -1
        for c in cols:
            r = self._drop(c, mark)
            v = 1 if self._wins(r, c) else -self._negamax(other, depth - 1)
            self.grid[r][c] = " "
            best = max(best, v)
            if best == 1:
                break
        return best

    def _opponent(self) -> int:
        cols = self.open_columns()
        if self.config.opponent == "random":
            return self.rng.choice(cols)
        values = {}
        for c in cols:
            r = self._drop(c, "O")
            values[c] = 1 if self._wins(r, c) else -self._negamax("X", self.config.depth - 1)
            self.grid[r][c] = " "
        best = max(values.values())
        return self.rng.choice([c for c in cols if values[c] == best])

    def reset(self, seed: int = 0) -> str:
        self.rng = random.Random(seed)
        self.grid = [[" "] * COLS for _ in range(ROWS)]
        self.moves, self.done = 0, False
        if not self.config.agent_first:
            c = self._opponent()
            self._drop(c, "O")
            return f"{INTRO}O took {c + 1}\n{self.render()}"
        return INTRO + self.render()

    def _end(self, reward: float, outcome: str, illegal: int) -> StepResult:
        self.done = True
        return StepResult(observation="", reward=reward, done=True,
                          info={"outcome": outcome, "illegal": illegal, "moves": self.moves})

    def step(self, action: str) -> StepResult:
        if self.done:
            raise ValueError("the game is over; call reset(seed) to start a new one")
        cfg = self.config
        col = first_digit(action, 1, COLS)
        if col is None or self.grid[ROWS - 1][col - 1] != " ":
            return self._end(cfg.illegal, "loss", 1)
        self.moves += 1
        r = self._drop(col - 1, "X")
        if self._wins(r, col - 1):
            return self._end(cfg.win, "win", 0)
        if not self.open_columns():
            return self._end(cfg.draw, "draw", 0)
        c = self._opponent()
        r = self._drop(c, "O")
        if self._wins(r, c):
            return self._end(cfg.loss, "loss", 0)
        if not self.open_columns():
            return self._end(cfg.draw, "draw", 0)
        return StepResult(observation=f"O took {c + 1}\n{self.render()}", reward=cfg.legal_move,
                          done=False)
