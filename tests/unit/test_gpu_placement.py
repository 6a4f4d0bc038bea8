"""GPU placement without a GPU: which GPUs each stage gets for any layout, the environment each
actor rank is spawned with, the stage configs `earl train` builds for `placement.device=cuda`,
each trainer rank's own GPU, and vLLM's settings on CUDA (issue 28, part 2)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

from earl.config import PlacementConfig, RunConfig, from_dict, load_config, parse_overrides
from earl.loop.devices import gpu_slots, plan_gpus
from earl.runtime.slots import Slot, SlotPool
from earl.stages import trainer_dist as tdist
from earl.stages.compute import Compute
from earl.stages.reference import ReferenceConfig
from earl.stages.vllm_build import EngineConfig, engine_args, gpu_memory_utilization, reload_worker

# ------------------------------------------------------------------ which GPUs, any layout


@pytest.mark.parametrize(("placement", "reference", "gpus", "rollout", "trainer", "ref"), [
    ({}, 0, 2, ((0,),), ((1,),), ()),
    ({}, 1, 3, ((0,),), ((1,),), ((2,),)),
    ({"rollout": 2, "rollout_tp": 2, "trainer": 4, "trainer_tp": 2}, 0, 8,
     ((0, 1), (2, 3)), ((4,), (5,), (6,), (7,)), ()),
    ({"rollout": 1, "rollout_tp": 4, "trainer": 2}, 1, 8,
     ((0, 1, 2, 3),), ((4,), (5,)), ((6,),)),
    ({"rollout": 3, "trainer": 4, "trainer_tp": 4}, 1, 8,
     ((0,), (1,), (2,)), ((3,), (4,), (5,), (6,)), ((7,),)),
    ({"rollout": 4, "rollout_tp": 2, "trainer": 8, "trainer_tp": 2}, 2, 32,
     ((0, 1), (2, 3), (4, 5), (6, 7)), tuple((g,) for g in range(8, 16)), ((16,), (17,))),
])
def test_every_rank_gets_its_own_gpus_and_tp_groups_are_consecutive(
        placement: dict[str, int], reference: int, gpus: int, rollout: Any, trainer: Any,
        ref: Any) -> None:
    pl = PlacementConfig(**placement)  # type: ignore[arg-type]
    plan = plan_gpus(pl, reference=reference, gpus=gpus)
    assert (plan.rollout, plan.trainer, plan.reference) == (rollout, trainer, ref)
    flat = [g for ranks in plan.stages().values() for own in ranks for g in own]
    assert len(flat) == len(set(flat)) == plan.used <= gpus  # no GPU shared between ranks
    for own in plan.rollout:  # one vLLM replica's TP workers: consecutive GPUs
        assert list(own) == list(range(own[0], own[0] + pl.rollout_tp))
    tp = pl.trainer_tp  # trainer ranks count TP fastest: a TP group's ranks side by side
    for start in range(0, pl.trainer, tp):
        group = [plan.trainer[r][0] for r in range(start, start + tp)]
        assert group == list(range(group[0], group[0] + tp))


def test_a_layout_that_does_not_fit_names_the_fields_and_the_fix() -> None:
    pl = PlacementConfig(rollout=2, rollout_tp=2, trainer=4)
    with pytest.raises(ValueError) as e:
        plan_gpus(pl, reference=1, gpus=8)
    msg = str(e.value)
    assert "config field 'placement'" in msg and "= 9 GPUs, but 8 are visible" in msg
    for fix in ("placement.rollout", "placement.rollout_tp", "placement.trainer",
                "placement.reference", "algorithm.kl_coef=0", "by 1 GPU(s)"):
        assert fix in msg
    with pytest.raises(ValueError, match="lower placement.rollout, placement.rollout_tp or "
                                         "placement.trainer by 2"):
        plan_gpus(PlacementConfig(rollout=1, trainer=3), reference=0, gpus=2)
    with pytest.raises(ValueError, match="'placement.device'.*no GPU is visible"):
        plan_gpus(PlacementConfig(), reference=0, gpus=0)


def test_tp_fields_are_checked_where_they_are_set() -> None:
    with pytest.raises(ValueError, match="'placement.trainer_tp'.*does not divide "
                                         "placement.trainer=4"):
        load_config(None, ["--placement.trainer=4", "--placement.trainer_tp=3"])
    with pytest.raises(ValueError, match="'placement.rollout_tp': must be >= 1"):
        load_config(None, ["--placement.rollout_tp=0"])
    # 4 groups per step over trainer / trainer_tp = 2 data-parallel replicas: fine
    cfg = load_config(None, ["--batch_size=32", "--group_size=8", "--placement.trainer=4",
                             "--placement.trainer_tp=2"])
    assert (cfg.placement.trainer, cfg.placement.trainer_tp) == (4, 2)
    with pytest.raises(ValueError, match="8 trainer data-parallel replicas"):
        load_config(None, ["--batch_size=32", "--group_size=8", "--placement.trainer=8"])
    with pytest.raises(ValueError, match="'placement.rollout_tp'.*selector chooses"):
        load_config(None, ["--placement.rollout_tp=2", "--selector=on"])


def test_dtype_is_settable_from_the_run_config_and_checked() -> None:
    pl = load_config().placement
    assert (pl.dtype, pl.compute_dtype()) == ("auto", "float32")  # CPU runs: as before
    assert PlacementConfig(device="cuda").compute_dtype() == "bfloat16"  # what GPUs run fast
    assert PlacementConfig(device="cuda").compute_dtype("cpu") == "float32"  # the warm start
    bf16 = load_config(None, ["--placement.dtype=bfloat16"]).placement
    assert (bf16.dtype, bf16.compute_dtype(), bf16.compute_dtype("cpu")) == ("bfloat16",) * 3
    fp32 = PlacementConfig(device="cuda", dtype="float32")
    assert fp32.compute_dtype() == "float32"  # set explicitly, kept on CUDA
    with pytest.raises(ValueError, match="'placement.dtype': 'fp8' unknown; choose one of "
                                         r"\('auto', 'float32', 'bfloat16'\)"):
        load_config(None, ["--placement.dtype=fp8"])


@pytest.mark.parametrize(("overrides", "words"), [
    (["--placement.slot_memory_mib=2048"], ["'placement.slot_memory_mib'", "leave it 0"]),
    (["--selector=on"], ["'placement.device'", "--selector off"]),
])
def test_cuda_placements_that_cannot_work_are_refused(overrides: list[str],
                                                      words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        from_dict(RunConfig, parse_overrides(["--placement.device=cuda", *overrides]))
    for w in words:
        assert w in str(e.value)



def test_validate_plans_the_gpus_the_driver_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    cfg = load_config(None, ["--placement.device=cuda", "--algorithm.kl_coef=0"])
    assert cfg.placement.device == "cuda"  # rollout 1 + trainer 1 on 2 GPUs
    with pytest.raises(ValueError, match="= 3 GPUs, but 2 are visible"):
        load_config(None, ["--placement.device=cuda", "--placement.rollout=2",
                           "--algorithm.kl_coef=0"])
    with pytest.raises(ValueError, match=r"trainer 1 \+ reference 1 = 3 GPUs"):
        load_config(None, ["--placement.device=cuda", "--algorithm.kl_coef=0.01"])


# ------------------------------------------------------------------ what each actor sees


def test_each_slot_sets_cuda_visible_devices_to_its_own_gpus() -> None:
    pl = PlacementConfig(rollout=2, rollout_tp=2, trainer=2, rollout_slot_memory_mib=40_000)
    with gpu_slots(pl, reference=1, gpus=8) as pool:
        env = {n: pool[n].env(parent={}) for n in
               ("rollout0", "rollout1", "trainer0", "trainer1", "reference0")}
        assert {n: e["CUDA_VISIBLE_DEVICES"] for n, e in env.items()} == {
            "rollout0": "0,1", "rollout1": "2,3", "trainer0": "4", "trainer1": "5",
            "reference0": "6"}
        assert pool["rollout0"].memory_mib == 40_000 and pool["rollout0"].memory_cgroup == ""
        assert pool["rollout0"].memory_enforcement == "device"
        assert pool["trainer0"].memory_mib is None  # the whole GPU
        assert pool.statistics().slots == 5


def test_slot_gpus_count_within_the_drivers_own_visible_devices() -> None:
    s = Slot(name="t", gpus=(1, 2))
    assert s.env(parent={"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {"CUDA_VISIBLE_DEVICES": "5,6"}
    uuids = "GPU-aaaa, GPU-bbbb, GPU-cccc"
    assert s.env(parent={"CUDA_VISIBLE_DEVICES": uuids})["CUDA_VISIBLE_DEVICES"] == \
        "GPU-bbbb,GPU-cccc"
    with pytest.raises(ValueError, match=r"slot GPU\(s\) \[2\] beyond .*CUDA_VISIBLE_DEVICES"):
        s.env(parent={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert Slot(name="cpu", cores=(0, 1)).env(parent={}) == {"OMP_NUM_THREADS": "2"}


def test_a_slot_refuses_repeated_or_negative_gpus() -> None:
    with SlotPool(use_cgroups=False) as pool, pytest.raises(ValueError, match="distinct"):
        pool.create("x", gpus=(1, 1))
    with SlotPool(use_cgroups=False) as pool, pytest.raises(ValueError, match="distinct"):
        pool.create("y", gpus=(-1,))


# ------------------------------------------------------------------ the stage configs of a run


class FakeRuntime:
    def __init__(self) -> None:
        self.spawned: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    async def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> str:
        self.spawned[name] = (args, kwargs)
        return name

    async def free_address(self, name: str, n: int, rank: int = 0) -> tuple[str, int]:
        return "127.0.0.1", 29500  # the rendezvous of a group's rank 0 (Runtime.free_address)


def _job(tmp_path: Path, overrides: list[str]) -> Any:
    from earl.loop.devices import device_roles
    from earl.loop.supervisor import Supervisor

    cfg = from_dict(RunConfig, parse_overrides(overrides))
    n_ref = cfg.placement.reference if cfg.algorithm.kl_coef > 0 else 0
    slots = gpu_slots(cfg.placement, reference=n_ref, gpus=8) \
        if cfg.placement.device == "cuda" else None
    return SimpleNamespace(cfg=cfg, rt=FakeRuntime(), env={}, slots=slots, start=tmp_path,
                           roles=device_roles(cfg.placement, reference=n_ref),
                           weights=tmp_path / "w", n_reference=n_ref, max_model_len=512,
                           supervisor=Supervisor(max_restarts=0, log=lambda s: None))


async def _spawn_all(job: Any) -> dict[str, tuple[tuple[Any, ...], dict[str, Any]]]:
    """Build the trainer, reference and rollout stages as a run's attempt does."""
    from earl.loop.actors import Actors
    from earl.loop.stages import Building, Reference, Rollout, Trainer

    b = Building(job=job, actors=Actors(), version=0)
    for stage in (Trainer(), Reference(), Rollout()):
        await stage.build(b)
    return job.rt.spawned


@pytest.mark.timeout(30)
async def test_earl_train_on_cuda_puts_every_stage_on_its_own_gpus(tmp_path: Path) -> None:
    job = _job(tmp_path, ["--placement.device=cuda", "--placement.dtype=bfloat16",
                          "--placement.rollout=2", "--placement.rollout_tp=2",
                          "--placement.trainer=2", "--placement.trainer_tp=2",
                          "--placement.rollout_slot_memory_mib=30000",
                          "--algorithm.kl_coef=0.01"])
    spawned = await _spawn_all(job)
    (tcfg, _), tkw = spawned["trainer"]
    assert (tcfg.compute.device, tcfg.compute.dtype, tcfg.tp, tcfg.parallel) == \
        ("cuda", "bfloat16", 2, "ddp")
    assert [s.env(parent={})["CUDA_VISIBLE_DEVICES"] for s in tkw["slot"]] == ["4", "5"]
    (rcfg,), rkw = spawned["reference"]
    assert isinstance(rcfg, ReferenceConfig)
    assert (rcfg.compute.device, rcfg.compute.dtype) == ("cuda", "bfloat16")
    assert [s.env(parent={})["CUDA_VISIBLE_DEVICES"] for s in rkw["slot"]] == ["6"]
    (ecfg, _version), ekw = spawned["rollout"]
    assert (ecfg.compute.device, ecfg.compute.dtype, ecfg.tensor_parallel_size) == \
        ("cuda", "bfloat16", 2)
    assert ecfg.gpu_memory_mib == 30000
    assert [s.env(parent={})["CUDA_VISIBLE_DEVICES"] for s in ekw["slot"]] == ["0,1", "2,3"]
    assert engine_args(ecfg, gpu_total_mib=80000)["gpu_memory_utilization"] == 0.375
    job.slots.close()


@pytest.mark.timeout(30)
async def test_tensor_parallel_trainer_with_data_parallel_replicas_uses_fsdp(
        tmp_path: Path) -> None:
    job = _job(tmp_path, ["--placement.trainer=4", "--placement.trainer_tp=2",
                          "--algorithm.kl_coef=0"])
    (tcfg, _), _ = (await _spawn_all(job))["trainer"]
    assert (tcfg.tp, tcfg.parallel, tcfg.compute.device) == (2, "fsdp", "cpu")


@pytest.mark.timeout(30)
async def test_a_cpu_run_builds_the_stage_configs_it_always_did(tmp_path: Path) -> None:
    job = _job(tmp_path, ["--algorithm.kl_coef=0.01"])
    spawned = await _spawn_all(job)
    (tcfg, _), tkw = spawned["trainer"]
    assert (tcfg.compute.device, tcfg.compute.dtype, tcfg.tp, tcfg.parallel, tkw["slot"]) == \
        ("cpu", "float32", 1, "ddp", None)
    (rcfg,), rkw = spawned["reference"]
    assert (rcfg.compute.device, rcfg.compute.dtype, rkw["slot"]) == ("cpu", "float32", None)
    (ecfg, _), ekw = spawned["rollout"]
    assert (ecfg.compute.device, ecfg.compute.dtype, ecfg.tensor_parallel_size, ecfg.gpu_memory_mib,
            ekw["slot"]) == ("cpu", "float32", 1, 0, None)


# ------------------------------------------------------------------ each trainer rank's GPU


def test_each_trainer_rank_picks_its_own_gpu() -> None:
    assert tdist.own_gpu(0, 1) == 0
    assert tdist.own_gpu(3, 1) == 0  # its slot pinned it to one GPU: device 0 is its own
    assert tdist.own_gpu(2, 4) == 2  # no slots, several GPUs: the one of its rank
    with pytest.raises(ValueError, match="rank 4 has no GPU of its own: it sees 4"):
        tdist.own_gpu(4, 4)
    with pytest.raises(ValueError, match="sees no GPU"):
        tdist.own_gpu(0, 0)


def test_cuda_device_is_the_ranks_own_and_made_current(monkeypatch: pytest.MonkeyPatch) -> None:
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert [tdist.cuda_device(r) for r in range(4)] == [torch.device("cuda", r)
                                                        for r in range(4)]
    assert current == [0, 1, 2, 3]  # not torch.cuda.current_device() (GPU 0) for every rank


def test_the_trainer_asks_for_its_ranks_device(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from earl.models.tiny import build_tiny_model
    from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

    asked: list[int] = []

    def fake(rank: int) -> torch.device:
        asked.append(rank)
        return torch.device("cpu")

    monkeypatch.setattr(tdist, "cuda_device", fake)
    model = build_tiny_model(tmp_path / "m", hidden=32, layers=1, max_positions=64)
    TorchTrainer(TrainerConfig(model=str(model), compute=Compute(device="cuda")), rank=0,
                 world_size=1)
    assert asked == [0]


# ------------------------------------------------------------------ vLLM on CUDA


def test_cpu_engine_args_are_unchanged() -> None:
    cfg = EngineConfig(model="m", max_model_len=512, kv_cache_gb=0.25,
                       compute=Compute(dtype="float32"))
    assert engine_args(cfg) == {
        "model": "m", "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0,
        "max_num_seqs": 256, "logprobs_mode": "processed_logprobs", "enable_prefix_caching": True,
        "enable_chunked_prefill": False, "max_num_batched_tokens": 2048, "async_scheduling": False,
        "disable_log_stats": True, "kv_cache_memory_bytes": 1 << 28, "tensor_parallel_size": 1,
        "distributed_executor_backend": None}


def test_on_cuda_vllm_takes_the_slots_share_of_each_gpu() -> None:
    cfg = EngineConfig(model="m", compute=Compute(device="cuda"), gpu_memory_mib=40_000,
                       tensor_parallel_size=2)
    args = engine_args(cfg, gpu_total_mib=80_000)
    assert args["gpu_memory_utilization"] == 0.5
    assert args["kv_cache_memory_bytes"] is None  # it would override the utilization
    assert args["distributed_executor_backend"] == "mp"
    assert engine_args(EngineConfig(model="m", compute=Compute(device="cuda")),
                       gpu_total_mib=80_000)["gpu_memory_utilization"] == 0.9
    assert gpu_memory_utilization(81_559, 81_559) == 1.0
    with pytest.raises(ValueError, match="gpu_memory_mib=90000 exceeds this GPU's 80000 MiB"):
        engine_args(EngineConfig(model="m", compute=Compute(device="cuda"), gpu_memory_mib=90_000),
                    gpu_total_mib=80_000)
    with pytest.raises(ValueError, match="device: 'tpu' unknown"):
        EngineConfig(model="m", compute=Compute(device="tpu"))


class _Worker:
    def __init__(self, device: str) -> None:
        embed = torch.nn.Embedding(4, 2, device=device)
        head = torch.nn.Linear(2, 4, bias=False, device=device)
        model = SimpleNamespace(lm_head=head, model=SimpleNamespace(embed_tokens=embed))
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self.model = model

    def reload_weights(self, **kw: Any) -> None:
        pass


@pytest.mark.parametrize(("device", "repacked"), [("cpu", 1), ("meta", 0)])
def test_tied_head_is_retied_and_repacked_only_on_cpu(monkeypatch: pytest.MonkeyPatch,
                                                      device: str, repacked: int) -> None:
    calls: list[Any] = []
    fake = ModuleType("vllm.model_executor.layers.utils")
    fake.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: calls.append(layer)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.utils", fake)
    w = _Worker(device)
    reload_worker(w, items=[], path=None, tied=True)
    assert w.model.lm_head.weight is w.model.model.embed_tokens.weight
    assert len(calls) == repacked


# ------------------------------------------------------------------ the trainer's backend


@pytest.mark.timeout(30)
async def test_placement_backend_selects_megatron_with_its_tensor_parallel(
        tmp_path: Path) -> None:
    job = _job(tmp_path, ["--placement.backend=megatron", "--placement.trainer=4",
                          "--placement.trainer_tp=2", "--batch_size=16", "--group_size=4",
                          "--algorithm.kl_coef=0"])
    (tcfg, backend), _ = (await _spawn_all(job))["trainer"]
    assert backend == "megatron"
    assert (tcfg.tp, tcfg.parallel) == (2, "ddp")  # megatron's TP composes with DDP


@pytest.mark.parametrize(("overrides", "fix"), [
    (["--placement.backend=megatron", "--lora.rank=8"], "lora.rank=0"),
    (["--placement.backend=megatron", "--placement.shared_prefix=true"], "shared_prefix=false"),
    (["--placement.backend=megatron", "--selector", "on"], "--selector off"),
    (["--placement.backend=deepspeed"], "choose one of"),
])
def test_megatron_combinations_that_cannot_work_are_refused(overrides: list[str],
                                                            fix: str) -> None:
    with pytest.raises(ValueError, match="placement.backend") as e:
        load_config(None, overrides)
    assert fix in str(e.value)


@pytest.mark.timeout(30)
async def test_placement_trainer_pp_reaches_megatron_and_the_torch_backend_refuses_it(
        tmp_path: Path) -> None:
    job = _job(tmp_path, ["--placement.backend=megatron", "--placement.trainer=4",
                          "--placement.trainer_tp=2", "--placement.trainer_pp=2",
                          "--batch_size=16", "--group_size=4", "--algorithm.kl_coef=0"])
    (tcfg, backend), _ = (await _spawn_all(job))["trainer"]
    assert (backend, tcfg.tp, tcfg.pp, tcfg.parallel) == ("megatron", 2, 2, "ddp")
    with pytest.raises(ValueError, match="placement.backend=megatron"):
        PlacementConfig(trainer=2, trainer_pp=2)
    with pytest.raises(ValueError, match="trainer_tp 2 x trainer_pp 2 does not divide"):
        PlacementConfig(backend="megatron", trainer=2, trainer_tp=2, trainer_pp=2)
