"""Sandboxed `python` tool: EARL's fork-server runs vs a fresh interpreter per call, same run.

    python bench/sandbox.py --json [--quick]

Every mode runs the same program (`print(<n> * 7)`, the agentic workload's tool call) `--calls`
times from `--threads` threads at once, with the same rlimits (CPU, address space, file size,
open files, core), and checks every output:

- ``earl``: `earl.runtime.sandbox.run_python` as the `python` tool calls it, full isolation where
  we are root (mount, network and IPC namespaces, chroot, a fresh uid, a tmpfs dir).
- ``earl_rlimits``: the same with ``full_isolation=False`` (rlimits, a user namespace where the
  kernel allows one, a private temp dir).
- ``spawn``: what a sandbox without a fork server does, in its best configuration: one
  `subprocess.run([python, "-I", "-S", "-c", code])` per call (no `site`, vfork, rlimits set
  with `prlimit` on the child from outside rather than a `preexec_fn`, which would force a
  fork of this process). It does less than either EARL mode: no namespaces, no private dir.
- ``fork_floor``: the physical floor of a forked run: a stdlib-only interpreter forks a child
  that writes the answer to a pipe and exits; fork + write + exit + wait, nothing else.

Per mode (median of `--repeats`, with the spread): ``calls_per_s``, ``wall_ms_p50`` and
``wall_ms_p90`` per call, and ``cpu_ms_per_call``: CPU seconds of this process and every
descendant it reaped (each EARL mode closes its fork server inside the span, so the server's
and its runs' CPU are counted, its start-up included) per call. The floor runs serially in one
thread (it is the cost of one forked run, not a concurrency figure). Top level: ``cpu_ratio_spawn_vs_earl`` and
``rate_ratio_earl_vs_spawn`` (EARL with full isolation against the spawn baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _results

from earl.runtime import sandbox

LIMITS = sandbox.SandboxLimits()
_MB = 1 << 20
_RLIMITS = ((resource.RLIMIT_CPU, LIMITS.cpu_s), (resource.RLIMIT_AS, LIMITS.memory_mb * _MB),
            (resource.RLIMIT_FSIZE, LIMITS.file_mb * _MB), (resource.RLIMIT_NOFILE, 64),
            (resource.RLIMIT_CORE, 0))
_FLOOR = r"""
import os, resource, sys, time
def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime
n = int(sys.argv[1]); cpu0 = cpu(); t = time.perf_counter(); lat = []
for i in range(n):
    t0 = time.perf_counter()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, str(i * 7).encode() + b"\n")
        os._exit(0)
    os.close(w)
    out = os.read(r, 64)
    os.close(r)
    os.waitpid(pid, 0)
    assert out == str(i * 7).encode() + b"\n", out
    lat.append(time.perf_counter() - t0)
print(time.perf_counter() - t, cpu() - cpu0, *lat)
"""


def _cpu_s() -> float:
    """CPU seconds of this process plus every descendant it has reaped."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _spawn(code: str) -> str:
    """One fresh interpreter per call (vfork + exec), its rlimits set with prlimit right after
    the spawn: racy (it may start before they apply), the cheap path granted to the baseline."""
    p = subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    for which, value in _RLIMITS:
        try:
            resource.prlimit(p.pid, which, (value, value))
        except ProcessLookupError:
            break
    out, _ = p.communicate(timeout=LIMITS.wall_s)
    return out.decode()


def _earl(full: bool) -> Callable[[str], str]:
    def call(code: str) -> str:
        res = sandbox.run_python(code, LIMITS, full_isolation=full)
        if not res.ok:
            raise RuntimeError(f"sandbox run failed: {res.error}: {res.output[-500:]}")
        return res.output
    return call


def _measure(call: Callable[[str], str], calls: int, threads: int,
             close: Callable[[], None] | None) -> dict[str, float]:
    """`calls` calls from `threads` threads; wall and CPU of the whole span."""
    call("print(0)")  # start-up (the fork server) is not part of a call
    lat: list[float] = []
    lock = threading.Lock()
    counter = iter(range(calls))

    def worker() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            t = time.perf_counter()
            out = call(f"print({i} * 7)")
            dt = time.perf_counter() - t
            if out != f"{i * 7}\n":
                raise AssertionError(f"call {i}: wrong output {out!r}")
            with lock:
                lat.append(dt)

    cpu0, t0 = _cpu_s(), time.perf_counter()
    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if close is not None:
        close()  # reaps the fork server: its CPU and its runs' land in RUSAGE_CHILDREN
    wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    if len(lat) != calls:
        raise RuntimeError(f"{calls - len(lat)} calls failed")
    return _figures(wall, cpu, lat)


def _floor(calls: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-I", "-S", "-c", _FLOOR, str(calls)],
                         capture_output=True, text=True, check=True).stdout.split()
    wall, cpu, *lat = (float(x) for x in out)
    return _figures(wall, cpu, lat)


def _figures(wall: float, cpu: float, lat: list[float]) -> dict[str, float]:
    """One mode's figures from the span's wall and CPU seconds and the per-call latencies."""
    lat = sorted(lat)
    return {"calls_per_s": len(lat) / wall, "wall_ms_p50": statistics.median(lat) * 1e3,
            "wall_ms_p90": lat[int(0.9 * (len(lat) - 1))] * 1e3,
            "cpu_ms_per_call": cpu / len(lat) * 1e3}


def _summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    keys = runs[0].keys()
    med = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    rates = [r["calls_per_s"] for r in runs]
    return {**med, "spread": round((max(rates) - min(rates)) / statistics.fmean(rates), 3),
            "calls_per_s_runs": [round(x, 1) for x in rates]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (always on)")
    ap.add_argument("--quick", action="store_true", help="100 calls, 2 repeats")
    ap.add_argument("--calls", type=int, default=0, help="calls per mode and repeat")
    ap.add_argument("--threads", type=int, default=8, help="concurrent callers")
    ap.add_argument("--repeats", type=int, default=0, help="interleaved repeats per mode")
    _results.add_flag(ap)
    a = ap.parse_args()
    begun = _results.start()
    calls = a.calls or (100 if a.quick else 400)
    repeats = a.repeats or (2 if a.quick else 3)
    modes: dict[str, Callable[[], dict[str, float]]] = {
        "earl_rlimits": lambda: _measure(_earl(False), calls, a.threads,
                                         sandbox.close_fork_servers),
        "spawn": lambda: _measure(_spawn, calls, a.threads, None),
        "fork_floor": lambda: _floor(calls),
    }
    if sandbox.isolation_available():
        modes = {"earl": lambda: _measure(_earl(True), calls, a.threads,
                                          sandbox.close_fork_servers), **modes}
    load0 = os.getloadavg()[0]
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(repeats):  # interleaved, so a burst of load hits every mode alike
        for name, measure in modes.items():
            runs[name].append(measure())
    res: dict[str, Any] = {"bench": "sandbox", "calls": calls, "threads": a.threads,
                           "repeats": repeats, "isolation_available":
                           sandbox.isolation_available()}
    res.update({name: _summarize(r) for name, r in runs.items()})
    best = res["earl"] if "earl" in res else res["earl_rlimits"]
    res["cpu_ratio_spawn_vs_earl"] = round(res["spawn"]["cpu_ms_per_call"]
                                           / best["cpu_ms_per_call"], 2)
    res["rate_ratio_earl_vs_spawn"] = round(best["calls_per_s"] / res["spawn"]["calls_per_s"],
                                            2)
    res.update(loadavg_start=round(load0, 2), loadavg_end=round(os.getloadavg()[0], 2),
               cpus=os.cpu_count())
    print(json.dumps(res))
    if a.save:
        _results.save("sandbox", res, quick=a.quick, begun=begun)


if __name__ == "__main__":
    main()
