"""Sweep what dead EARL processes left behind: run dirs, shm receiver dirs, shm segments.

Every name EARL puts in the temp directory or /dev/shm carries its owner's pid
(`earl-<pid>-XXXX` run dirs with their sockets, `earl-shm-<pid>-XXXX` and `earl-zmq-<pid>-XXXX`
receiver dirs, `earl-sandbox-<pid>-XXXX` sandbox runs, `/dev/shm/earl-<run>-<pid>-<random>` segments). A process that exits normally removes its own; one
that was SIGKILLed cannot, so the root `Runtime` sweeps, when it starts and when it exits, every
such entry of this user whose owner pid is gone. A live pid (even a reused one) is never touched.
This module knows nothing about runtimes; it only removes files.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile

__all__ = ["SEGMENT_RE", "cleanup_leaked_segments", "pid_alive", "run_dir_prefix", "sweep"]

SHM_DIR = "/dev/shm"
# earl-<run>-<pid>-<random> (shm_arena.create_segment); receivers use it to refuse forged names
SEGMENT_RE = re.compile(r"^earl-([0-9a-z]+)-(\d+)-([0-9a-f]{16})$")
_DIR_RE = re.compile(r"^earl-(?:shm-|zmq-|sandbox-)?(\d+)-[A-Za-z0-9_]+$")


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live (not zombie) process; True if it belongs to another user."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child still "exists" but owns nothing any more
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cleanup_leaked_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink EARL shm segments whose owning process is gone. Returns the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    for name in names:
        m = SEGMENT_RE.match(name)
        if m is None or pid_alive(int(m.group(2))):
            continue
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed


def run_dir_prefix() -> str:
    """The `tempfile.mkdtemp` prefix of this process's run dir (pid inside, for the sweep)."""
    return f"earl-{os.getpid()}-"


def sweep(tmp_dir: str | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove leftovers of dead EARL processes owned by this user; return what was removed.

    Looks in `tmp_dir` (default: the temp dir and /tmp, where run dirs go) and `shm_dir`.
    """
    removed = [os.path.join(shm_dir, n) for n in cleanup_leaked_segments(shm_dir)]
    dirs = [tmp_dir] if tmp_dir else sorted({tempfile.gettempdir(), "/tmp"})
    for d in dirs:
        removed += _sweep_dir(d)
    return removed


def _sweep_dir(tmp_dir: str) -> list[str]:
    removed: list[str] = []
    try:
        names = os.listdir(tmp_dir)
    except OSError:
        return removed
    me = os.geteuid()
    for name in names:
        m = _DIR_RE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(tmp_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != me or not os.path.isdir(path) or os.path.islink(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
