"""VLLMEngine's thread protocol with a fake vLLM core: a dying engine fails every waiter."""

from __future__ import annotations

import asyncio

import pytest

from earl.engine import SamplingParams
from earl.stages.vllm_engine import EngineConfig, VLLMEngine


class _FakeCore:
    def __init__(self) -> None:
        self.pending: list[str] = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.pending)

    def add_request(self, rid: str, prompt: object, params: object) -> None:
        self.pending.append(rid)

    def abort_request(self, rids: list[str]) -> None:
        self.pending = [r for r in self.pending if r not in rids]

    def step(self) -> list[object]:
        if len(self.pending) >= 2:
            raise MemoryError("fake: KV cache exploded")
        return []


class _FakeEngine(VLLMEngine):
    def _build(self) -> object:
        return _FakeCore()

    def _vllm_params(self, p: SamplingParams) -> object:
        return p


@pytest.mark.timeout(20)
async def test_engine_death_fails_waiters_and_later_calls() -> None:
    died: list[BaseException] = []
    eng = _FakeEngine(EngineConfig(model="unused"), on_death=died.append)
    await eng.start()
    first = asyncio.create_task(eng.generate([1, 2], SamplingParams(max_tokens=4)))
    second = asyncio.create_task(eng.generate([1, 3], SamplingParams(max_tokens=4)))
    for task in (first, second):
        with pytest.raises(RuntimeError, match="engine thread died.*KV cache exploded"):
            await task
    with pytest.raises(RuntimeError, match="engine thread died"):
        await eng.generate([1], SamplingParams(max_tokens=1))
    with pytest.raises(RuntimeError, match="engine thread died"):
        await eng.update_weights(path="/nowhere", mode="inflight")
    assert eng._thread is not None  # on_death runs last in the engine thread: wait for it
    await asyncio.to_thread(eng._thread.join, 10)
    assert len(died) == 1 and isinstance(died[0], MemoryError)
    assert eng.statistics().in_flight == 0
    await eng.close()


@pytest.mark.timeout(20)
async def test_start_reraises_build_errors() -> None:
    class Broken(VLLMEngine):
        def _build(self) -> object:
            raise FileNotFoundError("no such model folder")

    with pytest.raises(FileNotFoundError, match="no such model"):
        await Broken(EngineConfig(model="missing")).start()


async def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        EngineConfig(model="m", max_model_len=1)
    with pytest.raises(ValueError, match="logprobs_mode"):
        EngineConfig(model="m", logprobs_mode="raw_logits")
    eng = _FakeEngine(EngineConfig(model="m"))
    with pytest.raises(ValueError, match="mode must be"):
        await eng.update_weights(path="/x", mode="sometime")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exactly one"):
        await eng.update_weights()
