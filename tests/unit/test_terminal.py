"""What `earl train` shows a person: piped, a line per tenth of the run plus every event;
`--quiet`, nothing; on a terminal, a live bar with the events above it."""

from __future__ import annotations

import io

from earl.commands.terminal import Terminal


def row(step: int, steps: int, wall_s: float) -> dict[str, object]:
    return {"step": step, "steps": steps, "reward": 0.5, "tokens_per_s": 1000.0,
            "staleness": 0.0, "wall_s": wall_s}


def test_piped_output_is_a_line_per_tenth_of_the_run_and_each_event() -> None:
    out = io.StringIO()
    t = Terminal(out, time_limit_s=0, live=False)
    for s in range(1, 1001):
        t.step(row(s, 1000, s * 0.5))
        if s % 100 == 0:
            t.event(f"eval @ step {s}: reward 0.5")
    t.close()
    lines = out.getvalue().splitlines()
    progress = [x for x in lines if x.startswith("step ")]
    assert len(progress) == 10 and progress[-1].startswith("step 1000/1000")
    assert sum(x.startswith("eval @") for x in lines) == 10


def test_a_time_limit_paces_the_lines_when_it_comes_first() -> None:
    out = io.StringIO()
    t = Terminal(out, time_limit_s=100.0, live=False)
    for s in range(1, 401):  # 400 of 2000 steps in the 100 s limit
        t.step(row(s, 2000, s * 0.25))
    t.close()
    assert len(out.getvalue().splitlines()) == 10  # by time, not by the 20% of steps done


def test_quiet_shows_nothing() -> None:
    out = io.StringIO()
    t = Terminal(out, quiet=True, live=False)
    t.step(row(1, 2, 1.0))
    t.event("eval")
    t.close()
    assert out.getvalue() == ""


def test_a_live_bar_prints_events_above_it() -> None:
    out = io.StringIO()
    t = Terminal(out, live=True)
    t.step(row(1, 4, 1.0))
    t.event("healing: producer[0] restarted")
    t.step({**row(2, 4, 2.0), "failed_rate": 0.25})
    t.close()
    text = out.getvalue()
    assert "healing: producer[0] restarted" in text and "step 2/4" in text
