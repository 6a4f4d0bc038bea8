"""Rule rewards by reference, and the tiny sequence-classifier reward model."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from earl.stages.reward import (
    RewardModel,
    RewardModelConfig,
    build_tiny_reward_model,
    load_rule,
)


def test_load_rule_imports_env_scorers_and_rejects_bad_refs() -> None:
    score = load_rule("earl.envs.arithmetic:score")
    assert score(text="so the answer is 42", answer=42) == 1.0
    assert score(text="41", answer=42) == 0.0
    with pytest.raises(ValueError, match="package.module:function"):
        load_rule("earl.envs.arithmetic.score")
    with pytest.raises(ValueError, match="not found"):
        load_rule("earl.envs.arithmetic:nope")


def test_reward_model_is_deterministic_and_batch_invariant(tmp_path: Path) -> None:
    import torch

    path = build_tiny_reward_model(tmp_path / "rm", seed=3, layers=2)
    again = build_tiny_reward_model(tmp_path / "rm2", seed=3, layers=2)
    rm = RewardModel(RewardModelConfig(model=str(path), token_budget=48))
    rng = np.random.default_rng(0)
    samples = [rng.integers(7, 200, size=n) for n in (5, 30, 12, 1)]
    scores = rm.score(samples)
    assert scores.shape == (4,) and scores.dtype == np.float32
    assert len(set(np.round(scores, 5))) == 4  # distinct inputs, distinct scores
    single = np.array([rm.score([s])[0] for s in samples])
    np.testing.assert_allclose(scores, single, atol=1e-5)
    other = RewardModel(RewardModelConfig(model=str(again)))
    np.testing.assert_allclose(other.score(samples), scores, atol=1e-6)
    with torch.no_grad():  # the head at the last token, as transformers' own pooling does
        want = rm.model(torch.from_numpy(samples[1])[None]).logits[0, 0]
    assert abs(float(want) - scores[1]) < 1e-4
