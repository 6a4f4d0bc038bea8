"""The per-step progress line of `earl train`: what it shows, and only when it applies."""

from __future__ import annotations

from earl.observe import progress_line

BASE = {"step": 3, "steps": 10, "reward": 0.25, "tokens_per_s": 3100.0, "staleness": 0.9,
        "wall_s": 41.2}


def test_a_plain_step() -> None:
    assert progress_line(BASE) == ("step 3/10 | reward +0.25 | 3.1k tok/s | staleness 0.9 "
                                   "| 41 s")


def test_outcomes_failures_and_cut_groups_show_when_present() -> None:
    line = progress_line({**BASE, "info/outcome=win": 0.5, "info/outcome=draw": 0.125,
                          "failed_rate": 0.25, "failed_error": "2x KeyError: 'calc'",
                          "groups_cut": 2})
    assert line == ("step 3/10 | reward +0.25 | win 0.50 draw 0.12 | failed 0.25 (2x KeyError: "
                    "'calc') | 2 groups cut | 3.1k tok/s | staleness 0.9 | 41 s")
    assert "cut" not in progress_line({**BASE, "groups_cut": 0})


def test_the_failure_tally_keeps_distinct_texts_bounded() -> None:
    from dataclasses import dataclass

    from earl.loop.failures import DISTINCT, OTHER, add_failures, describe, failures_json

    @dataclass
    class Ep:
        failed: bool
        error: str | None

    tally: dict[str, int] = {}
    new = add_failures(tally, [Ep(True, "E: a"), Ep(False, None), Ep(True, "E: a"),
                               Ep(True, "E: b")])
    assert new == ["E: a", "E: b"] and tally == {"E: a": 2, "E: b": 1}
    assert add_failures(tally, [Ep(True, "E: a")]) == []  # seen before: not new
    assert describe(tally) == "3x E: a; 1x E: b"
    add_failures(tally, [Ep(True, f"E: sample {i}") for i in range(3 * DISTINCT)])
    assert len(tally) == DISTINCT + 1 and tally[OTHER] == 3 * DISTINCT - (DISTINCT - 2)
    assert failures_json(tally)[0] == {"error": "E: a", "episodes": 3}
