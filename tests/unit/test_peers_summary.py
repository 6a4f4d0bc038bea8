"""bench/peers.py's summary: the same-work check and issue 47's goals, on a saved result."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load

RESULT = Path(__file__).resolve().parents[2] / "bench/results/peers-2026-11-29-quick-2.json"


def test_same_work_compares_turns_and_model_tokens_per_trajectory() -> None:
    s = load("_peers_summary")
    r = json.loads(RESULT.read_text())["result"]
    work = s.same_work(r["earl"], r["trl_best"])
    turns = work["turns_per_trajectory"]
    assert (turns["earl"], turns["trl_best"], turns["within_5pct"]) == (3.06, 2.97, True)
    tokens = work["model_tokens_per_trajectory"]  # 3146.2 / 129.06 and 1110.3 / 47.2
    assert (tokens["earl"], tokens["trl_best"], tokens["within_5pct"]) == (24.38, 23.52, True)
    over = s.same_work(r["earl_over_sampled"], r["trl_best"])  # shorter episodes: not the same
    assert not over["turns_per_trajectory"]["within_5pct"]


def test_goals_read_the_done_when_off_a_result() -> None:
    s = load("_peers_summary")
    r = json.loads(RESULT.read_text())["result"]
    g = s.goals({**r, **s.same_work(r["earl"], r["trl_best"])})
    assert g == {"ratio_trajectories_per_s>=2.5": True, "ratio_trajectories_per_cpu_s>=1.5": True,
                 "eval.earl>=eval.trl_best": True, "turns_per_trajectory_within_5pct": True,
                 "straggler_wait_share<=0.10": False}  # 0.478 in that run
