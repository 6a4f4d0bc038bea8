"""vLLM as GPU users run it, and the plan `earl train --dry-run` prints, on a machine without a
GPU (issue 52): a CUDA plan's engine arguments are vLLM's GPU defaults in bf16 while a CPU run's
stay what they were; the dry run lays a stated 8-GPU machine out exactly as the run's spawning
would, and starts nothing."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from earl.commands.train import main as train_main
from earl.config import load_config
from earl.loop.stage_configs import engine_config
from earl.plan import Machine, machine, plan
from earl.stages.compute import Compute
from earl.stages.vllm_build import ENGINE_ENV, EngineConfig, engine_args

H100 = 81_920  # MiB, as `--gpu-memory-gib 80` states it
LAYOUT_8 = ["--placement.device=cuda", "--placement.rollout=2", "--placement.rollout_tp=2",
            "--placement.trainer=4", "--placement.trainer_tp=2", "--algorithm.kl_coef=0"]


def _cuda_args(overrides: list[str], gpus: int = 8) -> dict[str, Any]:
    cfg = load_config(None, ["--placement.device=cuda", *overrides], gpus=gpus)
    return engine_args(engine_config(cfg, model="m", max_model_len=1024), gpu_total_mib=H100)


def test_a_cuda_plan_gets_vllms_gpu_defaults_in_bf16() -> None:
    args = _cuda_args([])
    assert args["enforce_eager"] is False  # CUDA graphs
    assert args["enable_chunked_prefill"] is True
    assert args["async_scheduling"] is True
    assert args["max_num_batched_tokens"] is None  # vLLM's own budget, chunks as it goes
    assert args["dtype"] == "bfloat16"  # placement.dtype "auto" on CUDA
    assert args["kv_cache_memory_bytes"] is None and args["gpu_memory_utilization"] == 0.9
    # the core stays in the replica's process: weight loads pass tensors by reference
    assert ENGINE_ENV == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert _cuda_args(["--placement.dtype=float32"])["dtype"] == "float32"  # stated: kept
    from vllm import EngineArgs

    from earl.models.tiny import default_model_dir

    built = EngineArgs(**{**args, "model": str(default_model_dir())})  # all are vLLM's keywords
    assert (built.enforce_eager, built.enable_chunked_prefill, built.async_scheduling) == \
        (False, True, True)


def test_every_cpu_workaround_stays_on_cpu_only() -> None:
    cpu = engine_args(engine_config(load_config(), model="m", max_model_len=1024))
    assert (cpu["dtype"], cpu["enforce_eager"], cpu["enable_chunked_prefill"],
            cpu["async_scheduling"], cpu["max_num_batched_tokens"]) == \
        ("float32", True, False, False, 2048)
    assert "gpu_memory_utilization" not in cpu
    cuda = engine_args(EngineConfig(model="m", compute=Compute(device="cuda", dtype="float32")),
                       gpu_total_mib=H100)
    assert cuda["enforce_eager"] is False and cuda["enable_chunked_prefill"] is True


def _dry_run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = train_main([*argv, "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    return code, json.loads(out[-1])


@pytest.mark.timeout(60)
def test_dry_run_plans_an_8_gpu_node_from_a_cpu_machine(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import earl.run

    def no_run(*a: object, **k: object) -> None:
        raise AssertionError("a dry run started the run")

    monkeypatch.setattr(earl.run, "run", no_run)
    out = tmp_path / "run"
    code, res = _dry_run(capsys, *LAYOUT_8, f"--output-dir={out}", "--dry-run", "--gpus", "8",
                         "--gpu-memory-gib", "80")
    assert code == 0 and res["dry_run"] is True
    assert res["config"]["placement"]["device"] == "cuda"  # the resolved config
    p = res["plan"]
    assert p["machine"] == {"gpus": 8, "gpu_memory_mib": H100} and p["gpus_used"] == 8
    ro, tr = p["rollout"], p["trainer"]
    assert ro["devices"] == [[0, 1], [2, 3]] and tr["devices"] == [[4], [5], [6], [7]]
    assert (tr["backend"], tr["parallel"], tr["dp"], tr["tp"], tr["pp"], tr["dtype"]) == \
        ("torch", "fsdp", 2, 2, 1, "bfloat16")
    assert p["reference"]["ranks"] == 0
    assert len(ro["engine_args"]) == 2
    for args in ro["engine_args"]:
        assert (args["enforce_eager"], args["enable_chunked_prefill"], args["dtype"],
                args["tensor_parallel_size"]) == (False, True, "bfloat16", 2)
        assert args["model"] == str(out / "weights_start")
    assert not out.exists()  # nothing written, nothing started


@pytest.mark.timeout(60)
async def test_the_plan_is_what_the_run_spawns(tmp_path: Path) -> None:
    """The plan's GPUs and engine configs are the ones the run's stages (`earl.loop.stages`) hand the actors."""
    from earl.loop.actors import Actors
    from earl.loop.devices import device_roles, gpu_slots
    from earl.loop.stages import Building, Reference, Rollout, Trainer
    from earl.loop.supervisor import Supervisor

    overrides = [*LAYOUT_8[:-1], "--placement.trainer=2", "--placement.trainer_tp=1",
                 "--placement.rollout_slot_memory_mib=40960", "--algorithm.kl_coef=0.01",
                 f"--output-dir={tmp_path}"]
    cfg = load_config(None, overrides, gpus=8)
    p = plan(cfg, Machine(gpus=8, gpu_memory_mib=H100))
    spawned: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    class Rt:
        async def spawn(self, name: str, cls: type, *args: Any, **kw: Any) -> str:
            spawned[name] = (args, kw)
            return name

        async def free_address(self, name: str, n: int) -> tuple[str, int]:
            return "127.0.0.1", 29500

    slots = gpu_slots(cfg.placement, reference=1, gpus=8)
    job = SimpleNamespace(cfg=cfg, rt=Rt(), env={}, slots=slots, out=tmp_path,
                          start=tmp_path / "weights_start", weights=tmp_path / "weights",
                          roles=device_roles(cfg.placement, reference=1), n_reference=1,
                          max_model_len=cfg.model.DEFAULT_CONTEXT,
                          supervisor=Supervisor(max_restarts=0, log=lambda s: None))

    b = Building(job=job, actors=Actors(), version=0)  # type: ignore[arg-type]
    for stage in (Trainer(), Reference(), Rollout()):
        await stage.build(b)
    slots.close()

    def gpus(kw: dict[str, Any]) -> list[list[int]]:
        return [list(s.gpus) for s in kw["slot"]]

    (ecfg, _), ekw = spawned["rollout"]
    assert gpus(ekw) == p.rollout.devices == [[0, 1], [2, 3]]
    assert [engine_args(ecfg, gpu_total_mib=H100)] * 2 == p.rollout.engine_args
    assert p.rollout.engine_args[0]["gpu_memory_utilization"] == 0.5
    (tcfg, backend), tkw = spawned["trainer"]
    assert gpus(tkw) == p.trainer.devices == [[4], [5]]
    assert (backend, tcfg.parallel, tcfg.compute.dtype) == (p.trainer.backend, p.trainer.parallel,
                                                            p.trainer.dtype)
    (rcfg,), rkw = spawned["reference"]
    assert gpus(rkw) == p.reference.devices == [[6]] and rcfg.compute.dtype == p.reference.dtype


def test_a_colocated_plan_gives_vllm_half_of_each_stated_gpu() -> None:
    cfg = load_config(None, ["--placement.device=cuda", "--placement.colocate=true",
                             "--placement.trainer=4", "--placement.rollout=2",
                             "--placement.rollout_tp=2"], gpus=4)
    p = plan(cfg, Machine(gpus=4, gpu_memory_mib=H100))
    assert p.rollout.devices == [[0, 1], [2, 3]] and p.trainer.devices == [[0], [1], [2], [3]]
    assert p.rollout.memory_mib_per_gpu == H100 // 2
    assert p.rollout.engine_args[0]["gpu_memory_utilization"] == 0.5
    assert p.rollout.engine_args[0]["enable_sleep_mode"] is True
    assert p.gpus_used == 4


def test_a_cpu_dry_run_shows_the_cpu_run(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    code, res = _dry_run(capsys, f"--output-dir={tmp_path / 'r'}", "--dry-run")
    assert code == 0
    p = res["plan"]
    assert (p["device"], p["machine"], p["trainer"]["dtype"]) == ("cpu", None, "float32")
    assert p["rollout"]["engine_args"][0]["enforce_eager"] is True
    code = train_main([f"--output-dir={tmp_path / 'r'}", "--dry-run"])
    assert code == 0 and "dry run: nothing started" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "words"), [
    (["--placement.device=cuda", "--dry-run"], ["no CUDA device is visible", "--gpus N",
                                                "--gpu-memory-gib G"]),
    (["--placement.device=cuda", "--dry-run", "--gpus", "8"],
     ["no GPU to plan for", "--gpu-memory-gib"]),
    (["--dry-run", "--gpus", "8"], ["placement.device=cuda"]),
    (["--gpus", "8"], ["add --dry-run"]),
    (["--placement.device=cuda", "--placement.rollout=4", "--dry-run", "--gpus", "4",
      "--gpu-memory-gib", "80"], ["= 6 GPUs, but 4", "placement.rollout"]),
])
def test_a_dry_run_that_cannot_plan_says_which_flag_to_set(
        capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU to plan for")
    code, res = _dry_run(capsys, *argv)
    assert code == 2 and res["exit_code"] == 2
    for w in words:
        assert w in res["error"]


def test_the_machine_is_checked() -> None:
    assert machine(8, 80) == Machine(gpus=8, gpu_memory_mib=H100)
    with pytest.raises(ValueError, match="--gpus must be >= 1"):
        machine(0, 80)
    with pytest.raises(ValueError, match="--gpu-memory-gib must be > 0"):
        machine(8, 0)
