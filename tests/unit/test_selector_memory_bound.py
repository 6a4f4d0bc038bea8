"""`bench/selector.py --memory-bound`'s rules (`bench/_selector_memory.py`): the device sizing,
the restart rule, the conservative and truncating layouts, time to quality and the summary over
replicates, and how an arm's record is read from its segments (`_selector_memory_runs`)."""

from __future__ import annotations

import dataclasses

import pytest
from bench_scripts import load

rules = load("_selector_memory")
runs = load("_selector_memory_runs")


def _pilot(base: float = 400.0, kib: float = 20.0, start: int = 8000, steps: int = 12
           ) -> list[dict[str, float]]:
    """Pilot step rows whose trainer peak is exactly base + kib x tokens (MiB), tokens growing
    from `start`, one trajectory of 1/16 of a step's tokens the longest."""
    out = []
    for i in range(steps):
        t = start + 1000 * i
        out.append({"train/tokens": t, "train/peak_rss_mib": base + kib * t / 1024,
                    "ctx_max": t / 16})
    return out


def test_sizing_rule_fits_the_start_and_kills_past_the_cap() -> None:
    s = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.5)
    assert s.scale == pytest.approx(2.0, rel=1e-3)  # measured 20 KiB/token over the model's 10
    assert s.base_mib == pytest.approx(400.0, abs=0.5)
    t0 = 8000 + 11 * 1000
    assert s.start_tokens == t0
    assert s.cap_tokens == int(t0 * (65536 / t0) ** 0.5)
    assert s.fits(t0)  # the pick's start fits
    assert not s.fits(int(s.cap_tokens * 1.05))  # a step 5% past the cap does not
    assert not s.fits(65536)  # the full budget does not: the pick must OOM
    assert s.predicted_oom_context == round(s.cap_tokens / 16)
    assert "T_cap" in s.rule() and str(s.cap_tokens) in s.rule()


def test_sizing_a_larger_fraction_gives_a_larger_device() -> None:
    small = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.3)
    big = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.75)
    assert small.device_mib < big.device_mib
    assert small.predicted_oom_context < big.predicted_oom_context


def test_sizing_refuses_a_pilot_at_its_budget_and_falls_back_on_flat_tokens() -> None:
    with pytest.raises(ValueError, match="fill the budget"):
        rules.size_devices(_pilot(start=70000), cost_kib_per_token=10.0, budget=65536,
                           fraction=0.5)
    flat = [{"train/tokens": 10000.0, "train/peak_rss_mib": 600.0, "ctx_max": 700.0}] * 5
    s = rules.size_devices(flat, cost_kib_per_token=10.0, budget=65536, fraction=0.5)
    assert s.scale == 1.0  # no slope to measure: the cost model's own


def test_resize_raises_the_device_to_the_rollouts_floor_and_moves_the_prediction() -> None:
    s = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.5)
    r = rules.resize(s, floor_mib=s.device_mib + 200)
    assert r.device_mib == s.device_mib + 200
    assert r.predicted_oom_tokens > s.predicted_oom_tokens
    higher = rules.resize(s, base_mib=s.base_mib + 100)
    assert higher.device_mib == pytest.approx(s.device_mib + 100, abs=1)


def test_restart_rule_halves_the_budget_down_to_one_longest_sequence() -> None:
    assert rules.next_budget(65536, 4096) == 32768
    assert rules.next_budget(8192, 4096) == 4096
    assert rules.next_budget(4096, 4096) is None


def test_conservative_budget_is_the_largest_halving_that_fits() -> None:
    s = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.5)
    b = rules.conservative_budget(s, 4096, 0.1)
    assert b is not None and b < 65536
    assert s.fits(b, 0.1) and not s.fits(2 * b, 0.1)
    tiny = dataclasses.replace(s, base_mib=s.device_mib - 1)  # not even one sequence fits
    assert rules.conservative_budget(tiny, 4096, 0.1) is None


def test_truncate_window_fits_a_full_step() -> None:
    s = rules.size_devices(_pilot(), cost_kib_per_token=10.0, budget=65536, fraction=0.5)
    w = rules.truncate_window(s, 48.0, 0.1)
    assert w % 64 == 0 and w >= 64
    assert s.fits(48 * w, 0.1) and not s.fits(48 * (w + 128), 0.1)


def test_time_to_quality_is_the_first_eval_at_the_threshold() -> None:
    evals = [{"wall_s": 30.0, "q": 1.0}, {"wall_s": 10.0, "q": 0.5}, {"wall_s": 50.0, "q": 2.0}]
    assert rules.time_to_quality(evals, "q", 1.0) == 30.0
    assert rules.time_to_quality(evals, "q", 3.0) is None


def _rec(ttq: float | None, wall: float, tokens: float, *, ooms: int = 0, kernel: bool = False,
         lost: int = 0, by_context: dict[str, list[float]] | None = None,
         loop_s: float = 0.0) -> dict[str, object]:
    evals = [{"wall_s": 5.0, "q": 0.0}]
    if ttq is not None:
        evals.append({"wall_s": ttq, "q": 1.0})
    return {"wall_s": wall, "tokens": tokens, "evals": evals, "ooms": ooms,
            "kernel_oom": kernel, "steps_lost": lost, "samples_lost": 0, "restart_s": 0.0,
            "by_context": by_context or {}, "loop_s": loop_s}


def test_summary_ratios_oracle_and_pinned_overhead() -> None:
    work = {"1024": [1000.0, 1.0], "2048": [1000.0, 1.0]}
    rep = {
        "selector": _rec(100.0, 200.0, 2000.0, by_context=work, loop_s=2.0),
        "restart_pick": _rec(150.0, 260.0, 2000.0, ooms=1, kernel=True, lost=20,
                             by_context={"1024": [2000.0, 1.0]}),
        "conservative": _rec(110.0, 220.0, 2000.0, by_context={"2048": [1000.0, 1.0]}),
        "truncate": _rec(None, 150.0, 1500.0),
        "pinned": _rec(100.0, 102.0, 1000.0),
        "pinned_static": _rec(100.0, 100.0, 1000.0),
    }
    out = rules.summarize([rep, rep, rep], key="q", threshold=1.0, steps=100)
    assert out["replicates"] == 3
    assert out["ratio_vs_restart_pick"] == pytest.approx(1.5)
    assert out["ratio_vs_conservative"] == pytest.approx(1.1)
    assert out["tokens_per_s_ratio_vs_restart_pick"] == pytest.approx(1.3)
    assert out["pinned_overhead"] == pytest.approx(1 - 100 / 102, abs=1e-3)
    # the oracle: 1000 tokens at 2000/s (1024) + 1000 at 1000/s (2048) = 1.5 s of 2.0
    assert out["oracle_fraction_same_devices"] == pytest.approx(0.75)
    assert out["step0_pick_oom"] is True and out["oom_selector"] is False
    assert out["goals"]["ratio_vs_restart_pick>=1.2"] is True
    assert out["goals"]["ratio_vs_conservative>=1.05"] is True
    assert out["goals"]["oracle_fraction_same_devices>=0.9"] is False
    assert out["winners"]["time_to_quality_s"] == "selector"
    assert out["arms"]["truncate"]["time_to_quality_s"]["missing"] == 3
    assert out["short_of_goal"] == {}  # both ratios reach their goals


def test_summary_says_who_won_when_the_selector_loses() -> None:
    rep = {"selector": _rec(300.0, 400.0, 2000.0, ooms=1),
           "restart_pick": _rec(None, 500.0, 2000.0, ooms=1),
           "conservative": _rec(200.0, 300.0, 2000.0)}
    out = rules.summarize([rep], key="q", threshold=1.0, steps=100)
    assert out["ratio_vs_conservative"] == pytest.approx(0.667, abs=1e-3)
    # restart_pick never reached the threshold: its whole 500 s bound its time from below
    assert out["ratio_vs_restart_pick"] == pytest.approx(500 / 300, abs=1e-3)
    assert out["ratio_censored"] == {"restart_pick": ["lower bound"]}
    assert out["winners"]["time_to_quality_s"] == "conservative"
    assert out["oom_selector"] is True
    assert out["step0_pick_oom"] is False  # no kernel verdict recorded
    assert out["goals"]["replicates>=3"] is False
    short = out["short_of_goal"]
    assert short["ratio_vs_conservative"]["first_to_quality"] == "conservative"
    assert short["ratio_vs_conservative"]["conservative"]["time_to_quality_s"] == 200.0
    assert "ratio_vs_restart_pick" not in short  # 1.67 >= 1.2 (a lower bound)


def _row(step: int, wall: float, tokens: float = 100.0) -> dict[str, object]:
    return {"step": step, "wall_s": wall, "step_s": 1.0, "train/tokens": tokens,
            "episodes": 32, "train/samples": 40, "ctx_max": 500, "reward": 0.0}


def test_arm_record_counts_steps_lost_and_the_restart_on_the_arm_clock() -> None:
    cfg = load("_selector_runs").Config(2, 1, 1, 1, 4096, 65536)
    first = {"rc": 1, "spawned_s": 0.0, "ended_s": 40.0, "wall_before": 0.0, "resumed_at": 0,
             "budget": 65536, "rows": [_row(s, 10.0 + s) for s in range(1, 26)],
             "evals": [{"step": 20.0, "wall_s": 31.0, "q": 1.0}],
             "kernel_oom_kills": ["oom-kill:...earl-1/device1"], "oom_message": True,
             "slot_peak_mib": {}, "result": {}, "error": ""}
    # resumed at step 20 (wall 30 s then): its clock restarts at 50 s on the arm's
    second = {"rc": 0, "spawned_s": 50.0, "ended_s": 100.0, "wall_before": 30.0,
              "resumed_at": 20, "budget": 32768,
              "rows": [_row(s, 30.0 + 10.0 + (s - 20)) for s in range(21, 31)],
              "evals": [], "kernel_oom_kills": [], "oom_message": False,
              "slot_peak_mib": {}, "error": "",
              "result": {"eval": {"q": 2.0}, "evals": [{"step": 30.0, "minutes": 1.0, "q": 2.0}]},
              "sel_rows": [{"selector/when": "rollout", "selector/queue/lost": 2.0,
                            **{f"selector/applied_{k}": v for k, v in (
                                ("max_model_len", 4096), ("micro_batch_tokens", 8192),
                                ("trainer_dp", 1), ("trainer_tp", 1), ("rollout_replicas", 1),
                                ("rollout_tp", 1), ("recompute", 0))}}]}
    rec = runs.arm_record(cfg, [first, second])
    assert rec["ooms"] == 1 and rec["kernel_oom"] is True
    assert rec["steps_lost"] == 5  # reached 25, resumed from 20
    assert rec["budgets"] == [65536, 32768]
    # step 21 ends at 50 + (41 - 30) = 61 s, began 1 s before: 20 s after the kill at 40 s
    assert rec["restart_s"] == pytest.approx(20.0)
    assert rec["wall_s"] == pytest.approx(50.0 + 50.0 - 30.0)  # step 30's end
    assert rec["steps"] == 10  # the kept rows of the last segment's file
    assert rec["oom_at"][0]["step"] == 26 and rec["oom_at"][0]["kernel"] is True
    assert rec["outcome"] == "finished"
    # the eval of step 20 from the killed segment's log, step 30's from the result, on the
    # clock of the segment that ran it: 50 + 60 s - the 30 s before its checkpoint
    assert [(e["step"], e["wall_s"]) for e in rec["evals"]] == [(20.0, 31.0), (30.0, 80.0)]
    assert rec["first_plan"]["micro_batch_tokens"] == 8192
    assert rec["samples_lost"] == 2  # the selector's own count of lost samples


def test_parse_eval_line() -> None:
    ev = runs.parse_eval("eval @ step 50: games_survived 1.250 (episodes 64, win_rate 0.500)")
    assert ev == {"step": 50.0, "games_survived": 1.25, "episodes": 64.0, "win_rate": 0.5}
    assert runs.parse_eval("step 50 trained") is None


def test_pinned_policy_keeps_its_first_plan() -> None:
    from earl.runtime.selector import ContextStats, Decision, Plan

    pinned = load("_selector_memory_pinned")
    plans = iter([Plan(actors=(), context_bucket=1024), Plan(actors=(), context_bucket=4096)])

    class Inner:
        calls = 0

        def decide(self, **kw: object) -> Decision:
            Inner.calls += 1
            return Decision(step=int(str(kw["step"])), when=str(kw["when"]), plan=next(plans),
                            changed=True, reason="search",
                            context=kw["contexts"])  # type: ignore[arg-type]

        def statistics(self) -> str:
            return "inner"

    p = pinned.PinnedPolicy(Inner())
    ctx = ContextStats(p50=100, p95=200, max=300)
    first = p.decide(step=0, when="rollout", contexts=ctx, slots={})
    later = p.decide(step=9, when="prep", contexts=ContextStats(p50=1, p95=2, max=4000),
                     slots={})
    assert first.plan.context_bucket == 1024 and first.changed
    assert later.plan is first.plan and not later.changed and later.step == 9
    assert Inner.calls == 1  # the search ran once
    assert p.statistics() == "inner"


def test_oracle_prices_at_whole_window_statics_only() -> None:
    work = {"1024": [1000.0, 1.0]}
    rep = {"selector": _rec(100.0, 200.0, 1000.0, by_context=work, loop_s=1.0),
           "conservative": _rec(110.0, 220.0, 1000.0, by_context={"1024": [1000.0, 1.0]}),
           # truncate cuts contexts: its (faster) rate prices no work of the selector's
           "truncate": _rec(None, 100.0, 1000.0, by_context={"1024": [10000.0, 1.0]})}
    assert rules.summarize([rep], key="q", threshold=1.0, steps=10)[
        "oracle_fraction_same_devices"] == pytest.approx(1.0)
    rep["pinned_static"] = _rec(None, 100.0, 1000.0, by_context={"1024": [4000.0, 1.0]})
    assert rules.summarize([rep], key="q", threshold=1.0, steps=10)[
        "oracle_fraction_same_devices"] == pytest.approx(0.25)
