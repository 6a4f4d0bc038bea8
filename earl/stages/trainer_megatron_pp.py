"""Pipeline parallel of the megatron backend: the micro-batch schedule, gradient reductions and
weight gathering of `MegatronTrainer` with ``TrainerConfig.pp > 1``.

Each stage holds a megatron GPTModel with its share of the layers (``pre_process`` on the first,
``post_process`` on the last). Micro-batches run a GPipe schedule over point-to-point sends
between neighbouring stages (the rank with the same TP and DP index): every stage runs all its
forwards, then all its backwards in the same order; the last stage back-propagates each
micro-batch at once (its loss is the torch backend's, `TorchTrainer._micro_loss`) and sends the
input gradients upstream in the backward phase, so it never holds more than one micro-batch's
logits. Every stage knows each micro-batch's packed length (all ranks of a replica hold the same
batch), so activations ``[T, 1, hidden]`` travel without a shape exchange, in float32.

Megatron-core's own ``forward_backward_func`` is not used: in 0.16.1 it allocates on
``device="cuda"`` and calls ``torch.cuda.synchronize()`` unconditionally, and it needs a shape
exchange for packed micro-batches of varying length. Torch DDP is not used with PP either (it
cannot hold several micro-batches in flight before their backwards): gradients are summed over
the data-parallel group after the schedule, and a tied model's embedding gradients over
megatron's embedding group (first and last stage), keeping the last stage's copy equal.

Not here: the model build and HF conversion (`trainer_megatron`, `trainer_megatron_convert`),
the gradient norm (`trainer_megatron_tp.clip_grad_norm_tp`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from earl.packing import Packed, token_logprobs
from earl.stages import trainer_dist as tdist
from earl.stages.trainer_batch import MicroBatch, TrainBatch, step_totals
from earl.stages.trainer_torch import _metric_names

if TYPE_CHECKING:
    from earl.stages.trainer_megatron import MegatronTrainer

__all__ = ["Pipe", "gather_stages", "pp_accumulate", "pp_compute_logprobs", "reduce_grads"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Pipe:
    """This rank's place in its pipeline: its stage, its neighbours' global ranks."""

    group: dist.ProcessGroup
    stage: int
    stages: int
    hidden: int
    device: torch.device

    @classmethod
    def of(cls, t: MegatronTrainer) -> Pipe:
        assert t.pp_group is not None
        return cls(group=t.pp_group, stage=dist.get_rank(t.pp_group),
                   stages=dist.get_world_size(t.pp_group), hidden=int(t.hf_config.hidden_size),
                   device=t.device)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    def peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, stage)

    def recv_forward(self, packed: Packed, grad: bool) -> Tensor | None:
        """The previous stage's output for ``packed`` (None on the first stage)."""
        if self.first:
            return None
        x = torch.empty(packed.input_ids.numel(), 1, self.hidden, device=self.device)
        dist.recv(x, src=self.peer(self.stage - 1))
        return x.requires_grad_(grad)

    def send_forward(self, out: Tensor) -> None:
        dist.send(out.detach().float().contiguous(), dst=self.peer(self.stage + 1))

    def recv_backward(self, out: Tensor) -> Tensor:
        g = torch.empty(out.shape, device=self.device)
        dist.recv(g, src=self.peer(self.stage + 1))
        return g

    def send_backward(self, grad: Tensor) -> None:
        dist.send(grad.float().contiguous(), dst=self.peer(self.stage - 1))

    def broadcast_from_last(self, t: Tensor) -> Tensor:
        dist.broadcast(t, src=self.peer(self.stages - 1), group=self.group)
        return t


@torch.no_grad()
def pp_compute_logprobs(t: MegatronTrainer, batch: TrainBatch) -> Tensor:
    """`TorchTrainer.compute_logprobs` through the pipeline; every rank gets the result."""
    t.resident()
    pipe = Pipe.of(t)
    out = torch.zeros(batch.num_tokens, dtype=torch.float32, device=t.device)
    cu = batch.cu_seqlens.tolist()
    for mb in t._plan(batch):
        if mb is None:  # no DDP under PP: padding micro-batches need no forward
            continue
        packed = batch.select(mb).packed
        x = pipe.recv_forward(packed, grad=False)
        if not pipe.last:
            pipe.send_forward(t._stage_forward(packed, x))
            continue
        t.module.set_input_tensor(x)  # type: ignore[operator]
        lp = token_logprobs(t._logits(packed), packed)
        offs = packed.cu_seqlens.tolist()
        for j, i in enumerate(mb):
            out[cu[i]:cu[i + 1]] = lp[offs[j]:offs[j + 1]]
    return pipe.broadcast_from_last(out).cpu()


def pp_accumulate(t: MegatronTrainer, batch: TrainBatch,
                  micro_batches: list[list[int]] | None = None) -> dict[str, float]:
    """`TorchTrainer.accumulate` through the pipeline (same loss, denominators and metrics,
    reported on every rank); gradients are reduced over DP (and the embedding group) here."""
    t.resident()
    cfg = t.config.loss
    t.model.train()
    pipe = Pipe.of(t)
    plan = [None if mb is None else batch.select(mb) for mb in t._plan(batch, micro_batches)]
    totals = step_totals(batch, plan, cfg.agg, t.dp_group)
    denom = float(totals[0])
    want_entropy = cfg.entropy_coef > 0 or t.config.log_entropy
    subs: list[MicroBatch] = [sub for sub in plan if sub is not None]
    sums: dict[str, Tensor] = {}
    held: list[tuple[Tensor | None, Tensor]] = []  # (input, output or input grad) per micro-batch
    for sub in subs:  # forward phase
        x = pipe.recv_forward(sub.packed, grad=True)
        if pipe.last:
            t.module.set_input_tensor(x)  # type: ignore[operator]
            loss, metrics = t._micro_loss(sub, denom, want_entropy)
            loss.backward()
            assert x is not None and x.grad is not None
            held.append((None, x.grad))
            for name, v in metrics.items():
                sums[name] = sums.get(name, torch.zeros((), dtype=torch.float64)) \
                    + v.double().cpu()
        else:
            out = t._stage_forward(sub.packed, x)
            pipe.send_forward(out)
            held.append((x, out))
    for x, y in held:  # backward phase, same order
        if pipe.last:
            pipe.send_backward(y)
            continue
        torch.autograd.backward(y, grad_tensors=pipe.recv_backward(y))
        if x is not None:
            assert x.grad is not None
            pipe.send_backward(x.grad)
    reduce_grads(t)
    names = _metric_names(cfg, want_entropy, batch, t._reference_here)
    zero = torch.zeros((), dtype=torch.float64)
    vec = torch.stack([sums.get(n, zero) for n in names]).to(t.device)
    vec = pipe.broadcast_from_last(vec).cpu()
    vec = tdist.all_reduce(vec, group=t.dp_group)
    res = {n: float(v) for n, v in zip(names, vec, strict=True)}
    res.update(tokens=float(totals[1]), loss_tokens=float(totals[2]),
               samples=float(totals[3]), micro_batches=float(len(plan)))
    return res


def reduce_grads(t: MegatronTrainer) -> None:
    """Sum a tied model's embedding gradients over the embedding group (first and last stage)
    and every gradient over the DP group (a rank that ran no micro-batch contributes zeros)."""
    params = [p for p in t.module.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if t.embedding_group is not None:
        tied = t.tied_embedding()
        assert tied is not None and tied.grad is not None
        dist.all_reduce(tied.grad, group=t.embedding_group)
    if t.dp_group is None:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=t.dp_group)
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(r)


def gather_stages(state: Mapping[str, Tensor], group: dist.ProcessGroup,
                  device: torch.device) -> list[dict[str, Tensor]]:
    """Every pipeline stage's state dict (``state`` is this rank's), in stage order.

    A collective over ``group``: the names, shapes and dtypes go first (as objects), then each
    tensor is broadcast from its stage.
    """
    meta = [(n, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for n, v in state.items()]
    metas: list[list[tuple[str, tuple[int, ...], str]] | None] = \
        [None] * dist.get_world_size(group)
    dist.all_gather_object(metas, meta, group=group)
    me = dist.get_rank(group)
    out: list[dict[str, Tensor]] = []
    for stage, theirs in enumerate(metas):
        assert theirs is not None
        got = {}
        for name, shape, dtype in theirs:
            t = state[name].contiguous() if stage == me else \
                torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            dist.broadcast(t, src=dist.get_global_rank(group, stage), group=group)
            got[name] = t
        out.append(got)
    return out

