"""What a GPU test may leave in its process: megatron's parallel state and the default
`torch.distributed` process group. `left_behind` names them, `tear_down` destroys them."""

from __future__ import annotations

import sys

import torch.distributed as dist

__all__ = ["left_behind", "tear_down"]


def left_behind() -> list[str]:
    """What is set up in this process now (empty when nothing is)."""
    left = []
    ps = sys.modules.get("megatron.core.parallel_state")  # only a test that used it imported it
    if ps is not None and ps.model_parallel_is_initialized():
        left.append("megatron.core.parallel_state (destroy_model_parallel())")
    if dist.is_available() and dist.is_initialized():
        left.append("a torch.distributed process group (destroy_process_group())")
    return left


def tear_down() -> None:
    """Destroy megatron's parallel state, then the default process group, where they exist."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
