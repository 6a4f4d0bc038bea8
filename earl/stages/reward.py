"""Reward stage: rule-based reward functions (the environments') and a small learned reward
model (a sequence classifier), served by `RewardActor`.

Rule rewards are module-level functions named by reference ("earl.envs.arithmetic:score"),
imported in the actor and applied to keyword-argument records, so any env's scorer can run
out of the agent's process. The reward model scores token-id sequences with one scalar each
(the classifier head at the last token), micro-batched by token budget like the reference.
`build_tiny_reward_model` makes an offline Qwen2 classifier that shares the tiny model's
tokenizer, for tests and demos.

The same reward model runs as a tool action on the shared executor through
`earl.models.reward_model.score_text`. This module does not turn rewards into advantages
(`earl.algorithms`), and `earl train` does not start it: a run's rewards come from the agent or
a `--reward` rule, both in the producers. `RewardActor.rule` is the endpoint that takes a code
reference over a socket, which `earl.runtime.registry` guards (tests/integration/
test_actor_security.py).
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from earl.runtime import Actor, endpoint, registry
from earl.stages.reference import microbatches

__all__ = ["RewardActor", "RewardModel", "RewardModelConfig", "build_tiny_reward_model",
           "load_rule"]


def load_rule(ref: str) -> Callable[..., float]:
    """Import "package.module:function".

    Raises:
        ValueError: `ref` is not of that form or names nothing callable.
    """
    module, _, name = ref.partition(":")
    if not module or not name:
        raise ValueError(f"reward rule {ref!r}: write it as 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"reward rule {ref!r} not found: {exc}") from None
    if not callable(fn):
        raise TypeError(f"reward rule {ref!r} is not callable")
    return fn  # type: ignore[no-any-return]


def build_tiny_reward_model(out_dir: str | os.PathLike[str], *, seed: int = 0,
                            **tiny_kwargs: float) -> Path:
    """Write a Qwen2 sequence classifier (1 label) with the tiny model's shape and tokenizer.

    Same seed -> same weights; the backbone equals `build_tiny_model(seed=seed)`'s.
    """
    import torch
    from transformers import AutoConfig, Qwen2ForSequenceClassification

    from earl.models.tiny import build_tiny_model

    out = build_tiny_model(out_dir, seed=seed, **tiny_kwargs)  # type: ignore[arg-type]
    cfg = AutoConfig.from_pretrained(out)
    cfg.num_labels = 1
    cfg.architectures = ["Qwen2ForSequenceClassification"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = Qwen2ForSequenceClassification.from_pretrained(out, config=cfg)
        torch.nn.init.normal_(model.score.weight, std=1.0 / cfg.hidden_size**0.5)
    model.save_pretrained(out)
    return out


@dataclass(kw_only=True, slots=True)
class RewardModelConfig:
    """Args: model (HF sequence-classifier folder), token_budget, threads."""

    model: str
    token_budget: int = 4096
    threads: int = 1

    def __post_init__(self) -> None:
        if self.token_budget < 1:
            raise ValueError(f"RewardModelConfig.token_budget must be >= 1, got {self.token_budget}")


class RewardModel:
    """Scores token-id sequences with a frozen sequence classifier."""

    def __init__(self, config: RewardModelConfig) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification

        torch.set_num_threads(config.threads)
        self.config = config
        self.model = AutoModelForSequenceClassification.from_pretrained(config.model).eval()
        self.model.requires_grad_(False)

    def score(self, samples: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """One float32 score per sample: the head applied at the sample's last token."""
        import torch

        seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in samples]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("RewardModel.score: empty sample; every sample needs >= 1 token")
        out = np.zeros(len(seqs), np.float32)
        base = self.model.base_model
        for group in microbatches([len(s) for s in seqs], self.config.token_budget):
            width = len(seqs[group[0]])
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(group):
                ids[row, : len(seqs[i])] = torch.from_numpy(seqs[i])
                mask[row, : len(seqs[i])] = 1
            last = torch.tensor([len(seqs[i]) - 1 for i in group])
            with torch.inference_mode():
                hidden = base(input_ids=ids, attention_mask=mask).last_hidden_state
                vals = self.model.score(hidden[torch.arange(len(group)), last])[:, 0]
            out[group] = vals.float().numpy()
        return out


class RewardActor(Actor):
    """Rule rewards and (optionally) a reward model, as a service.

    Args:
        reward_model: a RewardModelConfig (or its dict of fields), or None for rules only.
    """

    def __init__(self, reward_model: RewardModelConfig | dict[str, object] | None = None) -> None:
        if isinstance(reward_model, dict):
            reward_model = RewardModelConfig(**reward_model)  # type: ignore[arg-type]
        self.rm = RewardModel(reward_model) if reward_model is not None else None
        self._rules: dict[str, Callable[..., float]] = {}
        self._lock = asyncio.Lock()

    @endpoint
    async def rule(self, ref: str, records: list[dict[str, object]]) -> list[float]:
        """`[float(fn(**r)) for r in records]` for the rule function `ref`, which the driver
        must have registered (`earl.runtime.registry.register`) before spawning this actor."""
        fn = self._rules.get(ref) or self._rules.setdefault(
            ref, registry.resolve(ref, what="reward rule"))
        return [float(fn(**r)) for r in records]

    @endpoint
    async def score(self, samples: list[np.ndarray]) -> np.ndarray:
        """Reward-model score of each token-id sample."""
        if self.rm is None:
            raise ValueError("RewardActor.score: started without a reward_model config")
        async with self._lock:
            return await asyncio.to_thread(self.rm.score, samples)
