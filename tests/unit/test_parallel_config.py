"""Parallel settings of the stage actors, no processes: typed configs on the wire, vLLM thread
binding, the trainer's dispatch plan, reconfiguration timings."""

from __future__ import annotations

import pytest

from earl.algorithms import LossConfig
from earl.runtime import wire
from earl.runtime.dock_index import DockIndex, SampleInfo
from earl.runtime.layout import Layout
from earl.stages import trainer as _trainer  # noqa: F401  (registers the typed records)
from earl.stages import vllm_build
from earl.stages.optim import OptimConfig
from earl.stages.reconfigure import ReconfigTimes
from earl.stages.trainer_feed import plan_for
from earl.stages.trainer_torch import TrainerConfig
from earl.stages.vllm_engine import EngineConfig


def test_trainer_config_travels_as_a_typed_record() -> None:
    cfg = TrainerConfig(model="/m", tp=2, parallel="fsdp", optim=OptimConfig(betas=(0.9, 0.95)),
                        loss=LossConfig(kl_coef=0.1))
    body, bufs = wire.encode([cfg, Layout(dp=2, tp=2)])
    back, layout = wire.decode(body, bufs)
    assert back == cfg and isinstance(back.loss, LossConfig) and back.optim.betas == (0.9, 0.95)
    assert layout == Layout(dp=2, tp=2)


def test_bad_parallel_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="TrainerConfig.tp"):
        TrainerConfig(model="/m", tp=0)
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel_size"):
        EngineConfig(model="/m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_gb"):
        EngineConfig(model="/m", kv_cache_gb=0)


def test_cpu_binding_splits_the_allowed_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_build.os, "sched_getaffinity", lambda pid: {0, 1})
    assert vllm_build.cpu_binding(2) == "0|1"
    monkeypatch.setattr(vllm_build.os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 9})
    assert vllm_build.cpu_binding(2) == "4,5|6,7"
    with pytest.raises(ValueError, match="tensor_parallel_size=8 needs >= 8 cores"):
        vllm_build.cpu_binding(8, time_share=False)
    # in a device slot with a CPU share, devices share cores by design: workers take turns
    monkeypatch.setattr(vllm_build.os, "sched_getaffinity", lambda pid: {0})
    assert vllm_build.cpu_binding(2, time_share=True) == "0|0"
    monkeypatch.setenv(vllm_build.SHARE_ENV, "1")
    assert vllm_build.cpu_binding(3) == "0|0|0"


def test_plan_for_the_trainer_layout_within_the_budget_or_the_longest_sample() -> None:
    ix = DockIndex(stages=["train"], capacity=64)
    lengths = [30, 500, 20, 40, 10, 60]
    for i, n in enumerate(lengths):
        ix.register(SampleInfo(sample_id=f"s{i}", group_id=f"g{i}", group_size=1, length=n,
                               version=0, shard="w:0", columns={"input_ids": 8 * n}))
    lease = ix.take("train", ["input_ids"], 6)
    plan = plan_for(lease, Layout(dp=2, tp=2), micro_batch_tokens=100)
    assert [r.ranks for r in plan.replicas] == [(0, 1), (2, 3)]
    assert plan.is_leader(2) and not plan.is_leader(3)
    ids = [s for r in plan.replicas for s in r.sample_ids]
    assert sorted(ids) == [f"s{i}" for i in range(6)]
    for rep in plan.replicas:
        assert len(rep.micro_batches) == len(plan.replicas[0].micro_batches)
        for mb in rep.micro_batches:  # the 500-token sample sets the peak anyway
            assert sum(lengths[int(s[1:])] for s in mb) <= 500
    short = plan_for(lease, Layout(dp=1),
                     micro_batch_tokens=1000)
    assert len(short.replicas[0].micro_batches) == 1


def test_reconfig_times_add_up() -> None:
    t = ReconfigTimes(save_s=1.0, stop_s=0.5, spawn_s=2.0, load_s=0.25, push_s=0.25)
    assert t.total_s == 4.0 and t.as_dict()["total_s"] == 4.0
