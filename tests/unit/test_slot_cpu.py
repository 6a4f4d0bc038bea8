"""A slot's CPU accounting without a kernel (runtime/slots.py, runtime/cgroups.py):
`read_slot_cpu` over fake cgroup files, and where `SlotPool` puts a slot's cpuacct group when cpu and cpuacct are
separate hierarchies or one (cpu,cpuacct), told apart by the kernel's files, not by names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from earl.runtime import slots
from earl.runtime.cgroups import SlotCpu, read_slot_cpu
from earl.runtime.slots import SlotPool

pytestmark = pytest.mark.timeout(30)

STAT = "nr_periods 40\nnr_throttled 25\nthrottled_time 1250000000\nnr_bursts 0\nburst_time 0\n"


def _counters(d: str, usage_ns: int, stat: str | None = None) -> None:
    Path(d, "cpuacct.usage").write_text(f"{usage_ns}\n")
    if stat is not None:
        Path(d, "cpu.stat").write_text(stat)


def test_cpu_time_and_throttling_are_read_in_seconds(tmp_path: Path) -> None:
    _counters(str(tmp_path), 1_500_000_000, STAT)
    assert read_slot_cpu(str(tmp_path), str(tmp_path)) == SlotCpu(
        cpu_s=1.5, nr_periods=40, nr_throttled=25, throttled_s=1.25)
    # no quota: its cpu.stat (all zeros, or absent) is not read
    assert read_slot_cpu(str(tmp_path)) == SlotCpu(cpu_s=1.5)


def _pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpu: Path, acct: Path) -> SlotPool:
    monkeypatch.setattr(slots, "own_cgroup", lambda controller: "/")
    absent = str(tmp_path / "absent")
    return SlotPool(memory_root=absent, cpuset_root=absent, cpu_root=str(cpu),
                    cpuacct_root=str(acct))


def test_separate_cpu_and_cpuacct_hierarchies_give_a_slot_one_group_in_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, acct = tmp_path / "cpu", tmp_path / "cpuacct"
    cpu.mkdir()
    acct.mkdir()
    with _pool(tmp_path, monkeypatch, cpu, acct) as pool:
        half = pool.create("half", cores=(0,), cpu_share=0.5)
        whole = pool.create("whole", cores=(0,))
        bare = pool.create("bare", memory_mib=64)  # neither cores nor a share: not counted
        tag = f"earl-{os.getpid()}"
        assert half.cpu_cgroup == str(cpu / tag / "half")
        assert half.cpuacct_cgroup == str(acct / tag / "half")
        assert (whole.cpu_cgroup, whole.cpuacct_cgroup) == ("", str(acct / tag / "whole"))
        assert bare.cpuacct_cgroup == "" and pool.cpu_usage("bare") is None
        _counters(half.cpuacct_cgroup, 400_000_000)
        _counters(half.cpu_cgroup, 0, STAT)
        _counters(whole.cpuacct_cgroup, 2_000_000_000)
        assert pool.cpu_usage("half") == SlotCpu(cpu_s=0.4, nr_periods=40, nr_throttled=25,
                                                 throttled_s=1.25)
        assert pool.cpu_usage("whole") == SlotCpu(cpu_s=2.0)


def test_cpu_and_cpuacct_mounted_together_give_a_slot_one_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    both = tmp_path / "cpu,cpuacct"
    base = both / f"earl-{os.getpid()}"
    base.mkdir(parents=True)
    (base / "cpuacct.usage").write_text("0\n")  # what the kernel puts in a co-mounted group
    elsewhere = tmp_path / "cpuacct-unused"
    elsewhere.mkdir()
    with _pool(tmp_path, monkeypatch, both, elsewhere) as pool:
        half = pool.create("half", cores=(0,), cpu_share=0.5)
        whole = pool.create("whole", cores=(0,))
        assert half.cpuacct_cgroup == half.cpu_cgroup == str(base / "half")
        assert (whole.cpu_cgroup, whole.cpuacct_cgroup) == ("", str(base / "whole"))
        assert not any(elsewhere.iterdir())  # no second hierarchy was assumed
        _counters(half.cpu_cgroup, 300_000_000, STAT)
        assert pool.cpu_usage("half") == SlotCpu(cpu_s=0.3, nr_periods=40, nr_throttled=25,
                                                 throttled_s=1.25)
