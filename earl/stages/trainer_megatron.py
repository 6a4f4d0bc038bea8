"""`MegatronTrainer`: the `TorchTrainer` interface over a megatron-core ``GPTModel``.

Same endpoints and semantics as the torch backend (packed micro-batches, global-denominator
gradient accumulation, AdamW, clipping, bf16 autocast, HF-named weight export, checkpoints);
only the model differs: an HF Qwen2/Llama folder is converted into a megatron-core GPTModel
(local layer spec, no Transformer Engine) and back (`trainer_megatron_convert`). Data
parallelism is torch DDP over the data-parallel group (with PP > 1, a gradient sum after the
pipeline schedule). Tensor parallelism is megatron-core's own
(``TrainerConfig.tp``; column/row-parallel linears, vocabulary-parallel embedding and LM head):
ranks count TP fastest, as in `earl.runtime.layout.Layout`, so ranks ``0..tp-1`` are replica 0
and megatron's DP groups equal the trainer's. The LM head gathers full-vocabulary logits on
every TP rank, so the loss code is the torch backend's; the gradient norm is taken over the
whole sharded model and `named_weights` gathers full HF tensors (`trainer_megatron_tp`).
Pipeline parallelism is ``TrainerConfig.pp`` (PP slowest in the rank order, each stage its
share of the layers; the schedule and reductions are `trainer_megatron_pp`). With TP or PP > 1
a checkpoint is one file per TP x PP rank of the first replica (model and AdamW shards; DCP would
take megatron's plain-tensor shards for replicas), restored at the same TP and PP degrees only.

What megatron-core 0.16.1 does on CPU (measured): ``parallel_state`` over gloo and GPTModel
construction work as is; forward/backward work once two hard-coded CUDA calls are bypassed —
RoPE moving ``inv_freq`` to ``torch.cuda.current_device()`` and the CUDA RNG tracker fork
around attention dropout (dropout is 0 here). ``_cpu_compat`` does that for the duration of a
forward on CPU only. Megatron's own DDP, distributed optimizer and dist_checkpointing need CUDA
and are not used.

Packed samples attend through a block-diagonal causal mask. RoPE positions run on across the
packed row (megatron derives them from the row length, not from position ids); attention
scores depend only on position differences, so the result equals per-sample positions.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor, nn

from earl.packing import Packed
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_dist import free_dist_url, use_node_interface
from earl.stages.trainer_megatron_convert import (
    QwenShape,
    check_pp,
    check_tp,
    gather_pp,
    gather_tp,
    hf_to_mcore,
    mcore_to_hf,
)
from earl.stages.trainer_megatron_tp import clip_grad_norm_tp, gather_state_shards
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["MegatronTrainer", "build_gpt_model", "init_megatron_parallel"]


def init_megatron_parallel(rank: int, world_size: int, url: str | None,
                           device: torch.device, seed: int = 0, *, tp: int = 1,
                           pp: int = 1) -> None:
    """Join a process group (even of size 1, megatron needs one), init ``parallel_state`` with
    ``tp``-way tensor and ``pp``-way pipeline parallel (TP groups are consecutive ranks, PP
    slowest: megatron's default ``tp-cp-ep-dp-pp`` order) and, on CUDA, megatron's CUDA RNG
    states (its attention forks them; on CPU `_cpu_compat` bypasses the fork).

    Raises:
        ValueError: ``world_size > 1`` without ``url``, or ``parallel_state`` already set up
            with another TP or PP size in this process.
    """
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if world_size > 1 and url is None:
            raise ValueError("TrainerConfig.dist_url is needed with world_size > 1 "
                             "(earl.stages.trainer_dist.free_dist_url())")
        use_node_interface()  # gloo/NCCL over the interface peers on other hosts can reach
        dist.init_process_group(backend, init_method=url or free_dist_url(), rank=rank,
                                world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 pipeline_model_parallel_size=pp,
                                                 order="tp-cp-ep-dp-pp")
    elif (parallel_state.get_tensor_model_parallel_world_size(),
          parallel_state.get_pipeline_model_parallel_world_size()) != (tp, pp):
        raise ValueError(f"megatron parallel_state already runs TP="
                         f"{parallel_state.get_tensor_model_parallel_world_size()} PP="
                         f"{parallel_state.get_pipeline_model_parallel_world_size()} in this "
                         f"process, TrainerConfig.tp={tp} pp={pp}: call "
                         "megatron.core.parallel_state.destroy_model_parallel() first")
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_gpt_model(hf_config: PretrainedConfig, *, dtype: torch.dtype = torch.float32,
                    tp: int = 1, pp: int = 1) -> nn.Module:
    """An empty megatron-core GPTModel shaped like an HF Qwen2/Llama config (local spec),
    holding this rank's ``tp``-way shards of its pipeline stage's layers (``parallel_state``
    must be initialized with ``tp`` and ``pp``); its logits are full-vocabulary on every TP rank
    (``parallel_output=False``). With ``pp > 1`` a tied model's last stage holds an untied
    ``output_layer`` (megatron's own tying all-reduces the copy on ``.cuda()``; the trainer keeps
    it equal to the embeddings, `trainer_megatron_pp.reduce_grads`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = hf_config
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"megatron backend supports silu MLPs, the model uses {c.hidden_act!r}")
    rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta") \
        or getattr(c, "rope_theta", 10000.0)
    shape = QwenShape.from_hf_config(c)
    qkv_bias = getattr(c, "model_type", "") == "qwen2" or bool(getattr(c, "attention_bias", False))
    tcfg = TransformerConfig(
        num_layers=shape.layers, hidden_size=c.hidden_size, num_attention_heads=shape.heads,
        num_query_groups=shape.kv_heads, kv_channels=shape.head_dim,
        ffn_hidden_size=c.intermediate_size, normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, add_qkv_bias=qkv_bias,
        hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, persist_layer_norm=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, pipeline_dtype=dtype,
    )
    return GPTModel(
        config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=c.vocab_size, max_sequence_length=c.max_position_embeddings,
        position_embedding_type="rope", rotary_base=int(float(rope or 10000.0)),
        share_embeddings_and_output_weights=shape.tied and pp == 1,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(), parallel_output=False,
    )


@contextlib.contextmanager
def _cpu_compat(device: torch.device) -> Iterator[None]:
    """Bypass megatron-core's two hard-coded CUDA calls while running on CPU (see module doc)."""
    if device.type != "cpu":
        yield
        return
    from megatron.core import tensor_parallel

    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved_device, saved_fork = torch.cuda.current_device, tracker.fork
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    tracker.fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.current_device = saved_device  # type: ignore[assignment]
        tracker.fork = saved_fork  # type: ignore[method-assign]


def packed_causal_mask(packed: Packed) -> Tensor:
    """``[1, 1, T, T]`` bool mask, True where attention is *not* allowed (megatron convention)."""
    sid = packed.seq_ids
    t = sid.numel()
    causal = torch.ones(t, t, dtype=torch.bool, device=sid.device).tril()
    allowed = causal & (sid[:, None] == sid[None, :])
    return ~allowed[None, None]


class MegatronTrainer(TorchTrainer):
    """`TorchTrainer` with a megatron-core GPTModel inside (``parallel`` must be ``"ddp"``;
    ``tp`` > 1 is megatron tensor parallel, ``pp`` > 1 pipeline parallel; all ranks of one DP
    replica, its TP x PP ranks, get the same batch)."""

    pipeline = True

    def __init__(self, config: TrainerConfig, *, rank: int = 0, world_size: int = 1) -> None:
        if world_size > 1 and config.parallel != "ddp":
            raise ValueError("the megatron backend supports TrainerConfig.parallel='ddp' only "
                             "(tensor parallel is TrainerConfig.tp, data parallel is DDP)")
        if config.pp > 1 and (config.shared_prefix or config.lora.on):
            raise ValueError(f"TrainerConfig.pp={config.pp}: pipeline parallel runs without "
                             "shared_prefix and lora; set shared_prefix=False and lora.rank=0, "
                             "or pp=1")
        self.pp = config.pp
        self.pp_group: dist.ProcessGroup | None = None
        self.embedding_group: dist.ProcessGroup | None = None  # tied, PP > 1, first/last stage
        super().__init__(config, rank=rank, world_size=world_size)

    def _load_model(self) -> nn.Module:
        from megatron.core import parallel_state
        from safetensors.torch import load_file
        from transformers import AutoConfig

        self.hf_config = AutoConfig.from_pretrained(self.config.model)
        self.shape = QwenShape.from_hf_config(self.hf_config)
        check_tp(self.shape, self.tp)
        check_pp(self.shape, self.pp)
        init_megatron_parallel(self.rank, self.world_size, self.config.dist_url, self.device,
                               self.config.compute.seed, tp=self.tp, pp=self.pp)
        if self.pp > 1:  # the (dp * pp, tp) mesh's groups are not the DP groups: megatron's are
            self.dp_group = parallel_state.get_data_parallel_group() if self.dp_size > 1 else None
            self.pp_group = parallel_state.get_pipeline_model_parallel_group()
            if self.shape.tied and parallel_state.is_rank_in_embedding_group():
                self.embedding_group = parallel_state.get_embedding_group()
        elif self.dp_group is not None:  # DDP reduces over the trainer's DP group: same ranks
            mine = dist.get_process_group_ranks(self.dp_group)
            theirs = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
            assert mine == theirs, (mine, theirs)
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if self.tp > 1 else None
        files = _model_files(self.config.model)
        hf_state: dict[str, Tensor] = {}
        for f in files:
            hf_state.update(load_file(str(f)))
        model = build_gpt_model(self.hf_config, tp=self.tp, pp=self.pp)
        shard = hf_to_mcore(hf_state, self.shape, tp_size=self.tp,
                            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                            pp_size=self.pp,
                            pp_rank=parallel_state.get_pipeline_model_parallel_rank())
        missing, unexpected = model.load_state_dict(shard, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"HF -> megatron conversion of {self.config.model} left missing="
                             f"{missing[:5]} unexpected={unexpected[:5]}")
        return model.to(self.device)

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        if self.dp_size == 1 or self.pp > 1:  # TP: megatron's layers reduce; PP: reduce_grads
            return module
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, process_group=self.dp_group)

    def _forward(self, packed: Packed, keep: Tensor | None = None) -> Tensor:
        with _cpu_compat(self.device):
            logits = self.model(packed.input_ids[None], packed.position_ids[None],
                                attention_mask=packed_causal_mask(packed))
        return logits[0] if keep is None else logits[0, keep]

    def _stage_forward(self, packed: Packed, x: Tensor | None) -> Tensor:
        """The float32 output ``[T, 1, hidden]`` of a pipeline stage before the last, on input
        ``x`` (the previous stage's output; None on the first stage)."""
        if x is not None:
            self.module.set_input_tensor(x)  # type: ignore[operator]
        dev = self.device
        on_dev = Packed(input_ids=packed.input_ids.to(dev), position_ids=packed.position_ids.to(dev),
                        seq_ids=packed.seq_ids.to(dev), cu_seqlens=packed.cu_seqlens,
                        max_seqlen=packed.max_seqlen)
        with self._autocast(), _cpu_compat(dev):
            out: Tensor = self.model(on_dev.input_ids[None], on_dev.position_ids[None],
                                     attention_mask=packed_causal_mask(on_dev))
        return out.float()  # what travels between stages (and the gradient that comes back)

    @property
    def collective_weights(self) -> bool:
        """`TorchTrainer.collective_weights`; with PP > 1 reading weights gathers the stages."""
        return self.pp > 1 or super().collective_weights

    def tied_embedding(self) -> nn.Parameter | None:
        """A tied model's embedding weight on this stage (the last stage's copy with PP > 1)."""
        if not self.shape.tied:
            return None
        m = self.module
        if self.pp > 1 and self.pp_group is not None and \
                dist.get_rank(self.pp_group) == self.pp - 1:
            return m.output_layer.weight  # type: ignore[union-attr,return-value]
        return m.embedding.word_embeddings.weight  # type: ignore[union-attr,return-value]

    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        """`TorchTrainer.compute_logprobs`; with PP > 1 through the pipeline (every rank of
        the replica must call it and gets the log-probs)."""
        if self.pp == 1:
            return super().compute_logprobs(batch)
        from earl.stages.trainer_megatron_pp import pp_compute_logprobs

        return pp_compute_logprobs(self, batch)

    def accumulate(self, batch: TrainBatch,
                   micro_batches: list[list[int]] | None = None) -> dict[str, float]:
        """`TorchTrainer.accumulate`; with PP > 1 through the pipeline (`trainer_megatron_pp`),
        the metrics reported on every rank."""
        if self.pp == 1:
            return super().accumulate(batch, micro_batches)
        from earl.stages.trainer_megatron_pp import pp_accumulate

        return pp_accumulate(self, batch, micro_batches)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """HF-named full weights converted from the megatron model (tied ``lm_head`` left out).

        With TP or PP > 1 this gathers the shards and stages: every rank of the TP and PP
        groups must iterate it, and every one gets the full weights.
        """
        mc = {k: v.detach() for k, v in self.module.state_dict().items()
              if not k.endswith("_extra_state")}
        if self.tp_group is not None:
            mc = gather_tp(gather_state_shards(mc, self.tp_group))
        if self.pp_group is not None:
            from earl.stages.trainer_megatron_pp import gather_stages

            mc = gather_pp(gather_stages(mc, self.pp_group, self.device), self.shape)
        yield from mcore_to_hf(mc, self.shape).items()

    def optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        """`TorchTrainer.optimizer_step`; with TP or PP > 1 the gradient norm (reported and
        clipped to) is the whole model's, gathered over the TP and PP groups, a tied model's
        last-stage embedding copy left out (`clip_grad_norm_tp`)."""
        if self.tp_group is None and self.pp_group is None:
            return super().optimizer_step(lr_scale)
        self.resident()
        clip = self.config.optim.grad_clip
        tied = self.tied_embedding()
        copies = [tied] if tied is not None and self.pp_group is not None and \
            dist.get_rank(self.pp_group) > 0 else []
        norm = clip_grad_norm_tp(list(self.model.parameters()), clip if clip > 0 else math.inf,
                                 self.tp_group, pp_group=self.pp_group, copies=copies)
        scheduled = [float(g["lr"]) for g in self.optimizer.param_groups]
        for g, lr0 in zip(self.optimizer.param_groups, scheduled, strict=True):
            g["lr"] = lr0 * lr_scale
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return {"grad_norm": float(norm), "lr": scheduled[0] * lr_scale}

    def save_checkpoint(self, path: str | Path) -> None:
        """`TorchTrainer.save_checkpoint`; with TP or PP > 1 each rank of the first DP replica
        writes its own shard of the model and of AdamW's state (``megatron_tp<t>.pt``, with
        PP ``megatron_tp<t>_pp<p>.pt``: DCP would take megatron's plain per-rank shards for
        replicas), loadable at the same TP and PP degrees. All ranks must call it."""
        if self.tp == 1 and self.pp == 1:
            super().save_checkpoint(path)
            return
        from earl.stages.trainer_ckpt import save_rest

        self.resident()
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        if (self.rank // self.tp) % self.dp_size == 0:  # DP replica 0 holds every shard once
            save_shard({"model": self.module.state_dict(),
                        "optimizer": self.optimizer.state_dict()}, folder / self._shard_name())
        if self.rank == 0:
            (folder / "megatron_layout.json").write_text(
                json.dumps({"tp": self.tp, "pp": self.pp}) + "\n")
        save_rest(self, folder)

    def _shard_name(self) -> str:
        tp_rank = self.rank % self.tp
        if self.pp == 1:
            return f"megatron_tp{tp_rank}.pt"
        return f"megatron_tp{tp_rank}_pp{self.rank // (self.tp * self.dp_size)}.pt"

    def load_checkpoint(self, path: str | Path) -> None:
        """`TorchTrainer.load_checkpoint`; with TP or PP > 1 from the per-rank shards of
        `save_checkpoint`, at the same TP and PP degrees.

        Raises:
            ValueError: the checkpoint was saved at other TP or PP degrees, or is incomplete.
        """
        folder = Path(path)
        saved = json.loads((folder / "megatron_layout.json").read_text()) \
            if (folder / "megatron_layout.json").is_file() else {"tp": 1, "pp": 1}
        if (saved["tp"], saved.get("pp", 1)) != (self.tp, self.pp):
            raise ValueError(f"megatron checkpoint {folder} was saved at tp={saved['tp']} "
                             f"pp={saved.get('pp', 1)}, this trainer runs tp={self.tp} "
                             f"pp={self.pp}: resume with the same TrainerConfig.tp and pp")
        if self.tp == 1 and self.pp == 1:
            super().load_checkpoint(path)
            return
        from earl.stages.trainer_ckpt import load_rest

        mine = folder / self._shard_name()
        if not mine.is_file():
            raise ValueError(f"no megatron shard {mine}: the checkpoint is incomplete")
        state = torch.load(mine, map_location=self.device, weights_only=True)
        self.resident()
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        load_rest(self, folder)

    def _hf_for_saving(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config)


def _model_files(folder: str) -> list[Path]:
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"TrainerConfig.model={folder!r} has no *.safetensors weights")
    return files


def save_shard(state: dict[str, object], path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
