"""`TorchTrainer`: the policy's optimizer loop in plain torch, usable in-process or in an actor.

Loads an HF causal LM folder, computes per-token log-probs, and does optimizer steps on
`TrainBatch`es: token-budget micro-batches with sequence packing, gradient accumulation, AdamW,
gradient clipping, fp32 or bf16 autocast, DDP or FSDP2 across ranks. It exports weights with HF
names for the rollout side and saves/loads checkpoints (model, optimizer, schedule, RNG).

It does not compute advantages, talk to the dock or decide when to sync weights (the run loop
does); the actor wrapper is `earl.stages.trainer.TrainerActor`.

Example:
    >>> t = TorchTrainer(TrainerConfig(model="/path/to/hf_folder", optim=OptimConfig(lr=1e-4)))
    >>> metrics = t.train_step(batch)            # one optimizer step
    >>> for name, tensor in t.named_weights(): ...
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from earl.algorithms.objective import LossConfig, policy_objective
from earl.packing import (
    Packed,
    pack,
    packed_forward,
    plan_micro_batches,
    scored_positions,
    set_attention,
    token_entropy,
    token_logprobs,
)
from earl.runtime import heap
from earl.runtime.selector.profile import peak_bytes, reset_peak
from earl.stages import trainer_dist as tdist
from earl.stages.lora import adapter_disabled, apply_lora, base_model, merged_weights
from earl.stages.trainer_batch import MicroBatch, TrainBatch, step_totals
from earl.stages.trainer_config import TrainerConfig
from earl.stages.trainer_offload import Moved, offload, onload

__all__ = ["TorchTrainer", "TrainerConfig"]


class TorchTrainer:
    """Policy model + AdamW on one data-parallel rank.

    Args:
        config: the recipe.
        rank: this rank (0-based) among ``world_size`` trainer ranks.
        world_size: number of trainer ranks (``dp * tp * pp``); > 1 joins a process group
            at ``config.dist_url`` (all ranks must construct their trainer concurrently).
    """

    pipeline = False  # whether this backend runs TrainerConfig.pp > 1

    def __init__(self, config: TrainerConfig, *, rank: int = 0, world_size: int = 1) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        if not Path(config.model, "config.json").is_file():
            raise ValueError(f"TrainerConfig.model={config.model!r} is not an HF model folder "
                             "(no config.json); build one with earl.models.tiny.build_tiny_model")
        torch.set_num_threads(config.compute.threads)
        self.device = tdist.cuda_device(rank) if config.compute.device == "cuda" \
            else torch.device("cpu")
        self._trimmer = heap.Trimmer()
        if config.pp > 1 and not self.pipeline:
            raise ValueError(f"TrainerConfig.pp={config.pp}: the torch backend has no pipeline "
                             "parallel; set pp=1, or use the megatron backend")
        if world_size % (config.tp * config.pp):
            raise ValueError(f"TrainerConfig.tp={config.tp} does not divide world_size={world_size}"
                             f" into pp={config.pp} stages of dp * tp ranks: spawn dp * tp * pp")
        self.tp, self.dp_size = config.tp, world_size // (config.tp * config.pp)
        self.distributed = tdist.init_distributed(rank, world_size, config.dist_url, self.device)
        self.mesh = tdist.build_mesh(world_size, config.tp, self.device) if self.distributed else None
        self.dp_group = tdist.dp_group(self.mesh)  # reductions over data: DP ranks only
        if config.lora.on and self.distributed and (config.parallel == "fsdp" or config.tp > 1):
            raise ValueError("TrainerConfig.lora: adapters train with DDP only; set "
                             "parallel='ddp' and tp=1, or lora.rank=0 for full fine-tuning")
        torch.manual_seed(config.compute.seed)
        self.module: nn.Module = self._load_model()  # the unwrapped model
        self.model = self._wrap_model(self.module) if self.distributed else self.module
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],  # LoRA: the adapters
            lr=config.optim.lr, betas=config.optim.betas,
            eps=config.optim.adam_eps, weight_decay=config.optim.weight_decay,
            foreach=False if config.tp > 1 else None,  # foreach cannot mix DTensor and Tensor
        )
        warm = config.optim.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm > 0 else 1.0
        )
        self.set_recompute(config.recompute)
        self.step = 0  # optimizer steps taken = the policy version this trainer holds
        self.offloaded = False  # parameters and optimizer state in host memory (`offload`)

    # ------------------------------------------------------------------ backend hooks

    def _load_model(self) -> nn.Module:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(self.config.model, dtype=torch.float32)
        hf.to(self.device)  # type: ignore[arg-type]
        set_attention(hf, self.config.attention)
        self._tied = set(getattr(hf, "all_tied_weights_keys", {}) or {})
        if self.config.lora.on:
            return apply_lora(hf, self.config.lora)
        return hf

    def _wrap_model(self, module: nn.Module) -> nn.Module:
        return tdist.wrap_model(module, self.config.parallel, self.device, self.mesh)

    def _forward(self, packed: Packed, keep: Tensor | None = None) -> Tensor:
        """Logits ``[T, V]`` of a packed row already on the device (rows ``keep`` only)."""
        return packed_forward(self.model, packed, keep)

    # ------------------------------------------------------------------ forward

    def _autocast(self) -> contextlib.AbstractContextManager[None]:
        if self.config.compute.dtype == "bfloat16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _scored_logits(self, sub: MicroBatch, at: Tensor) -> Tensor:
        """Logits predicting the tokens ``at`` of a micro-batch (the rows ``at - 1``)."""
        if not self.config.shared_prefix:
            return self._logits(sub.packed, keep=at - 1)
        from earl.packing_prefix import share_prefixes, shared_forward

        sp = share_prefixes(sub.packed, sub.loss_mask)
        sp.input_ids = sp.input_ids.to(self.device)
        sp.position_ids = sp.position_ids.to(self.device)
        with self._autocast():
            logits = shared_forward(self.model, sp, at - 1)
        return self._scaled(logits)

    def _scaled(self, logits: Tensor) -> Tensor:
        logits = logits.float()
        if self.config.loss.temperature != 1.0:
            logits = logits / self.config.loss.temperature
        return logits

    def _logits(self, packed: Packed, keep: Tensor | None = None) -> Tensor:
        on_dev = Packed(
            input_ids=packed.input_ids.to(self.device),
            position_ids=packed.position_ids.to(self.device),
            seq_ids=packed.seq_ids.to(self.device),
            cu_seqlens=packed.cu_seqlens,  # stays on CPU: the varlen loop reads its bounds
            max_seqlen=packed.max_seqlen,
        )
        with self._autocast():
            logits = self._forward(on_dev, None if keep is None else keep.to(self.device))
        return self._scaled(logits)

    def _plan(self, batch: TrainBatch,
              micro_batches: list[list[int]] | None = None) -> list[list[int] | None]:
        """Local micro-batches (``micro_batches``, e.g. from the dispatcher's plan, or packed to
        ``micro_batch_tokens``), padded with ``None`` so every rank runs the same number."""
        if micro_batches is None:
            micro_batches = plan_micro_batches(batch.lengths.tolist(),
                                               self.config.micro_batch_tokens)
        plan: list[list[int] | None] = [list(mb) if mb else None for mb in micro_batches]
        count = int(tdist.all_reduce(torch.tensor([len(plan)]), "max", group=self.dp_group)[0])
        return plan + [None] * (count - len(plan))

    def _dummy_forward(self) -> Tensor:
        """A 1-token forward with zero loss, keeping DDP/FSDP collectives in lockstep."""
        logits = self._logits(pack([torch.zeros(1, dtype=torch.long)]))
        return logits.sum() * 0.0

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> Tensor:
        """Per-token log-probs ``[T]`` of ``batch`` under the current weights (0 at sample starts).

        With world_size > 1 every rank must call this (FSDP gathers parameters), each with its
        own shard of samples. Store the result as ``batch.old_logprobs`` for decoupled PPO/TIS
        when a batch is reused for several optimizer steps.
        """
        self.resident()
        out = torch.zeros(batch.num_tokens)
        cu = batch.cu_seqlens.tolist()
        for mb in self._plan(batch):
            if mb is None:
                self._dummy_forward()
                continue
            packed = batch.select(mb).packed
            lp = token_logprobs(self._logits(packed), packed).cpu()
            offs = packed.cu_seqlens.tolist()
            for j, i in enumerate(mb):
                out[cu[i]:cu[i + 1]] = lp[offs[j]:offs[j + 1]]
        return out

    # ------------------------------------------------------------------ training

    def accumulate(self, batch: TrainBatch,
                   micro_batches: list[list[int]] | None = None) -> dict[str, float]:
        """Forward/backward ``batch`` into the gradients (no optimizer step).

        The loss of every micro-batch is normalised by the *global* (all micro-batches, all
        DP ranks) aggregation denominator, so the accumulated gradient equals that of one big
        batch, whatever the micro-batching or the layout. TP ranks of one replica get the same
        ``batch``; ``micro_batches`` (indices into it; an empty one runs a padding forward)
        overrides the ``micro_batch_tokens`` packing.

        Returns:
            Step-level means of the loss terms (``loss``, ``pg_loss``, ``clip_frac``, ``kl``,
            ``entropy``, ...) plus ``tokens``, ``loss_tokens``, ``samples``, ``micro_batches``.
        """
        self.resident()
        cfg = self.config.loss
        self.model.train()
        plan = [None if mb is None else batch.select(mb)
                for mb in self._plan(batch, micro_batches)]
        totals = step_totals(batch, plan, cfg.agg, self.dp_group)
        denom = float(totals[0])
        scale = float(self.dp_size)  # DDP/FSDP average gradients over DP ranks
        sums: dict[str, Tensor] = {}
        want_entropy = cfg.entropy_coef > 0 or self.config.log_entropy
        for k, sub in enumerate(plan):
            last = k == len(plan) - 1
            no_sync = getattr(self.model, "no_sync", None)  # DDP: all-reduce on the last only
            sync = contextlib.nullcontext() if last or no_sync is None else no_sync()
            with sync:
                if sub is None:
                    self._dummy_forward().backward()
                    continue
                loss, metrics = self._micro_loss(sub, denom, want_entropy)
                (loss * scale).backward()
            for name, v in metrics.items():
                sums[name] = sums.get(name, torch.zeros((), dtype=torch.float64)) + v.double().cpu()
        # a rank may have run only padding micro-batches: report the names the config implies
        names = _metric_names(cfg, want_entropy, batch, self._reference_here)
        assert set(sums) <= set(names), (sorted(sums), names)
        zero = torch.zeros((), dtype=torch.float64)
        vec = tdist.all_reduce(torch.stack([sums.get(n, zero) for n in names]),
                               group=self.dp_group)
        out = {n: float(v) for n, v in zip(names, vec, strict=True)}
        out.update(tokens=float(totals[1]), loss_tokens=float(totals[2]),
                   samples=float(totals[3]), micro_batches=float(len(plan)))
        return out

    def _micro_loss(
        self, sub: MicroBatch, denom: float, want_entropy: bool
    ) -> tuple[Tensor, dict[str, Tensor]]:
        dev = self.device

        def opt(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(dev)

        # Every loss term is masked: the LM head runs only where a trained token is predicted.
        at = scored_positions(sub.packed, sub.loss_mask).to(dev)
        logits = self._scored_logits(sub, at)
        logprobs = token_logprobs(logits, sub.packed, at)
        ref_logprobs = opt(sub.ref_logprobs)
        if ref_logprobs is None and self._reference_here:
            with torch.no_grad(), adapter_disabled(self.module):
                ref_logprobs = token_logprobs(self._scored_logits(sub, at), sub.packed, at)
        entropy = None
        if want_entropy:
            if self.config.loss.entropy_coef > 0:
                entropy = token_entropy(logits, sub.packed, at)
            else:
                with torch.no_grad():
                    entropy = token_entropy(logits, sub.packed, at)
        return policy_objective(
            self.config.loss,
            logprobs=logprobs,
            advantages=sub.advantages.to(dev),
            mask=sub.loss_mask.to(dev),
            seq_ids=sub.packed.seq_ids.to(dev),
            old_logprobs=opt(sub.old_logprobs),
            rollout_logprobs=opt(sub.rollout_logprobs),
            ref_logprobs=ref_logprobs,
            entropy=entropy,
            denom=denom,
        )

    def optimizer_step(self, lr_scale: float = 1.0) -> dict[str, float]:
        """Clip, step AdamW and the LR schedule, zero the gradients; returns grad_norm and lr.

        `lr_scale` multiplies this step's scheduled LR (the caller's annealing, e.g. over a
        wall-clock budget); the schedule itself is unchanged, so checkpoints do not hold it.
        """
        self.resident()
        scheduled = [float(g["lr"]) for g in self.optimizer.param_groups]
        for g, lr0 in zip(self.optimizer.param_groups, scheduled, strict=True):
            g["lr"] = lr0 * lr_scale
        lr = scheduled[0] * lr_scale
        params = [p for p in self.model.parameters() if p.grad is not None]
        clip = self.config.optim.grad_clip
        max_norm = clip if clip > 0 else math.inf
        if self.tp > 1:  # DTensor and plain gradients side by side
            norm = tdist.clip_grad_norm(params, max_norm)
        else:
            norm = tdist.full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self.step += 1
        return {"grad_norm": float(norm), "lr": lr}

    def train_step(self, batch: TrainBatch, lr_scale: float = 1.0,
                   micro_batches: list[list[int]] | None = None) -> dict[str, float]:
        """One optimizer step on ``batch`` (this rank's shard); returns step metrics.

        When ``batch.old_logprobs`` is None, the proximal policy is the current one (exact for
        the first update after the weights the batch should be compared against).
        """
        reset_peak(self.device)
        t0 = time.perf_counter()
        metrics = self.accumulate(batch, micro_batches)
        metrics.update(self.optimizer_step(lr_scale))
        metrics["peak_rss_mib"] = peak_bytes(self.device) / 2**20
        if self.device.type == "cpu":  # a heap that crept goes back to the OS
            metrics["heap_trim_s"] = self._trimmer.after_step()
        dt = time.perf_counter() - t0
        metrics.update(step=float(self.step), step_time_s=dt, tokens_per_s=metrics["tokens"] / dt)
        return metrics

    def set_recompute(self, on: bool) -> None:
        """Recompute activations in the backward from the next step on (HF gradient
        checkpointing), or stop.

        Raises:
            ValueError: the model has no gradient checkpointing (not an HF model).
        """
        hf: Any = self.module
        if on and not hasattr(hf, "gradient_checkpointing_enable"):
            raise ValueError(f"TrainerConfig.recompute: {type(hf).__name__} has no gradient "
                             "checkpointing; set recompute=False")
        if on:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif getattr(hf, "is_gradient_checkpointing", False):
            hf.gradient_checkpointing_disable()
        self.config = replace(self.config, recompute=on)

    # ------------------------------------------------------------------ weights

    @property
    def _reference_here(self) -> bool:
        """A KL term against the base policy this trainer computes itself (adapters off)."""
        return self.config.lora.on and self.config.loss.kl_coef > 0

    @property
    def collective_weights(self) -> bool:
        """Whether reading full weights is a collective (FSDP or TP: every rank must join)."""
        return self.distributed and (self.config.parallel == "fsdp" or self.tp > 1)

    def named_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(HF name, tensor)`` of every weight, tied duplicates (``lm_head``) left out.

        Under FSDP this gathers each tensor: every rank must iterate it fully. With LoRA these
        are the merged weights (base + adapters), what the rollout serves.
        """
        if self.config.lora.on:
            yield from ((n, t) for n, t in merged_weights(self.module) if n not in self._tied)
            return
        for name, t in tdist.named_full_params(self.model):
            if name not in self._tied:
                yield name, t.detach()

    def weight_buckets(self, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, Tensor]]]:
        """``named_weights`` grouped into lists of about ``bucket_bytes`` (for weight sync)."""
        from earl.stages.weights import iter_buckets

        yield from iter_buckets(self.named_weights(), bucket_bytes)

    def save_hf(self, out_dir: str | Path) -> Path:
        """Write an HF folder (weights, config, and the source folder's tokenizer files)."""
        import shutil

        out = Path(out_dir)
        state = dict(self.named_weights())
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            self._hf_for_saving().save_pretrained(out, state_dict=state)  # type: ignore[operator]
            for f in Path(self.config.model).iterdir():
                if f.is_file() and ("token" in f.name or f.name.endswith((".jinja", ".txt"))):
                    shutil.copy2(f, out / f.name)
        return out

    def _hf_for_saving(self) -> nn.Module:
        return base_model(self.module)

    def save_checkpoint(self, path: str | Path) -> None:
        """Save model, optimizer, schedule, step and this rank's RNG under folder ``path``."""
        from earl.stages.trainer_ckpt import save_checkpoint

        save_checkpoint(self, Path(path))

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore what ``save_checkpoint`` wrote, at any layout (parameters and optimizer
        state are resharded to this trainer's)."""
        from earl.stages.trainer_ckpt import load_checkpoint

        load_checkpoint(self, Path(path))

    def offload(self) -> Moved:
        """Parameters, gradients and optimizer state to host memory, freeing this rank's GPU
        for a colocated rollout (`earl.stages.trainer_offload`; on CPU nothing moves)."""
        self.offloaded = True
        return offload(self.model, self.optimizer)

    def resident(self) -> Moved:
        """Undo `offload` (a no-op when nothing is offloaded); computing calls it first."""
        if not self.offloaded:
            return Moved(parameters=0, gradients=0, optimizer=0, seconds=0.0)
        self.offloaded = False
        return onload(self.model, self.optimizer, self.device)

    def close(self) -> None:
        """Leave the process group (if this trainer joined one)."""
        import torch.distributed as dist

        if self.distributed and dist.is_initialized():
            dist.destroy_process_group()
        self.distributed = False


def _metric_names(cfg: LossConfig, want_entropy: bool, batch: TrainBatch,
                  reference_here: bool = False) -> list[str]:
    """The loss-term metrics ``policy_objective`` reports for this config and batch columns."""
    agreed = {"loss", "pg_loss", "clip_frac", "approx_kl_old"}
    if cfg.off_policy != "none":
        agreed.add("is_weight")
    if batch.ref_logprobs is not None or reference_here:
        agreed.add("kl")
    if want_entropy:
        agreed.add("entropy")
    return sorted(agreed)
