"""Warm hosts (`Runtime.keep_warm`): a process started ahead with its class's imports done
becomes the next spawned actor of that class, with the spawn's environment and slot; the pool
refills; a cold spawn imports nothing ahead; the hosts end with the runtime; in a slot, the
memory its imports took counts against the slot's budget."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from earl.runtime import Actor, Runtime, endpoint
from earl.runtime.cgroups import pid_alive
from earl.runtime.slots import SlotPool

KEY = f"{__name__}:Probe"


class Probe(Actor):
    preload = ("tests.integration.warm_ballast",)

    @endpoint
    async def probe(self) -> dict[str, object]:
        return {"pid": os.getpid(), "env": os.environ.get("EARL_TEST_WARM", ""),
                "omp": os.environ.get("OMP_NUM_THREADS", ""),
                "preloaded": "tests.integration.warm_ballast" in sys.modules,
                "cgroups": Path("/proc/self/cgroup").read_text()}


async def _warm_pids(rt: Runtime, n: int) -> list[int]:
    launcher = rt._launcher
    assert launcher is not None
    for _ in range(100):  # the hosts are started at once; nothing to wait for but the fork
        pids: list[int] = launcher.warm(KEY)  # type: ignore[attr-defined]
        if len(pids) == n:
            return pids
        await asyncio.sleep(0.05)
    raise AssertionError(f"expected {n} warm hosts")


@pytest.mark.timeout(90)
async def test_a_spawn_takes_a_warm_host_and_the_pool_refills() -> None:
    async with Runtime() as rt:
        cold = await rt.spawn("cold", Probe, env={"EARL_TEST_WARM": "cold"})
        got = await cold.probe.call_one()
        assert not got["preloaded"] and got["env"] == "cold"  # nothing imported ahead

        assert rt.keep_warm(Probe, 1)
        (warm_pid,) = await _warm_pids(rt, 1)
        warm = await rt.spawn("warm", Probe, env={"EARL_TEST_WARM": "yes"})
        got = await warm.probe.call_one()
        assert got["pid"] == warm_pid and got["preloaded"] and got["env"] == "yes"
        (refill,) = await _warm_pids(rt, 1)
        assert refill != warm_pid

        rt.keep_warm(Probe, 0)
        assert await _warm_pids(rt, 0) == []
        for _ in range(100):
            if not pid_alive(refill):
                break
            await asyncio.sleep(0.05)
        assert not pid_alive(refill)
        rt.keep_warm(Probe, 1)
        (last,) = await _warm_pids(rt, 1)
    assert not pid_alive(last)  # the runtime's close ends its warm hosts


@pytest.mark.timeout(90)
async def test_a_warm_host_moves_into_its_slot_with_the_memory_it_imported() -> None:
    pool = SlotPool()
    if pool.memory_enforcement != "cgroup":
        pool.close()
        pytest.skip("cgroup v1 memory not writable here")
    with pool:
        slot = pool.create("warmslot", cores=(0,), memory_mib=400)
        async with Runtime() as rt:
            rt.keep_warm(Probe, 1)
            await _warm_pids(rt, 1)
            await asyncio.sleep(3)  # the ballast (64 MiB) is imported by now
            g = await rt.spawn("inslot", Probe, slot=pool.assign("warmslot", "inslot"))
            got = await g.probe.call_one()
            assert got["preloaded"] and "earl" in str(got["cgroups"])
            assert got["omp"] == "1"  # the slot's environment, applied on arrival
            # the imports' pages stay charged where they were made (the kernel moves no
            # charges): the slot's limit is lowered by them, so the actor holds 400 MiB in all
            limit = int(Path(slot.memory_cgroup, "memory.limit_in_bytes").read_text())
            assert limit <= (400 - 64) << 20
            await rt.stop(g)
            pool.release("warmslot")
            rt.keep_warm(Probe, 0)
            cold = await rt.spawn("cold", Probe, slot=pool.assign("warmslot", "cold"))
            assert not (await cold.probe.call_one())["preloaded"]
            limit = int(Path(slot.memory_cgroup, "memory.limit_in_bytes").read_text())
            assert limit == 400 << 20  # a cold start gets the whole budget back
