"""Run a command and measure its process tree as it runs: peak RSS and CPU time, sampled every
0.25 s (`bench/peers.py`'s sides). Ages are seconds from the start, the clock both sides' step
`wall_s` use (process age), so a CPU window can be read against their steps (`cpu_between`).
"""

from __future__ import annotations

import resource
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from _race_measure import TreeCpu, tree_readings

__all__ = ["Tree", "run_tree"]

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Tree:
    """What `run_tree` measured of one side's process tree."""

    stdout: str
    peak_rss_mb: float
    cpu_s: float  # user + system of every descendant reaped (the whole tree, whole run)
    cpu_timeline: list[tuple[float, float]]  # (age s, tree CPU s so far), every 0.25 s


def run_tree(cmd: list[str], env: dict[str, str], timeout: float) -> Tree:
    """Runs `cmd`, sampling its tree's RSS and CPU time every 0.25 s (ages from its start, the
    clock both sides' step `wall_s` use: process age)."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=str(ROOT))
    peak = [0.0]
    cpu, timeline = TreeCpu(), [(0.0, 0.0)]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            readings, rss = tree_readings(proc.pid)
            cpu.update(readings)
            peak[0] = max(peak[0], rss)
            timeline.append((time.time() - t0, cpu.total()))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        t.join()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[1:3]} exited {proc.returncode}:\n{err[-4000:]}")
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return Tree(stdout=out, peak_rss_mb=peak[0], cpu_timeline=timeline,
                cpu_s=ru1.ru_utime - ru0.ru_utime + ru1.ru_stime - ru0.ru_stime)
