"""Rollout actors (two vLLM replicas) behind the sticky RolloutClient; weight pushes over shm/RPC."""

from __future__ import annotations

import asyncio
from dataclasses import asdict
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from earl.engine import ContextLengthError, SamplingParams
from earl.models.tiny import default_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(300)]

MODEL_A = {"init_std": 0.2, "seed": 0}
MODEL_B = {"init_std": 0.2, "seed": 1}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
PROMPT = [1, 50, 51, 52]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def group() -> AsyncIterator[object]:
    from earl.runtime import Runtime
    from earl.runtime.rollout import RolloutActor
    from earl.runtime.vllm_engine import EngineConfig

    cfg = asdict(EngineConfig(model=str(default_model_dir(**MODEL_A)), dtype="float32",
                              max_model_len=256))
    async with Runtime() as rt:
        g = await rt.spawn("rollout", RolloutActor, cfg, n=2, env={"OMP_NUM_THREADS": "1"})
        yield g


async def test_sessions_stick_to_one_replica_and_spread(group) -> None:  # noqa: ANN001
    from earl.runtime.rollout import RolloutClient

    client = RolloutClient(group)
    before = [s.requests for s in await group.statistics.call()]

    async def session(i: int) -> int:
        ranks = set()
        prompt = [1, 40 + i]
        for _ in range(3):  # three turns, each prompt extends the previous one
            gen = await client.generate(prompt, SamplingParams(max_tokens=4, seed=i),
                                        session_id=f"s{i}")
            ranks.add(client.replica_of(f"s{i}"))
            prompt = prompt + gen.token_ids + [2, 1]
        assert len(ranks) == 1
        return ranks.pop()

    ranks = await asyncio.gather(*(session(i) for i in range(8)))
    assert set(ranks) == {0, 1}
    after = [s.requests for s in await group.statistics.call()]
    served = [a - b for a, b in zip(after, before, strict=True)]
    assert served == [3 * ranks.count(0), 3 * ranks.count(1)]
    client.end_session("s0")
    assert client.replica_of("s0") is None


async def test_context_length_error_keeps_its_type(group) -> None:  # noqa: ANN001
    from earl.runtime.rollout import RolloutClient

    with pytest.raises(ContextLengthError, match="max_model_len=256"):
        await RolloutClient(group).generate([1] * 250, GREEDY, session_id="long")


@pytest.mark.parametrize("transport", ["shm", "rpc"])
async def test_publisher_switches_every_replica(group, transport: str) -> None:  # noqa: ANN001
    from safetensors.torch import load_file

    from earl.runtime.weights import WeightPublisher

    def path(kw: dict[str, float]) -> Path:
        return default_model_dir(**kw) / "model.safetensors"

    async def greedy_all() -> list[list[int]]:
        gens = [await group[r].generate.call_one(PROMPT, GREEDY) for r in range(2)]
        return [g.token_ids for g in gens], [g.versions[0] for g in gens]

    (a0, a1), _ = await greedy_all()
    assert a0 == a1
    pub = WeightPublisher(group, transport=transport, bucket_bytes=256 << 10)
    sync = await pub.push(load_file(path(MODEL_B)), version=7, mode="drain")
    assert sync.buckets > 1 and sync.version == 7 and sync.nbytes > 0
    (b0, b1), versions = await greedy_all()
    assert b0 == b1 != a0 and versions == [7, 7]
    assert await group.policy_version.call() == [7, 7]
    sync = await pub.push(load_file(path(MODEL_A)), version=8)
    (c0, c1), versions = await greedy_all()
    assert c0 == c1 == a0 and versions == [8, 8]
    pub.close()
