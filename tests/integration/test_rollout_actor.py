"""A rollout actor behind RolloutClient; weight pushes over shm/RPC (one replica by default:
the sticky routing over several is covered by tests/unit/test_rollout_client.py and by
EARL_TEST_REPLICAS=2)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import asdict
from pathlib import Path

import pytest
import pytest_asyncio

from earl.engine import ContextLengthError, SamplingParams
from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(300)]

MODEL_A = {"init_std": 0.2, "seed": 0}
MODEL_B = {"init_std": 0.2, "seed": 1}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPT = [1, 50, 51, 52]
REPLICAS = int(os.environ.get("EARL_TEST_REPLICAS", "1"))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt() -> AsyncIterator[object]:
    from earl.runtime import Runtime

    async with Runtime() as runtime:
        yield runtime


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group(rt) -> object:
    from earl.stages.rollout import RolloutActor
    from earl.stages.vllm_engine import EngineConfig

    cfg = EngineConfig(model=str(default_model_dir(**MODEL_A)), compute=Compute(dtype="float32"),
                       max_model_len=256, kv_cache_gb=0.125)
    g = await rt.spawn("rollout", RolloutActor, cfg, n=REPLICAS, env={"OMP_NUM_THREADS": "1"})
    assert await g[0].engine_config.call_one() == cfg  # a typed record both ways
    return g


async def test_generate_through_the_client(group) -> None:
    from earl.stages.rollout import RolloutClient

    client = RolloutClient(group)
    gens = await asyncio.gather(*(client.generate([1, 40 + i], GREEDY, session_id=f"s{i}")
                                  for i in range(6)))
    assert all(len(g.token_ids) == 16 and g.versions == [0] * 16 for g in gens)
    assert {client.replica_of(f"s{i}") for i in range(6)} == set(range(len(group)))
    stats = await group.statistics.call()
    assert sum(s.requests for s in stats) == 6 and all(s.in_flight == 0 for s in stats)


async def test_context_length_error_keeps_its_type(group) -> None:
    from earl.stages.rollout import RolloutClient

    with pytest.raises(ContextLengthError, match="max_model_len=256"):
        await RolloutClient(group).generate([1] * 250, GREEDY, session_id="long")


@pytest.mark.parametrize("transport", ["shm", "gloo", "rpc"])
async def test_publisher_switches_every_replica(group, transport: str) -> None:
    from safetensors.torch import load_file

    from earl.stages.weights import WeightPublisher

    def path(kw: dict[str, float]) -> Path:
        return default_model_dir(**kw) / "model.safetensors"

    async def greedy_all() -> tuple[list[list[int]], list[int]]:
        gens = [await group[r].generate.call_one(PROMPT, GREEDY) for r in range(len(group))]
        return [g.token_ids for g in gens], [g.versions[0] for g in gens]

    a, _ = await greedy_all()
    assert all(x == a[0] for x in a)
    pub = WeightPublisher(group, transport=transport, bucket_bytes=256 << 10)
    sync = await pub.push(load_file(path(MODEL_B)), version=7, mode="drain")
    assert sync.buckets > 1 and sync.version == 7 and sync.nbytes > 0
    b, versions = await greedy_all()
    assert all(x == b[0] != a[0] for x in b) and set(versions) == {7}
    assert set(await group.policy_version.call()) == {7}
    sync = await pub.push(load_file(path(MODEL_A)), version=8)
    c, versions = await greedy_all()
    assert c == a and set(versions) == {8}
    pub.close()


async def test_a_new_publisher_pairs_anew_over_gloo(group) -> None:
    """A restarted trainer makes a new publisher: each replica drops the old gloo pair and
    keys a new one with the new publisher's secret; the pair's key is checked on every frame."""
    from safetensors.torch import load_file

    from earl.stages.weights import WeightPublisher

    weights = load_file(default_model_dir(**MODEL_A) / "model.safetensors")
    for version in (20, 21):
        pub = WeightPublisher(group, transport="gloo", bucket_bytes=1 << 20)
        sync = await pub.push(weights, version=version)
        assert sync.by_transport == {"gloo": sync.nbytes * len(group)}
        pub.close()
    assert set(await group.policy_version.call()) == {21}


async def test_reference_actor_scores_what_the_rollout_sampled(rt, group) -> None:
    import numpy as np

    from earl.runtime.dock import Dock, IndexActor, WarehouseActor
    from earl.stages.reference import ReferenceActor, ReferenceConfig

    ix = await rt.spawn("dock", IndexActor, stages=["reference", "train"], capacity=16)
    store = await rt.spawn("store", WarehouseActor, "dock")
    ref = await rt.spawn("reference", ReferenceActor,
                         ReferenceConfig(model=str(default_model_dir(**MODEL_A))), "dock",
                         env={"OMP_NUM_THREADS": "1"})
    gens = [await group[0].generate.call_one([1, 60 + i], SamplingParams(max_tokens=20, seed=i))
            for i in range(3)]
    samples = [np.array([1, 60 + i] + g.token_ids) for i, g in enumerate(gens)]
    scores = await ref[0].logprobs.call_one(samples)  # direct RPC path
    for g, lp in zip(gens, scores, strict=True):
        assert abs(lp[2:] - np.array(g.logprobs)).max() < 1e-3
    for i, (s, g) in enumerate(zip(samples, gens, strict=True)):  # the dock path
        cols = {"input_ids": s.astype(np.int64),
                "versions": np.array([-1, -1] + g.versions, np.int32)}
        await store.put.call_one(f"s{i}", cols, f"g{i}", 1)
    assert await ref[0].score_dock.call_one(3, timeout_s=30) == 3
    dock = Dock(ix)
    lease = await dock.take("train", ["input_ids", "ref_logprobs"], 3, timeout_s=10)
    batch, frames = await dock.fetch(lease)
    for i, g in enumerate(gens):
        lp = batch[f"s{i}"]["ref_logprobs"]
        assert lp.dtype == np.float32 and len(lp) == len(samples[i])
        assert abs(lp[2:] - np.array(g.logprobs)).max() < 1e-3
    for f in frames:
        f.release()
    await dock.ack(lease)
    dock.close()
    assert await ref[0].tokens_scored.call_one() == 2 * sum(len(s) for s in samples)
    for g in (ref, store, ix):
        await rt.stop(g)


async def test_reward_actor_serves_rules_and_the_reward_model(rt, tmp_path) -> None:
    import numpy as np

    from earl.runtime import registry
    from earl.stages.reward import (
        RewardActor,
        RewardModel,
        RewardModelConfig,
        build_tiny_reward_model,
    )

    registry.register("earl.envs.arithmetic:score")  # the rule the actor may be asked to run
    cfg = RewardModelConfig(model=str(build_tiny_reward_model(tmp_path / "rm", layers=1)))
    rw = await rt.spawn("reward", RewardActor, asdict(cfg), env={"OMP_NUM_THREADS": "1"})
    got = await rw[0].rule.call_one("earl.envs.arithmetic:score",
                                    [{"text": "= 12", "answer": 12}, {"text": "7", "answer": 12}])
    assert got == [1.0, 0.0]
    samples = [np.arange(7, 20), np.arange(30, 35)]
    remote = await rw[0].score.call_one(samples)
    np.testing.assert_allclose(remote, RewardModel(cfg).score(samples), atol=1e-5)
    await rt.stop(rw)
