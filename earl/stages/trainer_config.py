"""The torch trainer's recipe: `TrainerConfig` (what `earl.stages.trainer_torch.TorchTrainer`
builds from, and what `earl.stages.reconfigure` re-spawns a group with)."""

from __future__ import annotations

from dataclasses import dataclass, field

from earl.algorithms.objective import LossConfig
from earl.packing import AttnMode
from earl.stages import trainer_dist as tdist
from earl.stages.compute import Compute, Packing
from earl.stages.lora import LoraConfig
from earl.stages.optim import OptimConfig

__all__ = ["TrainerConfig"]


@dataclass(kw_only=True, slots=True)
class TrainerConfig(Packing):
    """The torch trainer's recipe (placement — how many ranks — is the caller's business).
    Its `micro_batch_tokens` and `shared_prefix` are `earl.stages.compute.Packing`'s, which
    the run's placement holds too.

    Attributes:
        model: HF model folder (config.json + safetensors).
        optim: AdamW, warmup and gradient clipping (`earl.stages.optim.OptimConfig`).
        compute: device (on CUDA each rank takes its local GPU), dtype (``"bfloat16"``: bf16
            autocast over fp32 master weights; "auto" resolved here), torch intra-op threads,
            and the torch seed (`earl.stages.compute.Compute`).
        attention: ``"varlen"`` (per-sample causal SDPA) or ``"mask"`` (block-diagonal mask).
        parallel: ``"ddp"`` or ``"fsdp"`` (FSDP2) across data-parallel replicas.
        tp: tensor-parallel degree (DTensor plans on every decoder layer); the ranks form
            ``world_size // tp`` data-parallel replicas of ``tp`` ranks each (TP fastest, as in
            `earl.runtime.layout.Layout`). TP with more than one replica needs ``"fsdp"``.
        pp: pipeline-parallel stages (megatron backend only): ``dp * tp * pp`` ranks, PP slowest.
        dist_url: rendezvous address shared by all ranks (``trainer_dist.free_dist_url()``).
        log_entropy: compute the policy entropy metric even when ``loss.entropy_coef`` is 0.
        loss: the objective (see `earl.algorithms.LossConfig`); log-probs are of
            ``logits / loss.temperature``, the rollout's sampling temperature.
        lora: low-rank adapters (`earl.stages.lora.LoraConfig`; rank 0 = full fine-tuning).
            With adapters the optimizer holds only them, `named_weights` gives the merged
            weights, and a KL term reads the base policy (the adapter switched off) computed
            here when the batch carries no reference log-probs.
        recompute: recompute activations in the backward (HF gradient checkpointing,
            non-reentrant): less memory per token for ~1/3 more compute; `set_recompute`
            switches it between steps.
        record_dir: a folder where each replica leader appends, before the step is acked,
            the sample ids its step trained (`trained.<rank>.jsonl`: one line per step,
            `{"step", "rank", "sample_ids"}`, the ids packed as runs: `earl.stages.id_runs`),
            for an oracle of what entered a gradient
            (`earl chaos`); "" = none.
    """

    model: str
    optim: OptimConfig = field(default_factory=OptimConfig)
    compute: Compute = field(default_factory=Compute)
    attention: AttnMode = "varlen"
    parallel: tdist.Parallel = "ddp"
    tp: int = 1
    pp: int = 1
    dist_url: str | None = None
    log_entropy: bool = True
    loss: LossConfig = field(default_factory=LossConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    recompute: bool = False
    record_dir: str = ""

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if isinstance(self.lora, dict):
            self.lora = LoraConfig(**self.lora)
        if isinstance(self.optim, dict):
            self.optim = OptimConfig(**self.optim)
        self.compute = Compute.coerce(self.compute)
        if self.micro_batch_tokens < 1:
            raise ValueError(f"TrainerConfig.micro_batch_tokens must be >= 1, got "
                             f"{self.micro_batch_tokens}")
        if self.attention not in ("varlen", "mask"):
            raise ValueError(f"TrainerConfig.attention must be 'varlen' or 'mask', got "
                             f"{self.attention!r}")
        if self.shared_prefix and self.attention != "varlen":
            raise ValueError("TrainerConfig.shared_prefix needs attention='varlen'")
        if self.parallel not in ("ddp", "fsdp"):
            raise ValueError(f"TrainerConfig.parallel must be 'ddp' or 'fsdp', got {self.parallel!r}")
        if self.tp < 1:
            raise ValueError(f"TrainerConfig.tp must be >= 1, got {self.tp}")
        if self.pp < 1:
            raise ValueError(f"TrainerConfig.pp must be >= 1, got {self.pp}")
