"""cgroup v1 filesystem operations for device slots (`earl.runtime.slots`): read and write
control files, find this process's group, remove groups (their processes moved to the parent)
and sweep the groups of pools whose process died; read a slot's CPU accounting (`SlotCpu`)."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

__all__ = ["SlotCpu", "own_cgroup", "pid_alive", "read_int", "read_keys", "read_slot_cpu",
           "remove_cgroup", "sweep_stale", "write"]


def read_int(path: str, key: str | None = None) -> int:
    with open(path) as f:
        text = f.read()
    if key is None:
        return int(text.split()[0])
    for line in text.splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


def read_keys(path: str) -> dict[str, int]:
    """A flat keyed file ("nr_throttled 3" a line, as `cpu.stat`) in one read, so its counters
    are of one instant."""
    with open(path) as f:
        return {k: int(v) for k, _, v in (line.partition(" ") for line in f) if v.strip()}


def write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def own_cgroup(controller: str) -> str:
    """This process's cgroup v1 path for `controller` ("" if not found)."""
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if controller in ctrls.split(","):
                return path
    return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_cgroup(d: str) -> None:
    if not os.path.isdir(d):
        return
    for child in os.listdir(d):
        if os.path.isdir(os.path.join(d, child)):
            remove_cgroup(os.path.join(d, child))
    with contextlib.suppress(OSError):
        with open(os.path.join(d, "cgroup.procs")) as f:
            pids = f.read().split()
        for pid in pids:
            with contextlib.suppress(OSError):
                write(os.path.join(os.path.dirname(d), "cgroup.procs"), pid)
    with contextlib.suppress(OSError):
        os.rmdir(d)


def sweep_stale(parent: str) -> None:
    """Remove `earl-PID` groups left by pools whose process died without closing them."""
    with contextlib.suppress(OSError):
        for entry in os.listdir(parent):
            if (entry.startswith("earl-") and entry[5:].isdigit()
                    and not pid_alive(int(entry[5:]))):
                remove_cgroup(os.path.join(parent, entry))


def thread_ids(pid: int) -> list[int]:
    """The thread ids of process `pid` (just `pid` where /proc cannot say)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return [pid]


def normal_priority(pid: int) -> None:
    """Every thread of `pid` back to SCHED_OTHER (best effort: needs the same user)."""
    for tid in thread_ids(pid):
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotCpu:
    """A slot's CPU accounting since its groups were made (`SlotPool.cpu_usage`).

    Attributes:
        cpu_s: CPU time its processes used (cpuacct.usage), all cores together.
        nr_periods / nr_throttled / throttled_s: CFS periods with runnable work, those in
            which the quota ran out, and the time it spent throttled, waiting for the next
            period (cpu.stat); None for a slot without a CPU share (no quota to throttle it).
    """

    cpu_s: float
    nr_periods: int | None = None
    nr_throttled: int | None = None
    throttled_s: float | None = None


def read_slot_cpu(cpuacct_cgroup: str, cpu_cgroup: str = "") -> SlotCpu:
    """A slot's `SlotCpu` from its cgroup directories (`cpu_cgroup`: the one with its CFS
    quota, "" for none); also for reading another process's pool from outside.

    Raises:
        OSError: a directory is gone (its pool closed) or is not a cgroup.
    """
    cpu_s = read_int(os.path.join(cpuacct_cgroup, "cpuacct.usage")) / 1e9
    if not cpu_cgroup:
        return SlotCpu(cpu_s=cpu_s)
    stat = read_keys(os.path.join(cpu_cgroup, "cpu.stat"))
    return SlotCpu(cpu_s=cpu_s, nr_periods=stat["nr_periods"],
                   nr_throttled=stat["nr_throttled"], throttled_s=stat["throttled_time"] / 1e9)
