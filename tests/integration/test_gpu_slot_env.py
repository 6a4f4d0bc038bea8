"""Real actor processes spawned in a run's GPU slots see exactly their own GPUs (on CPU: the
environment is what is checked; no GPU is touched)."""

from __future__ import annotations

import os

import pytest

from earl.config import PlacementConfig
from earl.loop.devices import gpu_slots
from earl.runtime import Actor, Runtime, endpoint


class Probe(Actor):
    @endpoint
    async def visible(self) -> str:
        return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")


@pytest.mark.timeout(90)
async def test_each_rank_is_spawned_with_its_slots_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")  # the driver's own view
    pl = PlacementConfig(rollout=2, rollout_tp=2, trainer=2)
    with gpu_slots(pl, reference=1, gpus=8) as pool:
        async with Runtime() as rt:
            seen = {}
            for stage, n in (("rollout", 2), ("trainer", 2), ("reference", 1)):
                g = await rt.spawn(stage, Probe, n=n,
                                   slot=[pool.assign(f"{stage}{r}", stage) for r in range(n)])
                seen[stage] = await g.visible.call()
            plain = await rt.spawn("producer", Probe)  # no slot: the driver's environment
            seen["producer"] = await plain.visible.call()
    assert seen == {"rollout": ["7,6", "5,4"], "trainer": ["3", "2"], "reference": ["1"],
                    "producer": ["7,6,5,4,3,2,1,0"]}
