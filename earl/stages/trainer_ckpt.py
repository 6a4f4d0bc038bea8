"""Checkpoints of a `TorchTrainer`: model, optimizer, LR schedule, step and per-rank RNG.

Model and optimizer go through torch distributed checkpoint (DCP): every rank writes the shards
it holds, with their place in the full tensors, and a load reads whatever pieces the *loading*
layout needs. So a checkpoint saved at one layout (1 rank, DDP, FSDP2 over 2 ranks, tensor
parallel, FSDP2 x TP) loads at any other: parameters and Adam moments are resharded, not reset.
That is how `earl.stages.reconfigure` changes a live trainer's layout.

Layout of a checkpoint folder:
    ``dcp/``: the DCP shards and their metadata (model and optimizer, parameter FQNs);
    ``trainer.pt``: LR schedule and step (rank 0);
    ``rng_rank{r}.pt``: torch, numpy and python RNG state of rank ``r`` (restored for the
        ranks that exist in both layouts);
    ``meta.json``: step, world size, parallel mode and TP degree, for humans.

DCP writes under a temporary folder which is renamed when complete, and single files are written
to a temporary name and renamed, so a run killed mid-save (SIGKILL) leaves the previous checkpoint
intact. Only tensors, numbers, strings and tuples are stored: ``torch.load(weights_only=True)``.
The HF export for serving is `TorchTrainer.save_hf`.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

if TYPE_CHECKING:
    from earl.stages.trainer_torch import TorchTrainer

__all__ = ["load_checkpoint", "load_rest", "save_checkpoint", "save_rest"]


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


def _barrier(trainer: TorchTrainer) -> None:
    if trainer.distributed:
        dist.barrier()


def _first_error(exc: BaseException) -> str:
    """The ranks' underlying error (e.g. "[Errno 28] No space left on device")."""
    failures = getattr(exc, "failures", {}) or {}
    for err in failures.values():
        inner = err[0] if isinstance(err, tuple) else err
        return f"{type(inner).__name__}: {inner}"
    return str(exc).splitlines()[0]


def save_checkpoint(trainer: TorchTrainer, path: Path) -> None:
    """Write ``trainer``'s state under folder ``path`` (all ranks must call it)."""
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)
    path.mkdir(parents=True, exist_ok=True)
    tmp, final = path / "dcp.tmp", path / "dcp"
    if trainer.rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was killed
    _barrier(trainer)
    try:
        dcp.save({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(tmp),
                 no_dist=not trainer.distributed)
    except dcp.api.CheckpointException as exc:  # a BaseException: it would end the actor
        raise OSError(f"checkpoint {path} not written: {_first_error(exc)}") from None
    _barrier(trainer)  # every rank's shards are written before the rename
    if trainer.rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    save_rest(trainer, path)


def save_rest(trainer: TorchTrainer, path: Path) -> None:
    """Everything but model and optimizer: LR schedule and step, meta, each rank's RNG (all
    ranks call it, after their model and optimizer shards are written)."""
    _barrier(trainer)
    if trainer.rank == 0:
        _atomic_save({"scheduler": trainer.scheduler.state_dict(), "step": trainer.step},
                     path / "trainer.pt")
        meta = {"step": trainer.step, "world_size": trainer.world_size, "tp": trainer.tp,
                "parallel": trainer.config.parallel if trainer.distributed else "none"}
        (path / "meta.json").write_text(json.dumps(meta) + "\n")
    _atomic_save(_rng_state(), path / f"rng_rank{trainer.rank}.pt")
    _barrier(trainer)


def load_checkpoint(trainer: TorchTrainer, path: Path) -> None:
    """Restore ``trainer`` from folder ``path``, resharding to its layout (all ranks call it).

    Raises:
        ValueError: ``path`` holds no complete checkpoint.
    """
    if not (path / "trainer.pt").is_file() or not (path / "dcp" / ".metadata").is_file():
        raise ValueError(f"no trainer checkpoint at {path} (needs trainer.pt and dcp/.metadata; "
                         "write one with TorchTrainer.save_checkpoint)")
    model_sd, optim_sd = get_state_dict(trainer.model, trainer.optimizer)  # this layout's shards
    dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(path / "dcp"),
             no_dist=not trainer.distributed)  # in place, into this layout's shards
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_sd,
                   optim_state_dict=optim_sd)
    load_rest(trainer, path)


def load_rest(trainer: TorchTrainer, path: Path) -> None:
    """Restore what `save_rest` wrote (LR schedule, step, this rank's RNG)."""
    if not (path / "trainer.pt").is_file():
        raise ValueError(f"no trainer checkpoint at {path} (no trainer.pt)")
    rest = torch.load(path / "trainer.pt", map_location="cpu", weights_only=True)
    trainer.scheduler.load_state_dict(rest["scheduler"])
    trainer.step = int(rest["step"])
    rng = path / f"rng_rank{trainer.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=True))
