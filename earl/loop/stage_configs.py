"""Each stage's actor config, built from a run's config sections: the trainer's `TrainerConfig`,
the reference's `ReferenceConfig` and a rollout replica's `EngineConfig` (how many reference
actors run is `RunConfig.reference_actors`). What every stage computes with is one `earl.stages.compute.Compute` (`compute`: the
placement's hardware and the run's seed, "auto" resolved), the log-prob temperature is the
algorithm's (`LossConfig.temperature`), and the trainer's packing and the rollout's KV budget are
the placement's sections (`earl.stages.compute.Packing`, `KvCache`): no builder copies a field
by hand.

Pure functions of the run config and of the few facts only a live run has (the starting
policy's folder, the context window, the trainer's rendezvous address), passed in: the run's
spawning (`earl.loop.spawn`) builds its actors from them, and `earl.plan` shows what a run would
build without starting anything.

Not here: spawning, where each rank runs (`earl.loop.devices`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from earl.stages.compute import Compute, KvCache, Packing, fields_of

if TYPE_CHECKING:
    from earl.config import RunConfig
    from earl.stages.reference import ReferenceConfig
    from earl.stages.trainer_config import TrainerConfig
    from earl.stages.vllm_build import EngineConfig

__all__ = ["compute", "engine_config", "reference_config", "trainer_config"]


def compute(cfg: RunConfig) -> Compute:
    """What every stage of the run computes with: the placement's hardware (device, dtype
    resolved, threads) and the run's seed."""
    return Compute.of(cfg.placement, cfg.seed)


def trainer_config(cfg: RunConfig, *, model: str, dist_url: str | None = None,
                   record_dir: str = "") -> TrainerConfig:
    """The trainer ranks' config: `model` is the starting policy's folder, `dist_url` the
    ranks' rendezvous (None for one rank), `record_dir` where trained sample ids go."""
    from earl.stages.trainer_config import TrainerConfig

    pl = cfg.placement
    return TrainerConfig(model=model, optim=cfg.optim, loss=cfg.algorithm.loss(),
                         compute=compute(cfg), **fields_of(Packing, pl), dist_url=dist_url,
                         lora=cfg.lora, record_dir=record_dir, tp=pl.trainer_tp, pp=pl.trainer_pp,
                         # DDP does not compose with DTensor tensor parallel; FSDP2 does
                         # (megatron's tensor parallel composes with DDP)
                         parallel="fsdp" if 1 < pl.trainer_tp < pl.trainer
                         and pl.backend == "torch" else "ddp")


def reference_config(cfg: RunConfig, *, model: str) -> ReferenceConfig:
    """The reference actors' config (`model`: the starting policy, the KL anchor)."""
    from earl.stages.reference import ReferenceConfig

    return ReferenceConfig(model=model, compute=compute(cfg), loss=cfg.algorithm.loss())


def engine_config(cfg: RunConfig, *, model: str, max_model_len: int) -> EngineConfig:
    """A rollout replica's vLLM config serving `model`, with the rollout's context window
    (`placement.context_window`, else `max_model_len`), without async scheduling under
    "inflight_keep_kv" weight loads. On CUDA the caller sets ``gpu_memory_mib`` from the
    replica's slot."""
    from earl.stages.vllm_build import EngineConfig

    pl = cfg.placement
    return EngineConfig(model=model, max_model_len=pl.context_window or max_model_len,
                        compute=compute(cfg), **fields_of(KvCache, pl),
                        tensor_parallel_size=pl.rollout_tp,
                        sleep_mode=pl.colocate and pl.device == "cuda",
                        # a keep-KV load must find no batch in flight (VLLMEngine.update_weights)
                        async_scheduling=cfg.weight_update != "inflight_keep_kv")
