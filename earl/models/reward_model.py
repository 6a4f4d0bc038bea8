"""A reward model as a tool function: `score_text(model, text)` for the action-level executor.

The tool executor (`earl.runtime.tools`) runs module-level functions in a shared pool of worker
processes; this module is small to import so workers start fast, and each worker loads a reward
model folder (an HF sequence classifier, e.g. from `earl.stages.reward.build_tiny_reward_model`)
once, on its first call. Batched scoring for the trainer side is `earl.stages.reward`. No
shipped agent or command calls it; an agent would use it as `Tool.from_function(score_text)`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["score_text"]

_LOADED: dict[str, tuple[Any, Any]] = {}


def _load(model: str) -> tuple[Any, Any]:
    if model not in _LOADED:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        torch.set_num_threads(1)
        net = AutoModelForSequenceClassification.from_pretrained(model).eval()
        _LOADED[model] = (AutoTokenizer.from_pretrained(model), net)
    return _LOADED[model]


def score_text(model: str, text: str) -> float:
    """Score a text with a reward model (higher is better).

    Args:
        model: path of the reward model folder (a one-label sequence classifier).
        text: the text to score, e.g. a rendered conversation.
    """
    import torch

    if not text:
        raise ValueError("score_text: text is empty; pass the text to score")
    tok, net = _load(model)
    ids = torch.tensor([tok.encode(text)])
    with torch.inference_mode():
        hidden = net.base_model(input_ids=ids).last_hidden_state
        return float(net.score(hidden[0, -1])[0])
