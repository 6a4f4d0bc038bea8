"""The profiler against a real forward/backward of a tiny Qwen2 (in-process, CPU)."""

from __future__ import annotations

import pytest
import torch

from earl.runtime.selector.cost import CostConfig, CostModel, ModelShape, Parallel
from earl.runtime.selector.policy import Policy, PolicyConfig
from earl.runtime.selector.profile import Profiler


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, ModelShape]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=384, vocab_size=320,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg).float().train()
    shape = ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, vocab=320,
                       params=sum(p.numel() for p in model.parameters()))
    return model, shape


def test_cost_model_predicts_measured_training_memory(tiny: tuple[torch.nn.Module,
                                                                  ModelShape]) -> None:
    model, shape = tiny
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check(model, shape)
    finally:
        torch.set_num_threads(threads)


def _check(model: torch.nn.Module, shape: ModelShape) -> None:

    def train_step(context: int, seqs: int) -> int:
        ids = torch.randint(0, 320, (seqs, context))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return ids.numel()

    # fp32 model, HF eager attention: fp32 softmax kept (4 B/score), fp32 logits + log-softmax
    cost = CostModel(shape, CostConfig(weight_bytes=4, grad_bytes=4, act_bytes=4,
                                       attention="eager", score_bytes=4, logit_bytes=8))
    lines: list[str] = []
    prof = Profiler(cost, (512, 1024), repeats=1, log=lines.append)
    points = [prof.profile("train", Parallel(), b, train_step) for b in (512, 1024)]
    for p in points:  # predicted within 30% of what the OS saw
        assert abs(p.error) < 0.3, p.line()
        assert p.tokens_per_s > 0
    assert points[1].measured_bytes > 2 * points[0].measured_bytes  # quadratic attention seen
    assert len(lines) == 2 and "predicted" in lines[0] and "measured" in lines[0]
    # refreshed only when a bucket is first reached
    assert prof.ensure("train", Parallel(), 700, train_step) is None
    # the policy reads measured throughput for profiled points
    policy = Policy(cost, PolicyConfig(actors={"t": "train"}), measured=prof.table)
    plan = policy.evaluate("t", Parallel(), ("s0",), 1024, 8 * 2**30)
    assert plan is not None and plan.tokens_per_s == points[1].tokens_per_s
    assert prof.table.memory_scale("train") >= 1.0
