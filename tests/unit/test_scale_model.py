"""bench/scale_model.py: the analytic scale model reproduces the paper's order of magnitude and
scales sensibly."""

import dataclasses

import pytest
from bench_scripts import load

_scale = load("scale_model")
ScaleConfig, estimate, model_parallel, table = (
    _scale.ScaleConfig, _scale.estimate, _scale.model_parallel, _scale.table)


def test_paper_point_1k_gpus_32k_context_200b_plus():
    e = estimate(ScaleConfig(gpus=1024, model_params=230e9, context_len=32768))
    assert (e.tp, e.pp, e.dp) == (8, 8, 16)
    assert 0.5 <= e.volume_TB <= 5  # ~1 TB through one driver per step
    assert e.single_controller_s > 20 * 60  # > 20 minutes
    assert e.dispatcher_s < 0.01 * e.single_controller_s
    assert e.driver_bytes_dispatcher == 0


def test_volume_grows_with_context_and_replication():
    base = ScaleConfig(gpus=256, model_params=32e9, context_len=8192)
    longer = dataclasses.replace(base, context_len=16384)
    assert estimate(longer).volume_TB == pytest.approx(2 * estimate(base).volume_TB)
    wider = dataclasses.replace(base, tp=8, pp=4)
    assert estimate(wider).volume_TB > estimate(dataclasses.replace(base, tp=8, pp=1)).volume_TB
    # the dispatcher's time falls as DP grows; the driver's does not
    more_dp = dataclasses.replace(base, gpus=1024)
    assert estimate(more_dp).dispatcher_s < estimate(base).dispatcher_s
    assert estimate(more_dp).single_controller_s == pytest.approx(estimate(base).single_controller_s)


def test_layout_derivation_and_bad_input():
    assert model_parallel(ScaleConfig(model_params=1e9)) == (1, 1)
    with pytest.raises(ValueError, match="not a multiple of tp\\*pp\\*cp=64"):
        estimate(ScaleConfig(gpus=100, model_params=230e9))
    with pytest.raises(ValueError, match="driver_GBps must be > 0"):
        ScaleConfig(driver_GBps=0)
    assert table().count("\n") == 4
