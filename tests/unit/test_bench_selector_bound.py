"""`bench/selector_bound.py`: the oracle that switches for free to the fastest static run in each
context bucket. It gains over the best static run only where the fastest layout changes with
the context; a bucket a run never reached takes its rate in the longest one below."""

from __future__ import annotations

import pytest
from bench_scripts import load

bound = load("selector_bound")
runs = load("_selector_runs")


def _run(devices: int, rates: dict[int, float], *, cut: float = 0.0, outcome: str = "finished",
         window: int = 4096) -> dict[str, object]:
    """A static run that trained 1,000 tokens in each bucket at `rates` (tokens/s)."""
    return {"devices": devices, "outcome": outcome, "cut_rate": cut, "window": window,
            "by_context": {str(b): [1000.0, 1000.0 / r] for b, r in rates.items()}}


def _result(statics: dict[str, dict[str, object]], pick: str) -> dict[str, object]:
    work = {"1024": [3000.0, 0.0], "4096": [1000.0, 0.0]}
    return {"static_runs": statics, "step0_pick": pick,
            "selector_run": {"devices": 4, "by_context": work, "loop_s": 4.0,
                             "tokens_per_s": 1000.0}}


def test_one_layout_fastest_at_every_context_leaves_nothing_to_gain() -> None:
    statics = {"a": _run(2, {1024: 2000.0, 4096: 1000.0}),
               "b": _run(4, {1024: 1500.0, 4096: 800.0}),
               "pick": _run(2, {1024: 4000.0}, cut=0.1, window=1024)}
    out = bound.one_sweep(_result(statics, "pick"))
    assert out["best_static"] == "a"
    assert out["oracle_ratio_vs_best_static"] == 1.0
    assert out["best_static_same_devices"] == "b"
    # the cut run never reached 4,096: priced at its 1,024 rate there (favoured), and it is not
    # a candidate of the oracle (it cut contexts)
    assert out["oracle_ratio_vs_step0_pick"] == pytest.approx((4000 / 4000) / (1.5 + 1.0),
                                                              abs=1e-3)
    assert {v["run"] for v in out["fastest_by_bucket"].values()} == {"a"}
    assert out["selector_share_of_oracle"] == pytest.approx(2.5 / 4.0, abs=1e-3)


def test_layouts_that_cross_give_the_oracle_its_gain() -> None:
    statics = {"short": _run(4, {1024: 3000.0, 4096: 500.0}),
               "long": _run(4, {1024: 1000.0, 4096: 1000.0}),
               "oom": _run(4, {1024: 9000.0, 4096: 9000.0}, outcome="oom")}
    out = bound.one_sweep(_result(statics, "short"))
    oracle = 3000 / 3000 + 1000 / 1000  # each bucket at its fastest clean run
    best = min(3000 / 3000 + 1000 / 500, 3000 / 1000 + 1000 / 1000)
    assert out["oracle_ratio_vs_best_static"] == pytest.approx(best / oracle, abs=1e-3)
    assert out["fastest_by_bucket"]["1024"]["run"] == "short"
    assert out["fastest_by_bucket"]["4096"]["run"] == "long"


def test_a_bucket_not_reached_takes_the_rate_below() -> None:
    run = _run(2, {1024: 2000.0, 2048: 1000.0})
    assert runs.rate_at(run, 4096) == pytest.approx(1000.0)
    assert runs.rate_at(run, 1536) == pytest.approx(2000.0)
    assert runs.rate_at(run, 512) == pytest.approx(2000.0)  # below its shortest: its shortest


def test_a_cut_at_the_model_positions_leaves_a_run_a_candidate() -> None:
    # the model holds 4,096 positions: no layout or window holds a longer context, so a cut
    # there counts against no run; one by a shorter window does
    statics = {"at_model": _run(4, {1024: 2000.0, 4096: 1000.0}, cut=0.0001),
               "short_window": _run(4, {1024: 9000.0}, cut=0.0001, window=1024),
               "clean": _run(4, {1024: 1000.0, 4096: 500.0})}
    assert set(bound.clean(statics)) == {"at_model", "clean"}
    assert bound.one_sweep(_result(statics, "clean"))["best_static"] == "at_model"


def test_a_run_saved_before_the_split_is_read_by_its_windows() -> None:
    split = {"cut_rate": 0.01, "cut_rate_below_model": 0.002, "window": 4096}
    assert runs.cut_below_model(split, 4096) == 0.002
    grown = {"cut_rate": 0.01, "window": 4096, "layouts": ["r2x1-t2-w1024", "r2x1-t2-w4096"]}
    assert runs.cut_below_model(grown, 4096) == 0.01  # a window below the model's: all count
    presized = {"cut_rate": 0.01, "window": 4096, "layouts": ["r2x1-t2-w4096", "r3x1-t1-w4096"]}
    assert runs.cut_below_model(presized, 4096) == 0.0
    assert runs.cut_below_model({"cut_rate": 0.1, "window": 1024}, 4096) == 0.1
