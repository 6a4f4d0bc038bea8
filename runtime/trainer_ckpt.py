"""Checkpoints of a `TorchTrainer`: model, optimizer, LR schedule, step and per-rank RNG.

Layout of a checkpoint folder:
    ``trainer.pt``: full (unsharded) model and optimizer state with parameter FQNs, the schedule
        and the step — written by rank 0, read by every rank, so DDP and FSDP2 share one format;
    ``rng_rank{r}.pt``: torch, numpy and python RNG state of rank ``r``;
    ``meta.json``: world size, parallel mode and step, for humans and for checks on resume.

Files are written to a temporary name and renamed, so a run killed mid-save (SIGKILL) leaves the
previous checkpoint intact. Only tensors, numbers, strings and tuples are stored: loading uses
``torch.load(weights_only=True)``. The HF export for serving is `TorchTrainer.save_hf`.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

if TYPE_CHECKING:
    from earl.runtime.trainer_torch import TorchTrainer

__all__ = ["load_checkpoint", "save_checkpoint"]


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state() -> dict[str, object]:
    kind, keys, pos, has_gauss, cached = np.random.get_state()  # type: ignore[misc]
    state: dict[str, object] = {
        "torch": torch.get_rng_state(),
        "numpy": (str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                  int(has_gauss), float(cached)),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, object]) -> None:
    torch.set_rng_state(cast(torch.Tensor, state["torch"]))
    kind, keys, pos, has_gauss, cached = cast(tuple[str, torch.Tensor, int, int, float],
                                              state["numpy"])
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = cast(tuple[int, tuple[int, ...], float | None], state["python"])
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])  # type: ignore[arg-type]


def save_checkpoint(trainer: TorchTrainer, path: Path) -> None:
    """Write ``trainer``'s state under folder ``path`` (all ranks must call it)."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer, options=opts)
    path.mkdir(parents=True, exist_ok=True)
    if trainer.rank == 0:
        _atomic_save({"model": model_sd, "optimizer": optim_sd,
                      "scheduler": trainer.scheduler.state_dict(), "step": trainer.step},
                     path / "trainer.pt")
        meta = {"step": trainer.step, "world_size": trainer.world_size,
                "parallel": trainer.config.parallel if trainer.distributed else "none"}
        (path / "meta.json").write_text(json.dumps(meta) + "\n")
    _atomic_save(_rng_state(), path / f"rng_rank{trainer.rank}.pt")
    if trainer.distributed:
        dist.barrier()


def load_checkpoint(trainer: TorchTrainer, path: Path) -> None:
    """Restore ``trainer`` from folder ``path`` (all ranks must call it)."""
    file = path / "trainer.pt"
    if not file.is_file():
        raise ValueError(f"no trainer checkpoint at {path} (missing trainer.pt)")
    meta = json.loads((path / "meta.json").read_text())
    if meta["world_size"] != trainer.world_size:
        raise ValueError(f"checkpoint {path} was saved by {meta['world_size']} trainer ranks; "
                         f"this run has {trainer.world_size}: use the same trainer world size")
    state = torch.load(file, map_location="cpu", weights_only=True)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"], options=opts)
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step = int(state["step"])
    rng = path / f"rng_rank{trainer.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
