"""vLLM parallelism and budgets on CPU: two tensor-parallel worker processes serve the tiny model
with the tokens of one, and an in-place weight push (tensors, through a safetensors file the
workers read) switches both shards; the KV-cache budget is vLLM's own limit, not ours."""

from __future__ import annotations

import pytest

from earl.engine import SamplingParams
from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio, pytest.mark.timeout(300)]

MODEL_A = {"init_std": 0.2, "seed": 0}
MODEL_B = {"init_std": 0.2, "seed": 1}
PROMPTS = [[1, 50, 51, 52], [1, 80, 9, 44, 44, 2, 17], [1] + list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


async def _greedy(tp: int, weights: str | None = None) -> tuple[list[list[int]], list[list[int]]]:
    from safetensors.torch import load_file

    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    a, b = default_model_dir(**MODEL_A), default_model_dir(**MODEL_B)
    cfg = EngineConfig(model=str(a), compute=Compute(dtype="float32"), max_model_len=256,
                       kv_cache_gb=0.125, tensor_parallel_size=tp)
    async with VLLMEngine(cfg) as eng:
        before = [(await eng.generate(p, GREEDY)).token_ids for p in PROMPTS]
        await eng.update_weights(load_file(str(b / "model.safetensors")), version=1,
                                 mode="drain")
        after = [(await eng.generate(p, GREEDY)) for p in PROMPTS]
        assert all(v == 1 for g in after for v in g.versions)
        return before, [g.token_ids for g in after]


@pytest.mark.slow
async def test_tp2_matches_tp1_and_takes_a_weight_push() -> None:
    tp1_a, tp1_b = await _greedy(1)
    tp2_a, tp2_b = await _greedy(2)
    assert tp2_a == tp1_a
    assert tp2_b == tp1_b
    assert tp2_b != tp2_a  # the push changed what the sharded model generates


async def test_kv_cache_budget_bounds_the_context_vllm_will_serve() -> None:
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    # tiny model: 4 layers x (K, V) x 2 KV heads x 32 dims x 4 bytes = 2 KiB per token
    cfg = EngineConfig(model=str(default_model_dir(**MODEL_A)), compute=Compute(dtype="float32"),
                       max_model_len=2048, kv_cache_gb=2**-10)  # 1 MiB: 512 tokens of KV
    with pytest.raises(ValueError, match="estimated maximum model length is 384"):
        await VLLMEngine(cfg).start()
    cfg.max_model_len = 256
    async with VLLMEngine(cfg) as eng:
        gen = await eng.generate(PROMPTS[2], GREEDY)
        assert len(gen.token_ids) == GREEDY.max_tokens
