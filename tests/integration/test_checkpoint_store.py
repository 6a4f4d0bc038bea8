"""A checkpoint save never removes the checkpoint in force: not when killed mid-save, not when
the disk fills, not when it re-saves the step in force (a resumed run saving the same step)."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from earl.loop.checkpoint import CheckpointStore
from earl.loop.schedule import LoopState


def _store(root: Path, trainer_bytes: int = 16, *, kill_in: str = "") -> CheckpointStore:
    async def save_trainer(folder: str) -> None:
        os.makedirs(folder)
        Path(folder, "weights.bin").write_bytes(b"w" * trainer_bytes)
        if kill_in == "trainer":
            os.kill(os.getpid(), signal.SIGKILL)

    async def save_producers(folder: str, critic_batch: int | None) -> None:
        os.makedirs(folder)
        Path(folder, "0.json").write_text('{"seen": 1}')
        if kill_in == "producers":
            os.kill(os.getpid(), signal.SIGKILL)

    return CheckpointStore(root, save_trainer=save_trainer, save_producers=save_producers,
                           wall=lambda: 1.0)


def _in_force(root: Path) -> int:
    state, trainer, producers = _store(root).load()
    assert (Path(trainer) / "weights.bin").is_file()
    assert Path(producers, "0.json").read_text() == '{"seen": 1}'
    return state.step


def test_a_checkpoint_of_an_earlier_version_gives_each_producer_its_file(tmp_path: Path
                                                                         ) -> None:
    """Before the producers wrote their own parts, producers.json held every state: a resume
    of such a checkpoint writes each its file."""
    import json

    store = _store(tmp_path)
    asyncio.run(store.save(LoopState(step=3), None))
    folder = tmp_path / str(store.manifest()["folder"])
    (folder / "producers" / "0.json").unlink()
    (folder / "producers.json").write_text(json.dumps({"step": 3, "states": [{"seen": 2}]}))
    _, _, producers = store.load()
    assert json.loads(Path(producers, "0.json").read_text()) == {"seen": 2}


def test_resaving_the_step_in_force_replaces_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    asyncio.run(store.save(LoopState(step=8), None))
    asyncio.run(store.save(LoopState(step=8), None))
    assert _in_force(tmp_path) == 8
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(("step-", ".staging"))] == \
        [store.manifest()["folder"]]  # the replaced folder is gone, nothing staged is left


_KILLED_SAVE = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from test_checkpoint_store import _store
    from earl.loop.schedule import LoopState
    asyncio.run(_store(Path({root!r}), kill_in={where!r}).save(LoopState(step={step}), None))
""")


@pytest.mark.parametrize("where", ["trainer", "producers"])
@pytest.mark.parametrize("step", [8, 9])  # the step in force again, and the next one
def test_a_save_killed_midway_leaves_the_checkpoint_in_force(tmp_path: Path, where: str,
                                                             step: int) -> None:
    asyncio.run(_store(tmp_path).save(LoopState(step=8), None))
    code = _KILLED_SAVE.format(tests=str(Path(__file__).parent), root=str(tmp_path),
                               where=where, step=step)
    proc = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert _in_force(tmp_path) == 8
    asyncio.run(_store(tmp_path).save(LoopState(step=9), None))  # and the next save works
    assert _in_force(tmp_path) == 9


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_while_resaving_leaves_the_checkpoint_in_force() -> None:
    with tempfile.TemporaryDirectory() as mnt:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], check=True)
        try:
            root = Path(mnt) / "checkpoint"
            asyncio.run(_store(root, 400_000).save(LoopState(step=8), None))
            with pytest.raises(OSError) as info:  # 1.2 MB does not fit in 1 MB at all
                asyncio.run(_store(root, 1_200_000).save(LoopState(step=8), None))
            assert info.value.errno == errno.ENOSPC
            assert _in_force(root) == 8
            assert not any(p.name.startswith(".staging") for p in root.iterdir())
        finally:
            subprocess.run(["umount", mnt], check=True)
