"""Agent loops against the real engine: vLLM on the tiny model, token-exact across turns."""

from __future__ import annotations

import os

import pytest
from recording import Recorder

from earl.agents.chat import ChatCodec
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tictactoe import tictactoe_agent
from earl.engine import SamplingParams
from earl.models.tiny import default_model_dir

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


async def test_tictactoe_on_vllm_is_token_exact() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    path = default_model_dir()
    codec = ChatCodec(AutoTokenizer.from_pretrained(path))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=24, temperature=1.0),
                        max_total_tokens=400)
    async with VLLMEngine(EngineConfig(model=str(path), max_model_len=512)) as eng:
        rec = Recorder(eng)
        trajs = [await run_agent(tictactoe_agent, seed, engine=rec, codec=codec, config=cfg,
                                 sample_id=f"g{seed}") for seed in range(4)]
    for t in trajs:
        assert not t.failed, t.error
        assert t.info["outcome"] in ("win", "draw", "loss")
        calls = rec.calls[t.sample_id]
        assert len(calls) == len(t.turn_spans)
        for (prompt, gen), (start, end) in zip(calls, t.turn_spans, strict=True):
            assert prompt == t.token_ids[:start]  # each prompt is exactly the record so far
            assert gen.token_ids == t.token_ids[start:end]
            assert gen.logprobs == t.logprobs[start:end] and all(lp <= 0 for lp in gen.logprobs)
            assert t.loss_mask[start:end] == [1] * (end - start)
        assert sum(t.loss_mask) == sum(e - s for s, e in t.turn_spans)
        assert codec.decode(calls[0][0]).rstrip("\n").endswith("<|im_start|>assistant")
