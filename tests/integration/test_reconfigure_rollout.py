"""Re-creating the rollout at a new tensor-parallel degree: the trainer pushes its weights into
the new replicas at the current policy version (`earl.stages.reconfigure.reconfigure_rollout`),
and the new group is restarted after a death under the restart policy it was given."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import pytest

from earl.engine import SamplingParams
from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio, pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPT = [1, 50, 51, 52]
ENV = {"OMP_NUM_THREADS": "1"}


async def _spawn(rt: Any, max_model_len: int, kv_cache_gb: float,
                 restart: Any = None) -> tuple[Any, Any]:
    """One rollout replica serving a model and a trainer holding another (its weights differ,
    so a push shows in the replica's greedy output)."""
    from earl.stages.rollout import RolloutActor
    from earl.stages.trainer import TrainerActor, TrainerConfig
    from earl.stages.vllm_engine import EngineConfig

    served, trained = default_model_dir(init_std=0.2, seed=0), default_model_dir(init_std=0.2,
                                                                                 seed=1)
    return await asyncio.gather(
        rt.spawn("rollout", RolloutActor,
                 EngineConfig(model=str(served), compute=Compute(dtype="float32"),
                              max_model_len=max_model_len, kv_cache_gb=kv_cache_gb),
                 n=1, env=ENV, restart=restart),
        rt.spawn("trainer", TrainerActor,
                 TrainerConfig(model=str(trained), compute=Compute(threads=1)),
                 env=ENV))


async def test_rollout_goes_tp1_to_tp2_with_the_trainers_weights() -> None:
    from earl.runtime import RestartPolicy, Runtime
    from earl.stages.reconfigure import reconfigure_rollout

    served = default_model_dir(init_std=0.2, seed=0)
    async with Runtime() as rt:
        rollout, trainer = await _spawn(rt, 256, 0.125)
        before = await rollout[0].generate.call_one(PROMPT, GREEDY)
        await trainer.push_weights.call(rollout, 5)
        tp1 = await rollout[0].generate.call_one(PROMPT, GREEDY)
        assert tp1.token_ids != before.token_ids and set(tp1.versions) == {5}

        rollout, times = await reconfigure_rollout(rt, rollout, tensor_parallel_size=2,
                                                   trainer=trainer, version=5, env=ENV,
                                                   restart=RestartPolicy(max_restarts=1))
        cfg = await rollout[0].engine_config.call_one()
        assert cfg.tensor_parallel_size == 2 and cfg.model == str(served)
        tp2 = await rollout[0].generate.call_one(PROMPT, GREEDY)
        assert tp2.token_ids == tp1.token_ids and set(tp2.versions) == {5}
        assert min(times.stop_s, times.spawn_s, times.push_s) > 0 and times.save_s == 0
        pid = (await rt.dir_call("lookup", "rollout")).pids[0]
        os.kill(pid, signal.SIGKILL)
        await rt.wait_status(rollout[0], "up", min_restarts=1, timeout=120)
        assert (await rt.dir_call("lookup", "rollout")).pids[0] != pid
        await trainer.close.call()


async def test_rollout_rebuilds_its_engine_in_its_warm_process() -> None:
    """A longer window for the same replica: the engine is rebuilt inside the live process (no
    new process), serves the trainer's weights at the version, and a restart after a death
    brings back the new window, not the spawn-time one."""
    from earl.runtime import RestartPolicy, Runtime
    from earl.stages.reconfigure import reconfigure_rollout

    async with Runtime() as rt:
        rollout, trainer = await _spawn(rt, 128, 0.0625, RestartPolicy(max_restarts=1))
        await trainer.push_weights.call(rollout, 3)
        before = await rollout[0].generate.call_one(PROMPT, GREEDY)
        pid = (await rt.dir_call("lookup", "rollout")).pids[0]
        rollout, times = await reconfigure_rollout(rt, rollout, tensor_parallel_size=1,
                                                   trainer=trainer, version=3, in_place=True,
                                                   max_model_len=512, kv_cache_gb=0.125)
        assert (await rt.dir_call("lookup", "rollout")).pids[0] == pid  # the same process
        assert times.rebuild_s > 0 and times.spawn_s == times.stop_s == 0
        assert (await rollout[0].engine_config.call_one()).max_model_len == 512
        after = await rollout[0].generate.call_one(PROMPT, GREEDY)
        assert after.token_ids == before.token_ids and set(after.versions) == {3}
        long = await rollout[0].generate.call_one([1] * 300, GREEDY)  # past the old window
        assert long.token_ids
        os.kill(pid, signal.SIGKILL)
        await rt.wait_status(rollout[0], "up", min_restarts=1, timeout=120)
        assert (await rollout[0].engine_config.call_one()).max_model_len == 512
        await trainer.close.call()


async def test_a_replica_count_change_keeps_the_replicas_that_stay() -> None:
    """1 -> 2 replicas in place: the first replica keeps its process and engine, the added one
    starts with the group's config and serves the trainer's weights at the version; 2 -> 1 stops
    only the added one."""
    from earl.runtime import Runtime
    from earl.stages.reconfigure import reconfigure_rollout

    async with Runtime() as rt:
        rollout, trainer = await _spawn(rt, 128, 0.0625)
        await trainer.push_weights.call(rollout, 4)
        first = await rollout[0].generate.call_one(PROMPT, GREEDY)
        pid = (await rt.dir_call("lookup", "rollout")).pids[0]

        rollout, grew = await reconfigure_rollout(rt, rollout, tensor_parallel_size=1,
                                                  replicas=2, trainer=trainer, version=4,
                                                  in_place=True)
        pids = (await rt.dir_call("lookup", "rollout")).pids
        assert len(rollout) == 2 and pids[0] == pid and pids[1] != pid
        assert grew.spawn_s > 0 and grew.stop_s == grew.rebuild_s == 0  # nothing rebuilt
        added = await rollout[1].generate.call_one(PROMPT, GREEDY)
        assert added.token_ids == first.token_ids and set(added.versions) == {4}

        rollout, shrank = await reconfigure_rollout(rt, rollout, tensor_parallel_size=1,
                                                    replicas=1, trainer=trainer, version=4,
                                                    in_place=True)
        assert len(rollout) == 1 and (await rt.dir_call("lookup", "rollout")).pids == [pid]
        assert shrank.stop_s > 0 and shrank.spawn_s == 0
        again = await rollout[0].generate.call_one(PROMPT, GREEDY)
        assert again.token_ids == first.token_ids
        with pytest.raises(ValueError, match="TP 2 needs new processes"):
            await reconfigure_rollout(rt, rollout, tensor_parallel_size=2, in_place=True)
        await trainer.close.call()
