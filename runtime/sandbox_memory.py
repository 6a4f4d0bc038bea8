"""A sandbox run's memory budget: per-run cgroup v1 memory groups, or a split (stdlib only).

With root and cgroup v1's memory controller, `memory_mb` bounds all of a run's processes
together: its first process joins a memory cgroup before any of its code runs, and every process
it starts is born there. When they together reach the limit the kernel's OOM killer fires inside
the group, and `sandbox_zygote.py`, told through an eventfd (`Group.oom_fd`), kills the rest of
the run. The groups are children of the cgroup the fork server runs in (its caller's), so a run's
memory still counts toward whatever limit holds the caller. Making and removing a memory cgroup
costs more than a run's other set-up, so the fork server keeps a pool (`Pool`): a group is reused
once the run that held it has no process left, its limit rewritten and its peak reset. The pool
is opened before the fork server chroots and reaches its groups through that directory
descriptor afterwards. Groups are named `earl-sandbox-<server pid>-<n>`; the server removes them
when it exits, its reaper (`sandbox_reaper.py`) when the server is killed.

Where there is no such controller (cgroup v2 only, or not writable), `Pool.open` returns None
with the reason and `split` divides the budget between a capped number of processes instead.
This module does not kill processes.
"""

from __future__ import annotations

import errno
import os
import time
from collections import deque

__all__ = ["Group", "Pool", "split"]

_MOUNT = "/sys/fs/cgroup/memory"
_MIN_PROCESS_MB = 64  # below this a forked interpreter barely starts (it maps ~16 MB)


def split(memory_mb: int, max_procs: int, whole_run: bool, capped: bool
          ) -> tuple[int, int | None]:
    """(address space per process in MB, process cap or None) for a run's `memory_mb`.

    With a cgroup holding the whole run (`whole_run`) each process may use it all, the cgroup
    bounding their sum. Without one, where processes can be capped (`capped`: the run has a
    uid of its own), the budget is split: each process gets `memory_mb / max_procs`, at least
    `_MIN_PROCESS_MB`, and the cap shrinks so that cap x per-process stays within `memory_mb`.
    Otherwise (no root) `memory_mb` bounds each process alone.
    """
    if whole_run or not capped:
        return memory_mb, max_procs if capped else None
    per = min(memory_mb, max(memory_mb // max_procs, _MIN_PROCESS_MB))
    return per, max(1, min(max_procs, memory_mb // per))


class Group:
    """One cgroup of the pool; `oom_fd` is an eventfd readable once the group hits its limit."""

    def __init__(self, name: str, oom_fd: int) -> None:
        self.name = name
        self.oom_fd = oom_fd
        self.limit = 1 << 63  # a new group is unlimited


class Pool:
    """The fork server's memory cgroups: `acquire` one per run, `join` it from the run's first
    process, read its `peak_mb`, `release` it when the run is over."""

    def __init__(self, dir_fd: int, prefix: str) -> None:
        self.dir_fd = dir_fd  # the parent cgroup, opened before the chroot
        self.prefix = prefix
        self.free: deque[Group] = deque()
        self.count = 0
        self.swap = os.path.exists(f"{_MOUNT}/memory.memsw.limit_in_bytes")

    @classmethod
    def open(cls) -> tuple[Pool | None, str]:
        """A pool under this process's memory cgroup, or None and why there is none."""
        try:
            with open("/proc/self/cgroup") as f:
                path = next(line.split(":", 2)[2].strip() for line in f
                            if "memory" in line.split(":")[1].split(","))
            dir_fd = os.open(_MOUNT + path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, StopIteration) as e:
            return None, f"no memory cgroup (v1) to nest runs in: {e!r}"
        pool = cls(dir_fd, f"earl-sandbox-{os.getpid()}-")
        try:
            pool.release(pool._create())  # proves we may create groups and write their files
        except OSError as e:
            pool.close()
            return None, f"cannot create memory cgroups under {_MOUNT + path}: {e}"
        return pool, "memcg"

    def _write(self, name: str, value: str) -> None:
        fd = os.open(name, os.O_WRONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def _read(self, name: str) -> bytes:
        fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC, dir_fd=self.dir_fd)
        try:
            return os.read(fd, 4096)
        finally:
            os.close(fd)

    def _create(self) -> Group:
        name = f"{self.prefix}{self.count}"
        self.count += 1
        os.mkdir(name, dir_fd=self.dir_fd)
        oom_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        control = os.open(f"{name}/memory.oom_control", os.O_RDONLY | os.O_CLOEXEC,
                          dir_fd=self.dir_fd)
        try:  # cgroup v1's OOM notification: the eventfd counts the group's OOM events
            self._write(f"{name}/cgroup.event_control", f"{oom_fd} {control}")
        finally:
            os.close(control)
        return Group(name, oom_fd)

    def acquire(self, limit_mb: int) -> Group:
        """A group with no process in it, limited to `limit_mb` (swap included), peak reset."""
        group = None
        for _ in range(len(self.free)):  # oldest first: the likeliest to be empty by now
            candidate = self.free.popleft()
            if self.empty(candidate):
                group = candidate
                break
            self.free.append(candidate)  # the last run's killed processes are still exiting
        group = group or self._create()
        limit = limit_mb << 20
        if group.limit != limit:  # memory+swap must never be below memory: order the writes
            files = ["memory.limit_in_bytes"] + ["memory.memsw.limit_in_bytes"] * self.swap
            for f in files if limit < group.limit else files[::-1]:
                self._write(f"{group.name}/{f}", str(limit))
            group.limit = limit
        self._write(f"{group.name}/memory.max_usage_in_bytes", "0")
        try:
            os.eventfd_read(group.oom_fd)  # drop events of the group's previous run
        except BlockingIOError:
            pass
        return group

    def empty(self, group: Group) -> bool:
        """Whether no process is left in `group` (exited ones leave at once, reaped or not)."""
        return not self._read(f"{group.name}/cgroup.procs")

    def join(self, group: Group) -> None:
        """Move the calling process into `group` (its children are then born there)."""
        self._write(f"{group.name}/cgroup.procs", str(os.getpid()))

    def peak_mb(self, group: Group) -> float:
        """The most memory the group's processes held at once since `acquire`, in MiB."""
        return int(self._read(f"{group.name}/memory.max_usage_in_bytes")) / (1 << 20)

    def release(self, group: Group) -> None:
        self.free.append(group)

    def close(self) -> None:
        """Remove every group (their processes must have been killed) and close the pool."""
        while self.free:
            os.close(self.free.popleft().oom_fd)
        self.remove_groups()
        os.close(self.dir_fd)

    def remove_groups(self, wait_s: float = 2.0) -> None:
        """Remove every group of the pool, in use or not, waiting up to `wait_s` for killed
        processes to leave them; a group still busy after that is left behind."""
        deadline = time.monotonic() + wait_s
        for name in os.listdir(self.dir_fd):
            if name.startswith(self.prefix):
                _rmdir(self.dir_fd, name, deadline)


def _rmdir(dir_fd: int, name: str, deadline: float) -> None:
    while True:
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return
            time.sleep(0.01)
