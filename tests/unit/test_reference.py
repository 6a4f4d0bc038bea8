"""Reference log-probs: micro-batching by token budget; padding never changes a sample's scores."""

from __future__ import annotations

import numpy as np
import pytest

from earl.models.tiny import default_model_dir
from earl.stages.reference import ReferenceConfig, ReferenceModel, microbatches


def test_microbatches_respect_the_budget_longest_first() -> None:
    lengths = [5, 30, 12, 30, 1, 70]
    groups = microbatches(lengths, 64)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert groups[0] == [5]  # longer than the budget: alone
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 64
        assert lengths[g[0]] == max(lengths[i] for i in g)


def test_logprobs_match_a_plain_forward_and_ignore_batching() -> None:
    import torch

    ref = ReferenceModel(ReferenceConfig(model=str(default_model_dir(init_std=0.2)),
                                         token_budget=64))
    rng = np.random.default_rng(0)
    samples = [rng.integers(7, 100, size=n) for n in (3, 17, 40, 9, 1)]
    got = ref.logprobs(samples)
    for s, lp in zip(samples, got, strict=True):
        assert lp.shape == s.shape and lp.dtype == np.float32 and lp[0] == 0.0
        with torch.no_grad():
            logits = ref.model(torch.from_numpy(s)[None]).logits[0, :-1]
        want = logits.log_softmax(-1).gather(-1, torch.from_numpy(s[1:])[:, None])[:, 0]
        np.testing.assert_allclose(lp[1:], want.numpy(), atol=1e-4)
    assert all(np.all(lp[1:] < 0) for lp in got)
    with pytest.raises(ValueError, match="empty sample"):
        ref.logprobs([np.zeros(0, np.int64)])


def test_masked_logprobs_score_only_the_trained_tokens() -> None:
    ref = ReferenceModel(ReferenceConfig(model=str(default_model_dir(init_std=0.2)),
                                         token_budget=64))
    rng = np.random.default_rng(1)
    samples = [rng.integers(7, 100, size=n) for n in (12, 30, 5)]
    masks = [(rng.random(len(s)) < 0.5).astype(np.float32) for s in samples]
    masks[0][0] = 1.0  # a sample's first token has no context: stays 0 even when masked
    full = ref.logprobs(samples)
    for m, f, got in zip(masks, full, ref.logprobs(samples, masks), strict=True):
        on = m > 0
        on[0] = False
        np.testing.assert_allclose(got[on], f[on], atol=1e-5)
        assert np.all(got[~on] == 0.0)
    with pytest.raises(ValueError, match="mask"):
        ref.logprobs(samples, masks[:2] + [np.ones(3, np.float32)])
