"""RolloutClient routing: sticky sessions, least-loaded placement, error mapping (fake replicas)."""

from __future__ import annotations

import asyncio

import pytest

from earl.engine import ContextLengthError, Generation, SamplingParams
from earl.runtime import ActorError
from earl.stages.rollout import RolloutClient


class _Endpoint:
    def __init__(self, rank: int, log: list[tuple[int, str | None]]) -> None:
        self.rank, self.log = rank, log

    async def call_one(self, prompt: list[int], params: SamplingParams,
                       session_id: str | None) -> Generation:
        self.log.append((self.rank, session_id))
        if len(prompt) > 100:
            raise ActorError(f"rollout[{self.rank}]", "earl.engine.ContextLengthError", "too long")
        if prompt == [0]:
            raise ActorError(f"rollout[{self.rank}]", "ValueError", "bad token")
        await asyncio.sleep(0.01 * (1 + self.rank))
        return Generation(token_ids=[5], logprobs=[-1.0], versions=[3 + self.rank],
                          finish_reason="length", prompt_tokens=len(prompt))


class _Replica:
    def __init__(self, rank: int, log: list[tuple[int, str | None]]) -> None:
        self.generate = _Endpoint(rank, log)


class _Group:
    def __init__(self, n: int) -> None:
        self.log: list[tuple[int, str | None]] = []
        self.replicas = [_Replica(r, self.log) for r in range(n)]

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, rank: int) -> _Replica:
        return self.replicas[rank]


async def test_sessions_stick_and_new_ones_go_to_the_least_loaded() -> None:
    g = _Group(3)
    client = RolloutClient(g)  # type: ignore[arg-type]
    p = SamplingParams(max_tokens=1)

    async def session(i: int) -> set[int]:
        for _ in range(4):
            await client.generate([1, 2], p, session_id=f"s{i}")
        return {r for r, s in g.log if s == f"s{i}"}

    ranks = await asyncio.gather(*(session(i) for i in range(9)))
    assert all(len(r) == 1 for r in ranks)  # each session stayed on one replica
    per_rank = [sum(1 for r in ranks if r == {k}) for k in range(3)]
    assert per_rank == [3, 3, 3]  # concurrent new sessions spread by calls in flight
    assert client.policy_version == 5
    client.end_session("s0")
    assert client.replica_of("s0") is None and client.replica_of("s1") is not None


async def test_errors_keep_their_meaning() -> None:
    client = RolloutClient(_Group(2))  # type: ignore[arg-type]
    with pytest.raises(ContextLengthError, match="too long"):
        await client.generate([1] * 101, SamplingParams(), session_id="a")
    with pytest.raises(ActorError, match="bad token"):
        await client.generate([0], SamplingParams(), session_id="b")
    assert client._load == [0, 0]  # nothing leaks as "in flight"


async def test_session_memory_is_bounded() -> None:
    client = RolloutClient(_Group(2), max_sessions=2)  # type: ignore[arg-type]
    for s in ("a", "b", "c"):
        await client.generate([1], SamplingParams(), session_id=s)
    assert client.replica_of("a") is None and client.replica_of("c") is not None
