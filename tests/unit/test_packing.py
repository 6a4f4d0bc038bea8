"""earl.packing: micro-batch planning, packed layout, packed forward == per-sequence forward."""

from __future__ import annotations

import math

import pytest
import torch

from earl.packing import (
    pack,
    packed_forward,
    plan_micro_batches,
    scored_positions,
    set_attention,
    token_entropy,
    token_logprobs,
)


def test_plan_respects_budget_and_covers_every_sample_once() -> None:
    lengths = [300, 50, 120, 400, 90, 10, 250, 5000]
    plan = plan_micro_batches(lengths, token_budget=512)
    flat = sorted(i for mb in plan for i in mb)
    assert flat == list(range(len(lengths)))
    for mb in plan:
        total = sum(lengths[i] for i in mb)
        assert total <= 512 or mb == [7]  # only the over-long sample may exceed, alone
    assert [7] in plan
    # first-fit decreasing packs 1220 tokens (without the long one) into 3 bins of 512
    assert len(plan) == 4


def test_plan_bad_input() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        plan_micro_batches([1, 2], 0)
    with pytest.raises(ValueError, match="empty"):
        plan_micro_batches([3, 0], 10)


def test_pack_layout() -> None:
    p = pack([torch.tensor([5, 6, 7]), torch.tensor([8]), torch.tensor([9, 10])])
    assert p.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert p.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert p.seq_ids.tolist() == [0, 0, 0, 1, 2, 2]
    assert p.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert p.lengths == [3, 1, 2] and p.max_seqlen == 3


def test_token_logprobs_hand_computed() -> None:
    # vocab 2; logits favour token 1 with log-odds ln 3 -> p(1) = .75
    p = pack([torch.tensor([0, 1, 0]), torch.tensor([1, 1])])
    logits = torch.tensor([[1.0, 3.0]]).log().expand(5, 2).clone()
    lp = token_logprobs(logits, p)
    expect = [0.0, math.log(0.75), math.log(0.25), 0.0, math.log(0.75)]
    torch.testing.assert_close(lp, torch.tensor(expect))


@pytest.fixture
def tiny_qwen2() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).float()


@pytest.mark.parametrize("mode", ["varlen", "mask"])
def test_packed_logprobs_equal_per_sequence(tiny_qwen2: torch.nn.Module, mode: str) -> None:
    model = tiny_qwen2
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 300, (n,), generator=g) for n in (7, 1, 33, 12)]
    model.set_attn_implementation("sdpa")
    expected = []
    for s in seqs:
        single = pack([s])
        expected.append(token_logprobs(model(input_ids=s[None], use_cache=False).logits[0], single))
    set_attention(model, mode)
    packed = pack(seqs)
    got = token_logprobs(packed_forward(model, packed), packed)
    torch.testing.assert_close(got, torch.cat(expected), atol=1e-5, rtol=1e-5)
    # and the gradients agree
    model.zero_grad()
    got.sum().backward()
    g_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model.set_attn_implementation("sdpa")
    sum(
        token_logprobs(model(input_ids=s[None], use_cache=False).logits[0], pack([s])).sum()
        for s in seqs
    ).backward()
    for a, p in zip(g_packed, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_scored_positions_skip_sample_starts_and_keep_a_graph() -> None:
    p = pack([torch.tensor([5, 6, 7]), torch.tensor([8, 9])])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0])  # a (bogus) mask on both sample starts
    assert scored_positions(p, mask).tolist() == [2, 4]
    assert scored_positions(p, torch.zeros(5)).tolist() == [1]  # nothing trained: one row


def test_sparse_lm_head_equals_dense_rows(tiny_qwen2: torch.nn.Module) -> None:
    """Log-probs, entropies and gradients from the LM head on the scored rows only equal the
    dense ones at those tokens; every other token is 0."""
    model = tiny_qwen2
    set_attention(model, "varlen")
    g = torch.Generator().manual_seed(2)
    packed = pack([torch.randint(0, 300, (n,), generator=g) for n in (9, 20, 5)])
    mask = (torch.rand(packed.input_ids.numel(), generator=g) < 0.4).float()
    at = scored_positions(packed, mask)
    dense_logits = packed_forward(model, packed)
    dense = token_logprobs(dense_logits, packed)
    dense_ent = token_entropy(dense_logits, packed)
    (dense * mask).sum().backward()
    g_dense = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    logits = packed_forward(model, packed, keep=at - 1)
    assert logits.shape[0] == len(at)
    sparse = token_logprobs(logits, packed, at)
    torch.testing.assert_close(sparse[at], dense[at].detach(), atol=1e-5, rtol=1e-5)
    off = torch.ones_like(mask, dtype=torch.bool)
    off[at] = False
    assert torch.all(sparse[off] == 0)
    torch.testing.assert_close(token_entropy(logits, packed, at)[at], dense_ent[at].detach(),
                               atol=1e-5, rtol=1e-5)
    (sparse * mask).sum().backward()
    for a, p in zip(g_dense, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, atol=1e-5, rtol=1e-4)


def test_packed_forward_needs_packable_attention(tiny_qwen2: torch.nn.Module) -> None:
    tiny_qwen2.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="set_attention"):
        packed_forward(tiny_qwen2, pack([torch.tensor([1, 2])]))
    with pytest.raises(ValueError, match="varlen"):
        set_attention(tiny_qwen2, "flash")  # type: ignore[arg-type]
