"""The tally of why episodes failed: their distinct error texts, counted, for the user to see.

A run keeps one `Failures` in its `LoopState` (so a resume keeps counting). The schedule adds
each trained batch's failed episodes; the progress line, `run.log`, the final JSON
(`failures`, `failed_episodes`) and the error that stops a run show what it holds. Texts are
kept in the order first seen, at most `DISTINCT` of them and `TEXT_CHARS` each; later new texts
count under `OTHER`, so a run whose errors all differ (a sample id in each) stays bounded.

This module decides nothing: a failed episode is the agent's outcome, not a fault to heal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["DISTINCT", "OTHER", "TEXT_CHARS", "add_failures", "describe", "failures_json"]

DISTINCT = 20
TEXT_CHARS = 500
OTHER = "(other errors)"


class Failed(Protocol):
    @property
    def failed(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


def add_failures(tally: dict[str, int], episodes: Iterable[Failed]) -> list[str]:
    """Count the failed ones of `episodes` into `tally` (error text -> episodes); returns the
    texts seen for the first time."""
    new: list[str] = []
    for e in episodes:
        if not e.failed:
            continue
        text = (e.error or "failed without an error text").strip()[:TEXT_CHARS]
        if text not in tally and len(tally) >= DISTINCT:
            text = OTHER
        if text not in tally:
            new.append(text)
        tally[text] = tally.get(text, 0) + 1
    return new


def describe(tally: dict[str, int], *, top: int = 3, chars: int = 200) -> str:
    """`12x RuntimeError: no such tool; 3x TimeoutError: ...` (the most frequent first)."""
    ranked = sorted(tally.items(), key=lambda kv: -kv[1])[:top]
    shown = [f"{n}x {_short(text, chars)}" for text, n in ranked]
    rest = len(tally) - len(ranked)
    return "; ".join(shown) + (f"; and {rest} other error texts" if rest > 0 else "")


def failures_json(tally: dict[str, int]) -> list[dict[str, object]]:
    """The JSON `failures`: each distinct text with its episodes, in the order first seen."""
    return [{"error": text, "episodes": n} for text, n in tally.items()]


def _short(text: str, chars: int) -> str:
    line = " ".join(text.split())
    return line if len(line) <= chars else line[:chars - 3] + "..."
