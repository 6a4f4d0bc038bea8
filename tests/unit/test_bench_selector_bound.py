"""`bench/selector_bound.py`: the oracle that switches for free to the fastest static run in each
context bucket. It gains over the best static run only where the fastest layout changes with
the context; a bucket a run never reached takes its rate in the longest one below."""

from __future__ import annotations

import pytest
from bench_scripts import load

bound = load("selector_bound")
runs = load("_selector_runs")


def _run(devices: int, rates: dict[int, float], *, cut: float = 0.0, outcome: str = "finished"
         ) -> dict[str, object]:
    """A static run that trained 1,000 tokens in each bucket at `rates` (tokens/s)."""
    return {"devices": devices, "outcome": outcome, "cut_rate": cut,
            "by_context": {str(b): [1000.0, 1000.0 / r] for b, r in rates.items()}}


def _result(statics: dict[str, dict[str, object]], pick: str) -> dict[str, object]:
    work = {"1024": [3000.0, 0.0], "4096": [1000.0, 0.0]}
    return {"static_runs": statics, "step0_pick": pick,
            "selector_run": {"devices": 4, "by_context": work, "loop_s": 4.0,
                             "tokens_per_s": 1000.0}}


def test_one_layout_fastest_at_every_context_leaves_nothing_to_gain() -> None:
    statics = {"a": _run(2, {1024: 2000.0, 4096: 1000.0}),
               "b": _run(4, {1024: 1500.0, 4096: 800.0}),
               "pick": _run(2, {1024: 4000.0}, cut=0.1)}
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
