"""The simulator's calibration against the 2-core runs (bench/_selector_calibration.py): the
arithmetic of the held-out rate errors and of the OOM step, on hand-made runs."""

from __future__ import annotations

import pytest
from bench_scripts import load

from earl.runtime.selector.cost import Parallel

cal = load("_selector_calibration")


def _run(name: str, sweep: str, by_context: dict[int, tuple[float, float]]) -> object:
    return cal.MeasuredRun(sweep=sweep, name=name, layout=cal.StaticLayout.parse(name),
                           device_mib=2934.0, by_context=by_context)


def _exact(name: str, sweep: str, scale: float, buckets: tuple[int, ...]) -> object:
    """A run whose every bucket measured `scale` x the roofline: 10 s per bucket."""
    lay = cal.StaticLayout.parse(name)
    cost = cal.cpu_cost(lay.devices, 0.0)
    return _run(name, sweep, {b: (scale * cal.predicted_rate(cost, lay, b, 2934 * 2**20) * 10,
                                  10.0) for b in buckets})


def test_layout_names_parse_and_bad_ones_are_refused() -> None:
    lay = cal.StaticLayout.parse("static/d4/r1tp2-t2/w4096/mb64k")
    assert (lay.devices, lay.replicas, lay.rollout_tp, lay.trainer_dp, lay.window,
            lay.micro_batch_tokens) == (4, 1, 2, 2, 4096, 65536)
    with pytest.raises(ValueError, match="layout"):
        cal.StaticLayout.parse("static/four-devices")


def test_whole_run_rate_weighs_buckets_by_their_tokens() -> None:
    # 100 tokens in 1 s at 768, 300 tokens in 6 s at 4096: measured 400 / 7
    measured, predicted = cal.whole_run_rate({768: (100, 1.0), 4096: (300, 6.0)},
                                             {768: 100.0, 4096: 100.0})
    assert measured == pytest.approx(400 / 7)
    assert predicted == pytest.approx(100.0)


def test_fit_scale_is_the_geometric_mean_and_needs_pairs() -> None:
    assert cal.fit_scale([(2.0, 1.0), (8.0, 1.0)]) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        cal.fit_scale([])


def test_error_summary_says_when_one_run_is_past_ten_percent() -> None:
    ok = cal.error_summary([0.05, -0.1, 0.02])
    assert ok["within"] and ok["max_abs_error"] == 0.1 and ok["median_abs_error"] == 0.05
    assert not cal.error_summary([0.05, -0.11])["within"]
    assert not cal.error_summary([])["within"]


def test_rates_the_model_reproduces_up_to_a_factor_are_held_out_within_10pct() -> None:
    buckets = (768, 1024, 2048, 4096)
    runs = [_exact("static/d2/r1-t1/w4096/mb8k", "s1", 1.7, buckets),
            _exact("static/d4/r2-t2/w4096/mb64k", "s1", 1.7, buckets),
            _exact("static/d2/r1-t1/w1024/mb8k", "s1", 1.7, (768, 1024))]
    out = cal.rate_calibration(runs)
    assert out["scale_per_sweep"] == {"s1": pytest.approx(1.7, rel=1e-3)}
    assert [r["run"] for r in out["held_out_runs"]] == [
        "static/d4/r2-t2/w4096/mb64k", "static/d2/r1-t1/w1024/mb8k"]  # the fit run is not
    assert out["rate_within_10pct"] and out["held_out"]["max_abs_error"] == 0.0


def test_a_held_out_run_slower_than_the_model_fails_the_10pct() -> None:
    buckets = (1024, 2048)
    slow = _exact("static/d4/r2-t2/w4096/mb64k", "s1", 1.0, buckets)  # fit says 2.0
    out = cal.rate_calibration([_exact("static/d2/r1-t1/w4096/mb8k", "s1", 2.0, buckets), slow])
    assert out["held_out_runs"][0]["error"] == pytest.approx(1.0, abs=1e-3)
    assert not out["rate_within_10pct"]
    assert out["bucket_error_mean"] == {"1024": pytest.approx(1.0, abs=1e-3),
                                        "2048": pytest.approx(1.0, abs=1e-3)}


def test_context_slope_compares_the_fall_from_the_shortest_to_the_longest_bucket() -> None:
    got = cal.context_slope({1024: (300.0, 1.0), 4096: (150.0, 1.0)}, {1024: 10.0, 4096: 2.5})
    assert got == {"from": 1024, "to": 4096, "measured": 0.5, "predicted": 0.25}


def _memory_result(base: float, dev: float, kills: list[tuple[int, int, int]]) -> dict:
    return {"sizing": {"base_mib": base, "device_mib": dev}, "predicted_oom_step_tokens": 20000,
            "measured_oom": [[{"step": s, "budget": b, "step_tokens_max_so_far": t,
                               "ctx_max_so_far": 1024} for s, b, t in kills]]}


def test_oom_step_error_is_the_models_micro_batch_over_the_one_survived() -> None:
    cost = cal.cpu_cost(2, 400.0)
    cap = cal.predicted_oom_tokens(cost, 1024, 900.0)
    assert 1024 <= cap < 65536
    # budget below the steps: the micro-batch survived is the budget, not the step
    res = _memory_result(400.0, 900.0, [(20, cap, 10 * cap), (9, 65536, 2 * cap)])
    out = cal.oom_calibration({"r.json": res})
    errs = [k["error"] for k in out["kills"]]
    assert errs == [pytest.approx(0.0, abs=1e-3), pytest.approx(-0.5, abs=1e-3)]
    assert out["oom_step_error"] == pytest.approx(-0.5, abs=1e-3)
    assert not out["summary"]["within"]
    assert out["kills"][0]["sweep_error"] == pytest.approx(20000 / cap - 1, abs=1e-3)


def test_a_bigger_device_moves_the_predicted_oom_to_a_bigger_micro_batch() -> None:
    cost = cal.cpu_cost(2, 400.0)
    assert cal.predicted_oom_tokens(cost, 1024, 1200.0) > cal.predicted_oom_tokens(
        cost, 1024, 900.0)
    assert cost.memory("train", Parallel(), seq_len=1024).reserve == 400.0 * 2**20


def test_the_saved_runs_load_with_their_sweeps() -> None:
    runs = cal.load_runs()
    assert runs and all(r.sweep and r.by_context for r in runs)
    assert any(cal.FIT_LAYOUT in r.name for r in runs)


def test_the_decode_step_fit_recovers_the_overhead_the_fit_layout_ran_with() -> None:
    # the fit layout measured with 3 ms per decode step (one core): the fit finds it from its
    # buckets alone, and a held-out layout run with the same overhead is then predicted exactly
    buckets = (768, 1024, 2048, 4096)

    def run(name: str) -> object:
        lay = cal.StaticLayout.parse(name)
        cost = cal.cpu_cost(lay.devices, 0.0, decode_step_s=0.003)
        return _run(name, "s1", {b: (2.0 * cal.predicted_rate(cost, lay, b, 2934 * 2**20) * 10,
                                     10.0) for b in buckets})

    out = cal.rate_calibration([run("static/d2/r1-t1/w4096/mb8k"),
                                run("static/d4/r1tp2-t2/w4096/mb64k")])
    assert out["decode_step_s"] == pytest.approx(0.003, abs=2e-5)
    assert out["held_out"]["max_abs_error"] <= 0.005


def test_attention_is_priced_below_the_bucket_at_the_steps_token_weighted_share() -> None:
    # a step's trajectories lie below its longest: attention at 2 / H(32) of the bucket
    assert cal.ATTENTION_SHARE == pytest.approx(0.4928, abs=1e-4)
    lay = cal.StaticLayout.parse("static/d2/r1-t1/w4096/mb8k")
    cost = cal.cpu_cost(2, 0.0)
    at_share = cal.predicted_rate(cost, lay, 4096, 2934 * 2**20)
    at_longest = cal.predicted_rate(cost, lay, 4096, 2934 * 2**20, attention_share=1.0)
    assert at_share > 1.4 * at_longest


def test_a_decode_step_outside_the_slot_does_not_slow_with_the_share() -> None:
    lay = cal.StaticLayout.parse("static/d4/r2-t2/w4096/mb64k")
    cap = 2934 * 2**20
    rate = {in_slot: cal.predicted_rate(cal.cpu_cost(lay.devices, 0.0, decode_step_s=0.002,
                                                     step_in_slot=in_slot), lay, 768, cap)
            for in_slot in (True, False)}
    assert rate[False] > 1.3 * rate[True]  # half a core: the in-slot step costs twice
    whole = cal.StaticLayout.parse("static/d2/r1-t1/w4096/mb64k")
    same = {in_slot: cal.predicted_rate(cal.cpu_cost(whole.devices, 0.0, decode_step_s=0.002,
                                                     step_in_slot=in_slot), whole, 768, cap)
            for in_slot in (True, False)}
    assert same[True] == same[False]  # a whole core: the two readings agree
