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
                          "failed_rate": 0.25, "groups_cut": 2})
    assert line == ("step 3/10 | reward +0.25 | win 0.50 draw 0.12 | failed 0.25 | "
                    "2 groups cut | 3.1k tok/s | staleness 0.9 | 41 s")
    assert "cut" not in progress_line({**BASE, "groups_cut": 0})
