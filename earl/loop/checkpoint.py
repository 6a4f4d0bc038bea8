"""Consistent checkpoints: every part of one checkpoint is of the same step, or none is used.

A checkpoint is a folder `checkpoint/step-NNNNNN/` holding the parts (the trainer's own
folder, the producers' estimator states, each written by its producer into `producers/`,
`producers.json` saying they are whole, the loop state), and `checkpoint/manifest.json`,
written last and atomically, naming the folder and its step. A save writes into a staging
folder and renames it to an unused name before the manifest switches, so nothing of the
checkpoint in force is touched until a whole new one is in place: a crash or a full disk anywhere
in a save (re-saving the step in force included) leaves the previous one in force. `load` verifies each part's step against the manifest, and
`trim_logs` cuts `metrics.jsonl` and the trajectory dumps back to the checkpoint so a resumed
run does not count the replayed steps twice. Nothing here talks to actors: the caller hands
in async callables that save the trainer's and the producers' parts, and says which failed saves the run goes on
after (`skip_failed`: a full disk, `earl.loop.supervisor.Supervisor.checkpoint_failed`).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

from earl.loop.schedule import LoopState

__all__ = ["CheckpointError", "CheckpointStore", "trim_logs"]

MANIFEST = "manifest.json"
STAGING = ".staging-step-"  # a save in progress; never named by a manifest


class CheckpointError(ValueError):
    """A checkpoint is missing or its parts disagree."""


def _write_json(path: Path, obj: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


class CheckpointStore:
    """Saves and loads checkpoints under `root`.

    Args:
        root: the run's `checkpoint/` folder.
        save_trainer: `async (folder) -> None`, writes the trainer's state into folder.
        save_producers: `async (folder, critic_batch) -> None`, each producer's state after
            `critic_batch` into `folder/<rank>.json` (written by the producers themselves: the
            critics, megabytes of JSON, never pass through this process).
        wall: the run's wall seconds so far (saved with the loop state).
        skip_failed: `(step, error) -> bool`: whether the run goes on after a save of `step`
            failed with `error`, the previous checkpoint in force (None: every failure raises).
    """

    def __init__(self, root: Path, *, save_trainer: Callable[[str], Awaitable[None]],
                 save_producers: Callable[[str, int | None], Awaitable[None]],
                 wall: Callable[[], float],
                 skip_failed: Callable[[int, Exception], bool] | None = None) -> None:
        self.root = root
        self.save_trainer, self.save_producers, self.wall = save_trainer, save_producers, wall
        self.skip_failed = skip_failed
        root.mkdir(parents=True, exist_ok=True)

    async def save(self, state: LoopState, critic_batch: int | None) -> None:
        """Write every part of step `state.step`, then switch the manifest to it (atomic);
        a failure `skip_failed` accepts leaves the previous checkpoint in force and returns."""
        try:
            await self._save(state, critic_batch)
        except Exception as exc:
            if self.skip_failed is None or not self.skip_failed(state.step, exc):
                raise

    async def _save(self, state: LoopState, critic_batch: int | None) -> None:
        """The parts go to a staging folder, renamed to an unused name (`step-NNNNNN`, or
        `step-NNNNNN-K` when that step is saved already, e.g. in force after a resume) before
        the manifest names it; older folders are removed only after it does."""
        staging = self.root / f"{STAGING}{state.step:06d}"
        shutil.rmtree(staging, ignore_errors=True)  # left by a save that was killed
        staging.mkdir()
        try:
            await self.save_trainer(str(staging / "trainer"))
            await self.save_producers(str(staging / "producers"), critic_batch)
            _write_json(staging / "producers.json", {"step": state.step})
            d = asdict(state)
            d["wall_before"] = self.wall()
            _write_json(staging / "state.json", d)
            folder = self._unused_folder(state.step)
            staging.rename(folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _write_json(self.root / MANIFEST, {"step": state.step, "folder": folder.name,
                                           "parts": ["trainer", "producers", "producers.json",
                                                     "state.json"]})
        for old in self.root.glob("step-*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)

    def _unused_folder(self, step: int) -> Path:
        folder, k = self.root / f"step-{step:06d}", 0
        while folder.exists():
            k += 1
            folder = self.root / f"step-{step:06d}-{k}"
        return folder

    def manifest(self) -> dict[str, object]:
        path = self.root / MANIFEST
        if not path.is_file():
            raise CheckpointError(f"--resume: no checkpoint manifest in {str(self.root)!r}; run "
                                  "without --resume first (or point --output-dir at that run)")
        try:
            m = json.loads(path.read_text())
            folder = self.root / str(m["folder"])
            int(m["step"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"--resume: {path} is corrupt ({exc}); delete the checkpoint "
                                  "folder and start again") from None
        if not folder.is_dir():
            raise CheckpointError(f"--resume: {path} names {folder.name}, which is missing")
        return m  # type: ignore[no-any-return]

    def step_in_force(self) -> int | None:
        """The step of the checkpoint in force (None: none yet)."""
        path = self.root / MANIFEST
        return int(json.loads(path.read_text())["step"]) if path.is_file() else None

    def load(self) -> tuple[LoopState, str, str]:
        """The loop state, the trainer's folder and the producers' folder (`<rank>.json` each)
        of the checkpoint in force, after checking every part is of the manifest's step.

        Raises:
            CheckpointError: no manifest, or a part of another step.
        """
        m = self.manifest()
        step, folder = int(m["step"]), self.root / str(m["folder"])  # type: ignore[call-overload]
        raw = json.loads((folder / "state.json").read_text())
        prod = json.loads((folder / "producers.json").read_text())
        for name, got in (("state.json", raw.get("step")), ("producers.json", prod.get("step"))):
            if got != step:
                raise CheckpointError(f"--resume: checkpoint part {name} is of step {got}, the "
                                      f"manifest says {step}; the checkpoint is inconsistent")
        if "states" in prod:  # saved before the producers wrote their own parts
            for rank, st in enumerate(prod["states"]):
                _write_json(folder / "producers" / f"{rank}.json", st)
        raw["best"] = tuple(raw["best"])
        state = LoopState(**raw)
        return state, str(folder / "trainer"), str(folder / "producers")


def trim_logs(out: Path, step: int) -> None:
    """Drop records of steps after `step` from the run's JSONL logs: those a resume replays,
    and an earlier run's in the same folder when a run starts fresh (`step` 0; the producers
    append to the trajectory dumps, and their gzip segments, `earl.stages.dump`; the trainer
    to its records of what each step trained)."""
    for path in [out / "metrics.jsonl", *out.glob("trajectories*.jsonl"),
                 *out.glob("trajectories*.jsonl.*.gz"), *out.glob("trained/trained.*.jsonl")]:
        if not path.is_file():
            continue
        gz = path.suffix == ".gz"
        if gz and step == 0:
            path.unlink()
            continue
        kept = []
        with gzip.open(path, "rt") if gz else open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the crash
                if int(rec.get("step", 0)) <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
        tmp = path.with_name(path.name + ".tmp")
        if gz:
            with gzip.open(tmp, "wt", compresslevel=3) as f:
                f.write("".join(kept))
        else:
            tmp.write_text("".join(kept))
        tmp.replace(path)
