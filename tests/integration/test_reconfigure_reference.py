"""Moving the reference to other devices mid-run (`reconfigure_reference`): the columns its
old ranks added are scored again by the new ones, the trainer's take gets every sample, and the
dock reports nothing lost."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from earl.models.tiny import default_model_dir
from earl.runtime import Runtime
from earl.runtime.dock import Dock, IndexActor, WarehouseActor
from earl.stages.reconfigure import reconfigure_reference
from earl.stages.reference import ReferenceActor, ReferenceConfig

pytestmark = pytest.mark.timeout(180)


def _columns(ids: np.ndarray) -> dict[str, np.ndarray]:
    return {"input_ids": ids, "versions": np.zeros(len(ids), np.int32)}


async def _serve(group: object) -> asyncio.Task[int]:
    task = asyncio.ensure_future(group.serve_dock.call_one(64, "reference", False))  # type: ignore[attr-defined]
    await asyncio.sleep(0)
    return task


async def test_a_moved_reference_scores_again_what_its_old_ranks_held_and_nothing_is_lost(
) -> None:
    rng = np.random.default_rng(0)
    samples = {f"s{i}": rng.integers(1, 200, size=12 + i).astype(np.int64) for i in range(6)}
    async with Runtime() as rt:
        ix = await rt.spawn("dock", IndexActor, stages=["reference", "train"], capacity=16)
        store = await rt.spawn("store", WarehouseActor, "dock")
        cfg = ReferenceConfig(model=str(default_model_dir(init_std=0.2, seed=0)))
        ref = await rt.spawn("reference", ReferenceActor, cfg, "dock",
                             env={"OMP_NUM_THREADS": "1"})
        dock = Dock(ix)
        serving = await _serve(ref)
        for sid, ids in list(samples.items())[:4]:
            await store.put.call_one(sid, _columns(ids), f"g{sid}", 1)
        first = await dock.take("train", ["input_ids", "ref_logprobs"], 2, timeout_s=30)
        batch, frames = await dock.fetch(first)  # two trained before the move...
        before = {loc.sample_id: batch[loc.sample_id]["ref_logprobs"].copy()
                  for loc in first.samples}
        for f in frames:
            f.release()
        await dock.ack(first)
        for _ in range(100):  # ...two scored and waiting on the old rank's shard
            if (await dock.statistics()).ready.get("ref_logprobs", 0) == 2:
                break
            await asyncio.sleep(0.1)
        assert (await dock.statistics()).ready.get("ref_logprobs") == 2

        new, times = await reconfigure_reference(rt, ref, dock, ranks=2,
                                                 env={"OMP_NUM_THREADS": "1"})
        assert await serving >= 4  # the old loop ended cleanly, after its lease
        assert len(new) == 2 and times.stop_s > 0 and times.spawn_s > 0
        st = await dock.statistics()
        assert st.ready.get("ref_logprobs", 0) == 0 and st.lost == 0  # retracted, not lost
        tasks = [await _serve(new[r]) for r in range(2)]
        for sid, ids in list(samples.items())[4:]:
            await store.put.call_one(sid, _columns(ids), f"g{sid}", 1)
        rest = await dock.take("train", ["input_ids", "ref_logprobs"], 4, timeout_s=60)
        batch, frames = await dock.fetch(rest)
        got = {loc.sample_id: batch[loc.sample_id]["ref_logprobs"].copy() for loc in rest.samples}
        shards = {loc.columns["ref_logprobs"] for loc in rest.samples}
        for f in frames:
            f.release()
        await dock.ack(rest)
        assert set(got) == set(samples) - set(before)  # every sample, each once
        assert shards <= {"reference:0", "reference:1"}
        direct = await new[0].logprobs.call_one([samples[s] for s in sorted(got)])
        for s, lp in zip(sorted(got), direct, strict=True):  # frozen: the same scores again
            # fp32 on other batch shapes (padding) differs in the last bits: 5.7e-6 seen
            np.testing.assert_allclose(got[s], lp, rtol=1e-5, atol=1e-5)
        assert (await dock.statistics()).lost == 0 and not await dock.take_lost()
        # each rank's memory peak (the selector's measured reference memory): a process with
        # torch and the model resident, then a new peak starts from what it holds now
        peaks = await new.memory_peak_mib.call()
        assert all(p > 100 for p in peaks), peaks
        assert all(0 < p2 <= p for p, p2 in zip(peaks, await new.memory_peak_mib.call(),
                                               strict=True))
        await new.stop_serving.call()
        for t in tasks:
            with contextlib.suppress(Exception):
                await t
        dock.close()
