"""Tensor-parallel collectives of the megatron backend: gather weight shards, global grad norm.

Megatron-core shards column/row-parallel weights and the vocabulary over its TP group and keeps
layer norms replicated (their gradients come out equal on every TP rank, megatron's copy/reduce
regions see to that). This module gathers the shards of a megatron state dict onto every TP
rank (for HF export) and computes and clips the gradient norm of the whole model, counting
sharded tensors once per shard and replicated ones once. It does not convert names
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
                      group: dist.ProcessGroup) -> Tensor:
    """The gradient norm of the whole TP-sharded model; clips the gradients to ``max_norm``.

    Megatron marks sharded parameters with ``tensor_model_parallel=True``: their squared norms
    are summed over ``group``; replicated parameters (equal on every TP rank) count once. The
    coefficient matches ``torch.nn.utils.clip_grad_norm_`` (``max_norm / (norm + 1e-6)``), so
    TP=1 and TP>1 update alike. A collective over ``group``.
    """
    with_grad = [(p, p.grad) for p in params if p.grad is not None]
    device = with_grad[0][1].device if with_grad else torch.device("cpu")
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    for p, g in with_grad:
        sq = torch.linalg.vector_norm(g.detach(), dtype=torch.float32).double() ** 2
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    dist.all_reduce(sharded, group=group)
    norm = (sharded + replicated).sqrt().float()
    coef = max_norm / (float(norm) + 1e-6)
    if coef < 1.0:
        for _, g in with_grad:
            g.detach().mul_(coef)
    return norm.cpu()
