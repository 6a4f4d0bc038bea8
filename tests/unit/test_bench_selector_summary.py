"""`bench/selector.py`'s summary of a sweep (`summarize`, also `--from` a saved result): a cut at
the model's own positions counts against no run, one by a shorter window does; `oom_selector` is
the OOM killer's verdict, never a cut."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load

selector = load("selector")


def _run(devices: int, tokens_per_s: float, *, window: int = 4096, cut: float = 0.0,
         below: float | None = None, outcome: str = "finished") -> dict[str, object]:
    run: dict[str, object] = {
        "devices": devices, "outcome": outcome, "window": window, "cut_rate": cut,
        "tokens_per_s": tokens_per_s, "tokens_per_s_first_tenth": tokens_per_s,
        "loop_s": 10.0, "steps": 500, "by_context": {"1024": [10.0 * tokens_per_s, 10.0]},
        "final_eval": {}, "reward_first_tenth": 0.0, "reward_last_tenth": 1.0,
        "context_growth": 4.5, "reconfigurations": 2, "trainer_layout_changes": 1,
        "rollout_layout_changes": 1, "device_moves": 1, "reconfig_seconds": [1.0, 2.0],
        "samples_lost": 0}
    if below is not None:
        run["cut_rate_below_model"] = below
    return run


def _statics() -> dict[str, dict[str, object]]:
    return {"at_model": _run(2, 2000.0, cut=0.001),  # its window is the model's positions
            "truncate": _run(4, 3000.0, window=1024, cut=0.1),
            "slow": _run(4, 1000.0)}


def test_a_cut_at_the_model_positions_is_no_oom_and_no_failure() -> None:
    sel = _run(4, 1500.0, cut=0.0001, below=0.0)
    res = selector.summarize(_statics(), sel, "truncate")
    assert res["best_static_hindsight"] == "at_model"  # the truncating run cut: not a candidate
    assert res["best_static_same_devices"] == "slow"
    assert res["throughput_ratio_vs_best_static"] == 0.75
    assert res["step0_pick"] == "truncate"
    assert res["oom_selector"] is False and res["selector_cut_rate"] == 0.0001
    goals = res["goals"]
    assert goals["oom_selector==false"] and goals["selector_cut_rate_below_model==0"]
    assert goals["selector_outcome==finished"] and goals["context_growth>=4"]


def test_a_cut_by_the_selectors_window_and_an_oom_each_fail_their_goal() -> None:
    cut = selector.summarize(_statics(), _run(4, 1500.0, cut=0.01, below=0.004), "truncate")
    assert not cut["goals"]["selector_cut_rate_below_model==0"]
    assert cut["selector_cut_rate_below_model"] == 0.004 and not cut["oom_selector"]
    oom = selector.summarize(_statics(), _run(4, 1500.0, outcome="oom"), "truncate")
    assert oom["oom_selector"] is True and not oom["goals"]["oom_selector==false"]
    assert not oom["goals"]["selector_outcome==finished"]


def test_saved_run_records_are_summarized_as_one_invocation(tmp_path: Path) -> None:
    """`--runs`: a selector run against static runs re-run elsewhere (its own machine)."""
    paths = []
    for name, run in {"selector/d4/r1-t1/w4096/mb64k": _run(4, 1500.0),
                      "static/d4/r2-t2/w4096/mb64k": _run(4, 2000.0),
                      "static/d2/r1-t1/w1024/mb64k": _run(2, 3000.0, window=1024, cut=0.1)
                      }.items():
        path = tmp_path / f"{name.replace('/', '_')}.result.json"
        path.write_text(json.dumps({"key": {}, "run": {**run, "config": name}}))
        paths.append(str(path))
    res = selector.summarize_records(paths, 1024)
    assert set(res["static_runs"]) == {"static/d4/r2-t2/w4096/mb64k",
                                       "static/d2/r1-t1/w1024/mb64k"}
    assert res["best_static_hindsight"] == res["best_static_same_devices"] \
        == "static/d4/r2-t2/w4096/mb64k"
    assert res["step0_pick"] == "static/d2/r1-t1/w1024/mb64k"
    assert res["throughput_ratio_vs_best_static"] == 0.75 and res["truncate"] == ""
    assert res["final_eval"]["truncate"] is None and res["summarized_from"] == paths
