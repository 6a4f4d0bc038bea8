"""What every board-game environment returns from `step`, and the move parser they share.

Environments here are plain synchronous Python (reset(seed) / step(action)); they know nothing
about tokens or engines. Agent loops in `earl.agents` wrap them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["GameConfig", "StepResult", "first_digit"]


@dataclass(kw_only=True, slots=True)
class StepResult:
    """Outcome of one `step`.

    Attributes:
        observation: text for the model's next turn ("" when done).
        reward: reward for this move (per-move credit).
        done: the episode is over.
        info: on the last step: {"outcome": "win"|"draw"|"loss", "illegal": 0/1, "moves": n}.
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, float | int | str] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class GameConfig:
    """Opponent and rewards shared by the board games.

    Args:
        opponent: "random" or "minimax".
        win, draw, loss: final-move rewards.
        illegal: reward of an unparseable/illegal move (the game is lost).
        legal_move: reward for every legal non-final move (format shaping; 0 disables).
    """

    opponent: str = "random"
    win: float = 1.0
    draw: float = 0.5
    loss: float = 0.0
    illegal: float = -1.0
    legal_move: float = 0.0

    def __post_init__(self) -> None:
        if self.opponent not in ("random", "minimax"):
            raise ValueError(f"{type(self).__name__}.opponent must be 'random' or 'minimax', "
                             f"got {self.opponent!r}")


def first_digit(text: str, lo: int, hi: int) -> int | None:
    """The first digit in [lo, hi] in `text` once leading whitespace/quotes are skipped.

    Robust to "5", " 5\\n", "Move: 5" and "<5>"; returns None when the first digit found is
    out of range or there is none, so "0" or "9" on a 1-7 board is unparseable.
    """
    for ch in text:
        if ch.isdigit():
            d = ord(ch) - 48
            return d if lo <= d <= hi else None
    return None
