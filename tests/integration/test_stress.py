"""`earl stress` end to end: many sim sessions, all completed; executor comparison; bad input."""

from __future__ import annotations

import json

import pytest

from earl.commands.stress import main

KEYS = ("sessions_completed", "sessions_failed", "turns_per_s", "act_p50_ms", "act_p99_ms",
        "engine_idle_fraction", "peak_rss_mb", "overhead_us_per_turn")


def _run(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_many_game_sessions_all_complete(capsys) -> None:
    out = _run(capsys, ["--sessions", "300", "--env", "tictactoe", "--json",
                        "--illegal-rate", "0.1"])
    assert all(k in out for k in KEYS) and "sessions_lost" not in out
    # illegal moves lose games; they do not fail sessions
    assert out["sessions_completed"] == 300 and out["sessions_failed"] == 0
    assert out["turns"] >= 300 and out["overhead_us_per_turn"] > 0
    assert out["turns_per_s"] * out["wall_s"] == pytest.approx(out["turns"], rel=0.01)
    ctx = out["context_len_per_turn"]
    assert ctx["0"]["n"] == 300 and ctx["1"]["p50"] > ctx["0"]["p50"]  # context grows per move
    assert out["act_p50_ms"] is None  # no tools in this env


def test_connect4_and_caps(capsys) -> None:
    out = _run(capsys, ["--sessions", "20", "--env", "connect4", "--json",
                        "--max-total-tokens", "300"])
    assert out["sessions_completed"] == 20 and out["sessions_truncated"] > 0
    assert all(v["max"] <= 300 for v in out["context_len_per_turn"].values())


def test_tool_sessions_compare_executors(capsys, tmp_path) -> None:
    png = tmp_path / "stress.png"
    out = _run(capsys, ["--sessions", "24", "--env", "calc", "--tool-calls", "2", "--json",
                        "--arrival", "burst", "--burst-size", "12", "--burst-interval-s", "0.3",
                        "--max-workers", "2", "--tool-latency", "heavy",
                        "--tool-failure-rate", "0.2", "--compare", "--plot", str(png)])
    assert out["sessions_completed"] == 24 and out["tool_calls"] == 48
    cmp = out["compare"]
    assert cmp["elastic"]["workers_peak"] <= 2 and cmp["static"]["workers_peak"] <= 4
    assert cmp["static"]["sessions_completed"] == 24
    assert cmp["act_mean_speedup"] is not None
    assert png.stat().st_size > 10_000


def test_failed_sessions_are_reported_and_set_the_exit_status(capsys) -> None:
    # a 1 ms session timeout against 20 ms tool calls: every session fails, none goes missing
    assert main(["--sessions", "6", "--env", "calc", "--json", "--tool-latency", "fixed",
                 "--tool-latency-ms", "20", "--session-timeout-s", "0.001"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["sessions_failed"] == 6 and out["sessions_completed"] == 0
    assert sum(out["failure_kinds"].values()) == 6


def test_bad_arguments(capsys) -> None:
    assert main(["--sessions", "0"]) == 2
    assert "--sessions" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--env", "chess"])
