"""The simulator's baselines beside best static in hindsight (bench/selector_simulate.py):
the step-0 pick restarted on OOM and the conservative static layout, on hand-made tables."""

from __future__ import annotations

import pytest
from bench_scripts import load

_sim = load("selector_simulate")

# train: "fast" OOMs at step 3, "slow" fits every step, "tiny" never fits; rollout fits
TABLE = {"train": {"fast": [1.0, 1.0, 1.0, None, 1.0], "slow": [2.0, 2.0, 2.0, 2.0, 2.0],
                   "tiny": [None] * 5},
         "rollout": {"r": [0.5] * 5}}
LOAD = {"train": {"fast": 0.1, "slow": 0.5, "tiny": 0.0}, "rollout": {"r": 0.0}}


def test_fastest_fitting_skips_layouts_that_oom_at_the_step() -> None:
    assert _sim.fastest_fitting(TABLE["train"], 0) == "fast"
    assert _sim.fastest_fitting(TABLE["train"], 3) == "slow"
    assert _sim.fastest_fitting({"a": [None]}, 0) is None
    # from a checkpoint at 0: "a" is faster at step 1 but OOMed at step 0
    assert _sim.fastest_fitting({"a": [None, 1.0], "b": [3.0, 3.0]}, 1) == "a"
    assert _sim.fastest_fitting({"a": [None, 1.0], "b": [3.0, 3.0]}, 1, since=0) == "b"


def test_restart_pick_pays_the_restart_and_reruns_the_steps_since_the_checkpoint() -> None:
    r = _sim.restart_pick(TABLE, {"train": "fast", "rollout": "r"}, restart_s=10.0,
                          load_s=LOAD, checkpoint_every=2)
    # steps 0-2 on fast (1 + 0.5 each), OOM at 3: back to the checkpoint at 2 (step 2 lost),
    # 10 s + slow's 0.5 s, then steps 2-4 on slow (2 + 0.5 each)
    assert r.finished and r.oom_steps == [3] and r.steps_lost == 1
    assert r.restart_seconds == pytest.approx(10.5)
    assert r.seconds == pytest.approx(3 * 1.5 + 10.5 + 3 * 2.5)
    assert r.layouts == [{"train": "fast", "rollout": "r"}, {"train": "slow", "rollout": "r"}]


def test_restart_pick_without_an_oom_is_the_static_run() -> None:
    r = _sim.restart_pick(TABLE, {"train": "slow", "rollout": "r"}, restart_s=10.0,
                          load_s=LOAD, checkpoint_every=2)
    assert r.finished and r.oom_steps == [] and r.seconds == pytest.approx(5 * 2.5)


def test_restart_pick_stops_when_no_layout_fits_the_step() -> None:
    table = {"train": {"a": [1.0, None], "b": [1.0, None]}}
    r = _sim.restart_pick(table, {"train": "a"}, restart_s=1.0, load_s={"train": {}},
                          checkpoint_every=1)
    assert not r.finished and r.oom_steps == [1]


def test_conservative_pick_is_the_fastest_that_fits_the_longest_context() -> None:
    assert _sim.conservative_pick({"a": None, "b": 3.0, "c": 5.0}) == "c"
    assert _sim.conservative_pick({"a": None}) is None


def test_cluster_run_reports_both_baselines_beside_best_static() -> None:
    r = _sim.run(_sim.SimConfig(gpus=64, steps=20))
    pick = r["restart_pick"]
    assert pick["oom_steps"], "the step-0 pick should OOM as the context grows"
    assert pick["layouts"][0]["train"] == r["fastest_at_start"]["train"]["layout"]
    assert pick["tokens_per_s"] > 0 and r["throughput_ratio_vs_restart_pick"] > 0
    assert set(r["conservative_static"]["layouts"]) == {"rollout", "reference", "train"}
    assert r["throughput_ratio_vs_conservative"] > 0
