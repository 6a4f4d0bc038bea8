"""Tensor-parallel collectives of the megatron backend: gather weight shards, global grad norm.

Megatron-core shards column/row-parallel weights and the vocabulary over its TP group and keeps
layer norms replicated (their gradients come out equal on every TP rank, megatron's copy/reduce
regions see to that). This module gathers the shards of a megatron state dict onto every TP
rank (for HF export) and computes and clips the gradient norm of the whole model, counting
sharded tensors once per shard and replicated ones once, summed over pipeline stages. It does not convert names
(`trainer_megatron_convert`) and does not touch data parallelism (gradients are already
averaged over DP ranks when it runs).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from earl.stages.trainer_megatron_convert import tp_split

__all__ = ["clip_grad_norm_tp", "gather_state_shards"]


def gather_state_shards(state: Mapping[str, Tensor],
                        group: dist.ProcessGroup) -> list[dict[str, Tensor]]:
    """Every TP rank's shard of ``state`` (this rank's megatron state dict), in rank order.

    A collective over ``group``: all its ranks must call it with state dicts of the same keys.
    Replicated tensors (layer norms) are not sent; every rank's entry holds the local copy.
    """
    size = dist.get_world_size(group)
    out: list[dict[str, Tensor]] = [{} for _ in range(size)]
    for name, t in state.items():
        if tp_split(name) == "none":
            for sh in out:
                sh[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        for sh, p in zip(out, parts, strict=True):
            sh[name] = p
    return out


def clip_grad_norm_tp(params: Iterable[nn.Parameter], max_norm: float,
                      group: dist.ProcessGroup | None, *,
                      pp_group: dist.ProcessGroup | None = None,
                      copies: Iterable[nn.Parameter] = ()) -> Tensor:
    """The gradient norm of the whole TP/PP-sharded model; clips the gradients to ``max_norm``.

    Megatron marks sharded parameters with ``tensor_model_parallel=True``: their squared norms
    are summed over ``group`` (the TP group; None: TP 1); replicated parameters (equal on every
    TP rank) count once. Each pipeline stage holds its own parameters: the stage sums are
    summed over ``pp_group`` (None: PP 1). ``copies`` (a tied embedding's copy on the last
    stage) are clipped but not counted. The coefficient matches
    ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``), so any layout updates
    alike. A collective over ``group`` and ``pp_group``.
    """
    skip = {id(p) for p in copies}
    with_grad = [(p, p.grad) for p in params if p.grad is not None]
    device = with_grad[0][1].device if with_grad else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p, g in with_grad:
        if id(p) in skip:
            continue
        sq = torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double() ** 2
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    if group is not None:
        dist.all_reduce(sharded, group=group)
    total = sharded + replicated
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt().float()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for _, g in with_grad:
            g.detach().mul_(coef)
    return norm.cpu()
