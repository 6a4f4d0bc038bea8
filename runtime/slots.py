"""Device slots: the runtime's unit of placement, with limits the operating system enforces.

A slot is a GPU where there is one, and on CPU a set of cores plus a memory budget. On Linux
with writable cgroup v1 controllers (root on these machines) the budget is a memory cgroup
(`memory.limit_in_bytes`: the kernel's OOM killer ends a process that exceeds it, the way a GPU
OOM ends a CUDA job), the cores a cpuset cgroup, and a CPU share a cpu cgroup's CFS quota (a
slot of 0.5 cores is throttled to half a core's time however many threads it runs, so N slots
over a few cores bind like N small devices); otherwise the fallback is
`sched_setaffinity` plus `RLIMIT_AS` (allocation fails with MemoryError instead of a kill),
and a slot says plainly which of them hold (`Slot.memory_enforcement`, `cpu_enforcement`).
A slot with cores or a share also gets a cpuacct cgroup: `SlotPool.cpu_usage` says the CPU
time it used and how often its quota throttled it.

    pool = SlotPool()                                   # detects what is enforceable
    s = pool.create("roll0", cores=(0,), memory_mib=2048)
    g = await rt.spawn("rollout", Rollout, slot=pool.assign("roll0", "rollout"))
    ...                                                  # the actor and its children live in s
    await rt.stop(g); pool.release("roll0")              # slots move: release, then assign
    pool.close()                                         # removes the cgroups (also at exit)

An actor that dies of the slot's OOM killer is reported as `ActorDied("... out of memory in slot
roll0 (limit 2048 MiB)")`. Not here: deciding which actor gets which slot (the selector, in
`earl.runtime.selector`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import resource
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Self

from earl.runtime.cgroups import (
    SlotCpu,
    own_cgroup,
    read_int,
    read_slot_cpu,
    remove_cgroup,
    sweep_stale,
    thread_ids,
    write,
)
from earl.runtime.wire import message

MEMORY_ROOT = "/sys/fs/cgroup/memory"
CPUSET_ROOT = "/sys/fs/cgroup/cpuset"
CPU_ROOT = "/sys/fs/cgroup/cpu"
CPUACCT_ROOT = "/sys/fs/cgroup/cpuacct"  # or the cpu hierarchy itself, mounted as cpu,cpuacct
CFS_PERIOD_US = 100_000
SHARE_ENV = "EARL_SLOT_CPU_SHARE"  # set in a slot with a CPU share: its cores are time-shared
MemoryEnforcement = Literal["cgroup", "rlimit", "device", "none"]
CpuEnforcement = Literal["cpuset", "affinity", "none"]


@message
@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """One place an actor runs (travels inside the spawn spec; made by `SlotPool.create`).

    Attributes:
        name: unique within its pool.
        cores: CPU cores the actor may run on (empty: no restriction).
        memory_mib: memory budget of the actor and its children (None: none).
        gpus: GPU indices as this process numbers them (torch.cuda's order): the actor sees
            exactly these (`env` sets its CUDA_VISIBLE_DEVICES), as its devices 0, 1, ...;
            empty on CPU. A tensor-parallel vLLM replica holds its TP group's GPUs in one slot.
        memory_cgroup / cpuset_cgroup: cgroup v1 directories ("" when not used).
        memory_enforcement: "cgroup" (kernel OOM killer), "rlimit" (RLIMIT_AS, allocation fails),
            "device" (a GPU slot: `memory_mib` is the budget on each of its GPUs, which CUDA's
            OOM enforces)
            or "none" (limits NOT enforced: the budget is only advisory).
        cpu_enforcement: "cpuset", "affinity" (sched_setaffinity) or "none".
        cpu_share: cores' worth of CPU time the slot may use (0.5: half a core), enforced by
            the cpu cgroup's CFS quota in `cpu_cgroup` (None: no share; "" when the cpu
            controller is not writable: the share is then advisory, `limits_enforced` False).
        cpuacct_cgroup: the cpuacct cgroup that counts the slot's CPU time (`cpu_cgroup`
            itself where the two controllers are mounted together; "" when not counted).
    """

    name: str
    cores: tuple[int, ...] = ()
    memory_mib: int | None = None
    gpus: tuple[int, ...] = ()
    memory_cgroup: str = ""
    cpuset_cgroup: str = ""
    memory_enforcement: MemoryEnforcement = "none"
    cpu_enforcement: CpuEnforcement = "none"
    cpu_share: float | None = None
    cpu_cgroup: str = ""
    cpuacct_cgroup: str = ""

    @property
    def limits_enforced(self) -> bool:
        """True when the OS enforces every limit this slot declares."""
        mem_ok = self.memory_mib is None or self.memory_enforcement != "none"
        cpu_ok = not self.cores or self.cpu_enforcement != "none"
        share_ok = self.cpu_share is None or bool(self.cpu_cgroup)
        return mem_ok and cpu_ok and share_ok

    def env(self, parent: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment variables an actor in this slot needs (GPU visibility, thread count).

        Args:
            parent: the launching process's environment (default `os.environ`). When it
                restricts the GPUs already (CUDA_VISIBLE_DEVICES="4,5,6,7"), slot indices
                count within that list, so GPU 1 of the slot is the parent's "5".

        Raises:
            ValueError: a slot GPU beyond the parent's CUDA_VISIBLE_DEVICES.
        """
        out: dict[str, str] = {}
        if self.gpus:
            out["CUDA_VISIBLE_DEVICES"] = ",".join(_visible(self.gpus, parent))
        if self.cores or self.cpu_share is not None:
            threads = len(self.cores) or os.cpu_count() or 1
            if self.cpu_share is not None:  # more threads than the share only queue up
                threads = min(threads, max(1, round(self.cpu_share)))
                out[SHARE_ENV] = f"{self.cpu_share:g}"
            out["OMP_NUM_THREADS"] = str(threads)
        return out


def _visible(gpus: tuple[int, ...], parent: Mapping[str, str] | None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of `gpus`, through the parent's own list if it has one."""
    env = os.environ if parent is None else parent
    seen = env.get("CUDA_VISIBLE_DEVICES")
    if seen is None:
        return [str(g) for g in gpus]
    names = [n.strip() for n in seen.split(",") if n.strip()]
    far = [g for g in gpus if g >= len(names)]
    if far:
        raise ValueError(f"slot GPU(s) {far} beyond this process's CUDA_VISIBLE_DEVICES="
                         f"{seen!r} ({len(names)} GPU(s)); number slot GPUs within it")
    return [names[g] for g in gpus]


def detect_gpus() -> int:
    """NVIDIA GPUs the driver shows on this host (0 when there is none or no driver)."""
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    return 0


def per_rank(slot: Slot | list[Slot] | tuple[Slot, ...] | None, n: int) -> list[Slot | None]:
    """The slot of each of `n` ranks: one slot for a single rank, or one slot per rank.

    Raises:
        ValueError: the number of slots does not match `n`, or one slot is given to n > 1 ranks.
    """
    if slot is None:
        return [None] * n
    if isinstance(slot, Slot):
        if n != 1:
            raise ValueError(f"slot=: one slot ({slot.name!r}) for {n} ranks; pass a list of "
                             f"{n} slots (one per rank)")
        return [slot]
    if len(slot) != n:
        raise ValueError(f"slot=: {len(slot)} slots for {n} ranks; pass exactly one per rank")
    return list(slot)


class SlotBinding:
    """A process placed in a slot (made by `bind_process`); explains the process's death."""

    def __init__(self, slot: Slot, pid: int) -> None:
        self.slot = slot
        self.pid = pid
        self._oom_kills = self._kills()
        self._failcnt = self._fails()

    def _kills(self) -> int:
        if not self.slot.memory_cgroup:
            return 0
        with contextlib.suppress(OSError, ValueError):
            return read_int(os.path.join(self.slot.memory_cgroup, "memory.oom_control"),
                             "oom_kill")
        return 0

    def _fails(self) -> int:
        if not self.slot.memory_cgroup:
            return 0
        with contextlib.suppress(OSError, ValueError):
            return read_int(os.path.join(self.slot.memory_cgroup, "memory.failcnt"))
        return 0

    def exit_reason(self, returncode: int | None) -> str | None:
        """"out of memory in slot NAME (limit N MiB)" if the slot's OOM killer ended the
        process (SIGKILL while the cgroup's oom_kill counter, or failing that its failcnt,
        went up since the process was placed); None otherwise."""
        if returncode != -signal.SIGKILL or not self.slot.memory_cgroup:
            return None
        if self._kills() > self._oom_kills or (self._kills() == 0 and self._fails() > self._failcnt):
            return f"out of memory in slot {self.slot.name} (limit {self.slot.memory_mib} MiB)"
        return None


def set_memory_limit(cgroup: str, mib: int) -> None:
    """Set a memory cgroup's limit, with swap (memsw) at the same value where it is accounted;
    v1 wants memory <= memsw at every moment, so a raise sets memsw first."""
    limit = str(mib << 20)
    mem, memsw = (os.path.join(cgroup, f) for f in ("memory.limit_in_bytes",
                                                    "memory.memsw.limit_in_bytes"))
    order = [memsw, mem] if mib << 20 > read_int(mem) else [mem, memsw]
    for path in order:
        if path == mem:
            write(path, limit)
        else:
            with contextlib.suppress(OSError):  # no swap accounting: nothing to cap
                write(path, limit)


def bind_process(slot: Slot, pid: int, carried_mib: float = 0.0) -> SlotBinding:
    """Place process `pid` (a freshly started actor before it loads anything, or a warm host:
    all its threads move) in `slot`; its children inherit the placement.

    `carried_mib`: memory the process took before the move (a warm host's imports). The kernel
    (6.x) no longer moves charges between memory cgroups, so those pages stay charged where
    they were made; the slot's limit is lowered by them, so the process holds no more than the
    slot's budget in all, as if it had started in the slot. Every bind sets the limit afresh.

    Raises:
        OSError: the cgroup or the affinity could not be applied.
    """
    if slot.memory_enforcement == "cgroup":
        if slot.memory_mib is not None:
            set_memory_limit(slot.memory_cgroup, max(slot.memory_mib - round(carried_mib), 1))
        write(os.path.join(slot.memory_cgroup, "cgroup.procs"), str(pid))
    elif slot.memory_enforcement == "rlimit" and slot.memory_mib is not None:
        limit = slot.memory_mib << 20
        resource.prlimit(pid, resource.RLIMIT_AS, (limit, limit))
    for d in dict.fromkeys((slot.cpu_cgroup, slot.cpuacct_cgroup)):  # one where co-mounted
        if d:
            write(os.path.join(d, "cgroup.procs"), str(pid))
    if slot.cpu_enforcement == "cpuset":
        write(os.path.join(slot.cpuset_cgroup, "cgroup.procs"), str(pid))
    elif slot.cpu_enforcement == "affinity":  # every thread (a warm host has started some)
        for tid in thread_ids(pid):
            with contextlib.suppress(ProcessLookupError):  # a thread that just ended
                os.sched_setaffinity(tid, slot.cores)
    return SlotBinding(slot, pid)


@dataclass(frozen=True, slots=True)
class SlotPoolStatistics:
    slots: int
    assigned: dict[str, str]  # slot name -> owner
    memory_enforcement: MemoryEnforcement
    cpu_enforcement: CpuEnforcement


class SlotPool:
    """Creates slots, hands them to actors (assign/release) and removes their cgroups at close.

    Args:
        use_cgroups: False forces the fallback (affinity + RLIMIT_AS); None detects.
        memory_root / cpuset_root / cpu_root / cpuacct_root: the cgroup v1 mount points (cpu
            and cpuacct may be one hierarchy, "cpu,cpuacct": detected, then one group each).
    """

    def __init__(self, *, use_cgroups: bool | None = None, memory_root: str = MEMORY_ROOT,
                 cpuset_root: str = CPUSET_ROOT, cpu_root: str = CPU_ROOT,
                 cpuacct_root: str = CPUACCT_ROOT) -> None:
        self._slots: dict[str, Slot] = {}
        self._owner: dict[str, str] = {}
        self._parts: dict[str, tuple[str, ...]] = {}  # joined slot -> the slots it spans
        self._dirs: list[str] = []  # cgroup directories we made, parents first
        tag = f"earl-{os.getpid()}"
        self._mem_base = self._cpu_base = self._quota_base = self._acct_base = ""
        if use_cgroups is not False:
            self._mem_base = self._make_base(memory_root, "memory", tag)
            self._cpu_base = self._make_base(cpuset_root, "cpuset", tag)
            self._quota_base = self._make_base(cpu_root, "cpu", tag)
            comounted = bool(self._quota_base) and os.path.isfile(
                os.path.join(self._quota_base, "cpuacct.usage"))  # kernel's files, not names
            self._acct_base = (self._quota_base if comounted
                               else self._make_base(cpuacct_root, "cpuacct", tag))
        self.memory_enforcement: MemoryEnforcement = "cgroup" if self._mem_base else "rlimit"
        self.cpu_enforcement: CpuEnforcement = ("cpuset" if self._cpu_base else
                                                "affinity" if hasattr(os, "sched_setaffinity")
                                                else "none")
        atexit.register(self.close)

    def _make_base(self, root: str, controller: str, tag: str) -> str:
        parent = os.path.join(root, own_cgroup(controller).lstrip("/"))
        if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
            return ""
        sweep_stale(parent)
        base = os.path.join(parent, tag)
        try:
            os.makedirs(base, exist_ok=True)
            if controller == "cpuset":  # every cpuset level needs cpus and mems before tasks
                for f in ("cpuset.cpus", "cpuset.mems"):
                    with open(os.path.join(parent, f)) as src:
                        write(os.path.join(base, f), src.read().strip())
        except OSError:
            with contextlib.suppress(OSError):
                os.rmdir(base)
            return ""
        self._dirs.append(base)
        return base

    def create(self, name: str, *, cores: tuple[int, ...] | list[int] = (),
               memory_mib: int | None = None, gpus: tuple[int, ...] | list[int] = (),
               cpu_share: float | None = None) -> Slot:
        """Make a slot (its cgroups too, when enforceable).

        Args:
            name: letters, digits, '-' or '_'.
            cores: CPU cores (a cpuset, or affinity in the fallback).
            memory_mib: the budget: host memory on CPU (a memory cgroup), the memory on each
                GPU for a GPU slot (enforced by the device itself).
            gpus: GPU indices (`detect_gpus()` says how many there are); a TP group's GPUs
                in one slot.
            cpu_share: cores' worth of CPU time (a CFS quota over `CFS_PERIOD_US`); at most
                the slot's cores (or this machine's) and at least 0.01.

        Raises:
            ValueError: bad name, a name in use, cores this machine lacks, memory_mib < 16,
                a negative or repeated GPU index, a share outside (0.01, its cores].
        """
        if not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"slot name must be letters, digits, '-' or '_', got {name!r}")
        if name in self._slots:
            raise ValueError(f"a slot named {name!r} exists already")
        ncpu = os.cpu_count() or 1
        cores = tuple(sorted(set(cores)))
        if any(c < 0 or c >= ncpu for c in cores):
            raise ValueError(f"slot {name!r}: cores {cores} outside this machine's 0-{ncpu - 1}")
        if memory_mib is not None and memory_mib < 16:
            raise ValueError(f"slot {name!r}: memory_mib must be >= 16, got {memory_mib}")
        most = len(cores) or ncpu
        if cpu_share is not None and not 0.01 <= cpu_share <= most:
            raise ValueError(f"slot {name!r}: cpu_share {cpu_share} must be in [0.01, {most}] "
                             "(cores' worth of CPU time; at most the slot's cores)")
        gpus = tuple(gpus)
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ValueError(f"slot {name!r}: gpus {gpus} must be distinct indices >= 0")
        mem_dir = cpu_dir = ""
        mem_enf: MemoryEnforcement = "none"
        cpu_enf: CpuEnforcement = "none"
        if memory_mib is not None and gpus:
            mem_enf = "device"
        elif memory_mib is not None:
            mem_enf = self.memory_enforcement
            if self._mem_base:
                mem_dir = self._mkdir(self._mem_base, name)
                set_memory_limit(mem_dir, memory_mib)
        if cores:
            cpu_enf = self.cpu_enforcement
            if self._cpu_base:
                cpu_dir = self._mkdir(self._cpu_base, name)
                write(os.path.join(cpu_dir, "cpuset.cpus"), ",".join(map(str, cores)))
                with open(os.path.join(self._cpu_base, "cpuset.mems")) as f:
                    write(os.path.join(cpu_dir, "cpuset.mems"), f.read().strip())
        quota_dir = ""
        if cpu_share is not None and self._quota_base:
            quota_dir = self._mkdir(self._quota_base, name)
            write(os.path.join(quota_dir, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
            write(os.path.join(quota_dir, "cpu.cfs_quota_us"), str(round(cpu_share * CFS_PERIOD_US)))
        acct_dir = ""
        if (cores or cpu_share is not None) and self._acct_base:
            acct_dir = (quota_dir if quota_dir and self._acct_base == self._quota_base
                        else self._mkdir(self._acct_base, name))
        slot = Slot(name=name, cores=cores, memory_mib=memory_mib, gpus=gpus,
                    memory_cgroup=mem_dir, cpuset_cgroup=cpu_dir, memory_enforcement=mem_enf,
                    cpu_enforcement=cpu_enf, cpu_share=cpu_share, cpu_cgroup=quota_dir,
                    cpuacct_cgroup=acct_dir)
        self._slots[name] = slot
        return slot

    def _mkdir(self, base: str, name: str) -> str:
        path = os.path.join(base, name)
        os.makedirs(path, exist_ok=True)
        self._dirs.append(path)
        return path

    def __getitem__(self, name: str) -> Slot:
        try:
            return self._slots[name]
        except KeyError:
            raise KeyError(f"no slot named {name!r}; slots: {', '.join(self._slots)}") from None

    def assign(self, name: str, owner: str) -> Slot:
        """Give slot `name` to `owner` (an actor group name) and return it for `spawn(slot=)`.

        Raises:
            ValueError: the slot belongs to another owner (release it first).
        """
        slot = self[name]
        held = self._owner.get(name)
        if held is not None and held != owner:
            raise ValueError(f"slot {name!r} is assigned to {held!r}: stop that actor and "
                             f"release the slot before assigning it to {owner!r}")
        self._owner[name] = owner
        return slot

    def join(self, names: tuple[str, ...] | list[str], owner: str) -> Slot:
        """One slot spanning `names` for one rank that needs several devices (a tensor-parallel
        vLLM replica and its workers): their cores, GPUs, memory and CPU shares together, in
        cgroups of its own; the parts are `owner`'s while it lives. One name: `assign`.

        Raises:
            ValueError: a part belongs to another owner, or runs processes (its actor must be
                stopped before its device joins another rank's).
        """
        names = tuple(names)
        if len(names) == 1:
            return self.assign(names[0], owner)
        joined = "_".join(names)
        if joined not in self._slots:
            parts = [self[n] for n in names]
            for n in names:
                held = self._owner.get(n)
                if held is not None and held != owner:
                    raise ValueError(f"slot {n!r} is assigned to {held!r}: stop that actor and "
                                     f"release the slot before joining it for {owner!r}")
            shares = [s.cpu_share for s in parts]
            mems = [s.memory_mib for s in parts]
            self.create(joined, cores=sorted({c for s in parts for c in s.cores}),
                        memory_mib=None if None in mems else sum(m or 0 for m in mems),
                        gpus=[g for s in parts for g in s.gpus],
                        cpu_share=None if None in shares else sum(x or 0.0 for x in shares))
            self._parts[joined] = names
        for n in names:
            self._owner[n] = owner
        return self.assign(joined, owner)

    def joined(self) -> dict[str, tuple[str, ...]]:
        """Joined slots alive now -> the slots each spans."""
        return dict(self._parts)

    def release(self, name: str) -> None:
        """Take slot `name` back. Its processes must be gone (stop the actor first). A joined
        slot is removed (its cgroups too); its parts stay with their owner.

        Raises:
            ValueError: processes still run in the slot, or it is part of a joined slot that
                is still there (release that first).
        """
        live = self.pids(name)
        if live:
            raise ValueError(f"slot {name!r} still runs pids {live}: stop its actor before "
                             "releasing the slot")
        within = [j for j, parts in self._parts.items() if name in parts]
        if within:
            raise ValueError(f"slot {name!r} is part of joined slot(s) {within}: release "
                             "those first")
        self._owner.pop(name, None)
        if self._parts.pop(name, None) is not None:
            slot = self._slots.pop(name)
            for d in dict.fromkeys((slot.memory_cgroup, slot.cpuset_cgroup, slot.cpu_cgroup,
                                    slot.cpuacct_cgroup)):
                if d:
                    remove_cgroup(d)
                    self._dirs.remove(d)

    def owner(self, name: str) -> str | None:
        return self._owner.get(self[name].name)

    def pids(self, name: str) -> list[int]:
        """Processes now in the slot (cgroup slots only; [] otherwise)."""
        slot = self[name]
        d = slot.memory_cgroup or slot.cpuset_cgroup or slot.cpu_cgroup or slot.cpuacct_cgroup
        if not d:
            return []
        with open(os.path.join(d, "cgroup.procs")) as f:
            return [int(p) for p in f.read().split()]

    def budgets(self) -> dict[str, float]:
        """Slot name -> memory budget in bytes, for the slots that have one (the selector's
        `slots` input; joined slots are not devices of their own and are left out)."""
        return {n: float(s.memory_mib << 20) for n, s in self._slots.items()
                if s.memory_mib is not None and n not in self._parts}

    def memory_used_mib(self, name: str) -> float | None:
        """Memory charged to the slot now (cgroup slots; None otherwise)."""
        d = self[name].memory_cgroup
        return read_int(os.path.join(d, "memory.usage_in_bytes")) / 2**20 if d else None

    def memory_peak_mib(self, name: str) -> float | None:
        """The most memory charged to the slot since it was made or `reset_memory_peak`
        (cgroup slots; None otherwise)."""
        d = self[name].memory_cgroup
        return read_int(os.path.join(d, "memory.max_usage_in_bytes")) / 2**20 if d else None

    def reset_memory_peak(self, name: str) -> None:
        """Start the slot's peak (`memory_peak_mib`) again from what it holds now."""
        if d := self[name].memory_cgroup:
            write(os.path.join(d, "memory.max_usage_in_bytes"), "0")

    def cpu_usage(self, name: str) -> SlotCpu | None:
        """The slot's CPU time and CFS throttling since it was made (None: no cpuacct group,
        as in the fallback or for a slot with neither cores nor a share).

        A joined slot has groups of its own, so this is its rank's usage; its parts count
        only what ran in them directly, never the joined rank's, and nothing is counted twice.
        Its counts go with it at `release`.
        """
        slot = self[name]
        return read_slot_cpu(slot.cpuacct_cgroup, slot.cpu_cgroup) if slot.cpuacct_cgroup else None

    def statistics(self) -> SlotPoolStatistics:
        return SlotPoolStatistics(slots=len(self._slots), assigned=dict(self._owner),
                                  memory_enforcement=self.memory_enforcement,
                                  cpu_enforcement=self.cpu_enforcement)

    def close(self) -> None:
        """Remove every cgroup this pool made; leftover processes move to the parent group."""
        for d in reversed(self._dirs):
            remove_cgroup(d)
        self._dirs.clear()
        self._slots.clear()
        self._owner.clear()
        self._parts.clear()
        atexit.unregister(self.close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
