"""The in-process vLLM engine against transformers on the tiny model (one engine per module)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from earl.engine import ContextLengthError, SamplingParams
from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module")]

# init_std=0.2: peaked logits, so greedy paths are varied and ties (where two correct
# implementations may legitimately differ) are rare.
MODEL_A = {"init_std": 0.2, "seed": 0}
MODEL_B = {"init_std": 0.2, "seed": 1}
PROMPTS = [[1, 50, 51, 52], [1, 80, 9, 44, 44, 2, 17], [1] + list(range(20, 60))]


@pytest.fixture(scope="module")
def paths() -> tuple[Path, Path]:
    return default_model_dir(**MODEL_A), default_model_dir(**MODEL_B)


@pytest.fixture(scope="module")
def hf(paths: tuple[Path, Path]):
    from transformers import AutoModelForCausalLM

    return [AutoModelForCausalLM.from_pretrained(p).eval() for p in paths]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(paths: tuple[Path, Path]) -> AsyncIterator[object]:
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    eng = VLLMEngine(EngineConfig(model=str(paths[0]), compute=Compute(dtype="float32"),
                                  max_model_len=512))
    await eng.start()
    yield eng
    await eng.close()


def hf_logprobs(model: object, prompt: list[int], out: list[int]):
    import torch

    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # type: ignore[operator]
    return logits.log_softmax(-1)


def assert_greedy(model: object, prompt: list[int], out: list[int]) -> None:
    lp = hf_logprobs(model, prompt, out)
    for i, t in enumerate(out):
        best = float(lp[i].max())
        assert float(lp[i, t]) >= best - 1e-4, f"token {i}: {t} is not transformers' argmax"


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


async def test_greedy_matches_transformers(engine, hf) -> None:
    import torch

    gens = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
    for p, g in zip(PROMPTS, gens, strict=True):
        assert len(g.token_ids) == 24 and g.finish_reason == "length" and g.prompt_tokens == len(p)
        assert_greedy(hf[0], p, g.token_ids)
        ref = hf[0].generate(torch.tensor([p]), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert ref == g.token_ids


async def test_sampled_logprobs_match_transformers(engine, hf) -> None:
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)
    g = await engine.generate(PROMPTS[1], params)
    assert len(g.logprobs) == len(g.token_ids) == len(g.versions)
    lp = hf_logprobs(hf[0], PROMPTS[1], g.token_ids)
    ref = [float(lp[i, t]) for i, t in enumerate(g.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref, g.logprobs, strict=True)) < 1e-3
    again = await engine.generate(PROMPTS[1], params)
    assert again.token_ids == g.token_ids  # per-request seed reproduces the sample
    hot = await engine.generate(PROMPTS[1], SamplingParams(max_tokens=40, temperature=2.0, seed=7))
    lp2 = hf_logprobs(hf[0], PROMPTS[1], hot.token_ids)  # processed = at the sampling temperature
    ref2 = [float((lp2[i] * 0.5).log_softmax(-1)[t]) for i, t in enumerate(hot.token_ids)]
    assert max(abs(a - b) for a, b in zip(ref2, hot.logprobs, strict=True)) < 1e-3


async def test_generate_batch_matches_single_requests(engine) -> None:
    single = [await engine.generate(p, GREEDY) for p in PROMPTS]
    batch = await engine.generate_batch(PROMPTS, GREEDY)
    assert [g.token_ids for g in batch] == [g.token_ids for g in single]
    for a, b in zip(batch, single, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4
        assert a.versions == b.versions and a.finish_reason == b.finish_reason


async def test_rollout_and_reference_logprobs_agree(engine, paths) -> None:
    from earl.stages.reference import ReferenceConfig, ReferenceModel

    ref = ReferenceModel(ReferenceConfig(model=str(paths[0]), token_budget=256))
    params = SamplingParams(max_tokens=48, temperature=1.0, seed=3)
    gens = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
    scores = ref.logprobs([p + g.token_ids for p, g in zip(PROMPTS, gens, strict=True)])
    for p, g, lp in zip(PROMPTS, gens, scores, strict=True):
        assert len(lp) == len(p) + len(g.token_ids)
        diff = abs(lp[len(p):] - g.logprobs).max()
        assert diff < 1e-3, f"rollout vs reference log-probs differ by {diff}"


async def test_many_seeded_requests_at_once(engine) -> None:
    # 64 x 41-token prompts overflow one step's token budget: vLLM 0.32 on CPU used to crash on
    # a seeded request whose prefill was split across steps.
    gens = await asyncio.gather(*(engine.generate(PROMPTS[2], SamplingParams(max_tokens=8, seed=i))
                                  for i in range(64)))
    assert all(len(g.token_ids) == 8 for g in gens)
    assert len({tuple(g.token_ids) for g in gens}) > 32  # the seeds differ, so do the samples


async def test_stop_token_is_kept_and_reported(engine) -> None:
    g = await engine.generate(PROMPTS[0], GREEDY)
    stop = g.token_ids[5]
    first = g.token_ids.index(stop)
    s = await engine.generate(PROMPTS[0], SamplingParams(max_tokens=24, temperature=0.0,
                                                         stop_token_ids=[stop]))
    assert s.finish_reason == "stop" and s.token_ids == g.token_ids[: first + 1]


async def test_context_length_error_then_still_serving(engine) -> None:
    with pytest.raises(ContextLengthError, match="max_model_len=512"):
        await engine.generate([1] * 500, SamplingParams(max_tokens=13))
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], GREEDY)
    g = await engine.generate([1] * 500, SamplingParams(max_tokens=12))
    assert len(g.token_ids) <= 12
    assert engine.statistics().context_length_errors >= 1


async def test_cancelled_request_is_aborted(engine) -> None:
    n0 = engine.statistics().generated_tokens
    task = asyncio.create_task(engine.generate(PROMPTS[2], SamplingParams(max_tokens=460,
                                                                          temperature=0.0)))
    while engine.statistics().generated_tokens == n0:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    g = await engine.generate(PROMPTS[0], GREEDY)
    assert len(g.token_ids) == 24
    assert engine.statistics().in_flight == 0


async def test_weight_update_drain_changes_generation_deterministically(engine, paths, hf) -> None:
    from safetensors.torch import load_file

    before = await engine.generate(PROMPTS[0], GREEDY)
    v0 = engine.policy_version
    secs = await engine.update_weights(load_file(paths[1] / "model.safetensors"), mode="drain")
    assert secs >= 0 and engine.policy_version == v0 + 1
    after = await engine.generate(PROMPTS[0], GREEDY)
    assert after.token_ids != before.token_ids and set(after.versions) == {v0 + 1}
    assert_greedy(hf[1], PROMPTS[0], after.token_ids)  # the new weights, tied lm_head included
    await engine.update_weights(path=str(paths[0]), version=v0 + 5, mode="drain")
    back = await engine.generate(PROMPTS[0], GREEDY)
    assert back.token_ids == before.token_ids and set(back.versions) == {v0 + 5}


async def test_inflight_update_tags_tokens_with_new_version(engine, paths, hf) -> None:
    from safetensors.torch import load_file

    new = load_file(paths[1] / "model.safetensors")
    v0 = engine.policy_version
    params = SamplingParams(max_tokens=300, temperature=0.0)
    task = asyncio.create_task(engine.generate(PROMPTS[2], params))
    n0 = engine.statistics().generated_tokens
    while engine.statistics().generated_tokens < n0 + 20:
        await asyncio.sleep(0.001)
    preempted = engine.statistics().preempted_by_updates
    await engine.update_weights(new, mode="inflight")
    assert engine.statistics().preempted_by_updates == preempted + 1
    g = await task
    assert g.versions == sorted(g.versions) and set(g.versions) == {v0, v0 + 1}
    k = g.versions.index(v0 + 1)
    assert 0 < k < len(g.token_ids)
    # After the switch the KV is recomputed: tokens are the new model's greedy continuation.
    assert_greedy(hf[1], PROMPTS[2] + g.token_ids[:k], g.token_ids[k:])
    await engine.update_weights(path=str(paths[0]), mode="drain")


def _scheduler(eng: object) -> object:
    return eng.engine_core.engine_core.scheduler  # type: ignore[attr-defined]


def _hashed_blocks(eng: object) -> set[tuple[int, object]]:
    pools = {m.block_pool for m in
             _scheduler(eng).kv_cache_manager.coordinator.single_type_managers}  # type: ignore[attr-defined]
    return {(b.block_id, b.block_hash) for p in pools for b in p.blocks
            if b.block_hash is not None}


async def test_keep_kv_update_runs_on_without_preemption(engine, paths) -> None:
    from safetensors.torch import load_file

    new = load_file(paths[1] / "model.safetensors")
    prompt = [1] + [20 + i % 60 for i in range(150)]  # a full KV block (128 tokens on CPU)
    await engine.generate(prompt, GREEDY)  # finished: its first block stays cached
    v0 = engine.policy_version
    preempted = engine.statistics().preempted_by_updates
    task = asyncio.create_task(engine.generate(prompt + [7, 8],
                                               SamplingParams(max_tokens=300, temperature=0.0)))
    n0 = engine.statistics().generated_tokens
    while engine.statistics().generated_tokens < n0 + 20:
        await asyncio.sleep(0.001)
    running = await engine._call(lambda eng: list(_scheduler(eng).running))
    assert len(running) == 1
    cached = await engine._call(_hashed_blocks)
    assert cached, "the test needs prefix-cached blocks before the update"
    await engine.update_weights(new, mode="inflight_keep_kv")
    after = await engine._call(lambda eng: (list(_scheduler(eng).running), _hashed_blocks(eng)))
    # the request kept its place and its KV: not preempted, nothing recomputed
    assert after[0] == running and running[0].num_preemptions == 0
    assert running[0].num_computed_tokens >= len(prompt) + 2 + 20
    assert not cached & after[1], "a block hashed before the update can still be hit"
    assert engine.statistics().preempted_by_updates == preempted
    g = await task
    assert running[0].num_preemptions == 0
    assert g.versions == sorted(g.versions) and set(g.versions) == {v0, v0 + 1}
    assert 20 <= g.versions.index(v0 + 1) < len(g.token_ids)
    await engine.update_weights(path=str(paths[0]), mode="drain")
