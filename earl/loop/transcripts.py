"""Supervised warm-start data from transcripts: `warm_start.data` = a JSONL file whose lines are
`{"messages": [{"role": ..., "content": ...}, ...]}`, with an optional `"tools": [...]` (function
schemas, as in OpenAI's fine-tuning files) rendered into the first prompt as a rollout's are.

Each transcript is tokenized exactly as a rollout would see it (first prompt, then each
assistant turn's text and end token, then continuations), so the warm start trains the same
token format RL samples in. An assistant message's `content` is the exact text the model
should generate, tool calls included (e.g. `<tool_call>{"name": ...}</tool_call>`). Targets are
the assistant tokens (weight 1), in the `Learner.warm_start` row format (pos, token, weight).
"""

from __future__ import annotations

import numpy as np

from earl.agents.chat import ChatCodec
from earl.recipe import load_jsonl

__all__ = ["transcript_targets"]


def transcript_targets(codec: ChatCodec, path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Token ids and target rows of every transcript in `path`.

    Raises:
        ValueError: a line is not a transcript with at least one assistant message (names
            the file and line).
    """
    ids_out, tgt_out = [], []
    for lineno, sample in enumerate(load_jsonl(path, what="warm_start.data"), 1):
        rec: dict[str, object] = sample if isinstance(sample, dict) else {}
        msgs = rec.get("messages")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) and "role" in m
                                                 for m in msgs):
            raise ValueError(f"warm_start.data: {path} sample {lineno} must be "
                             '{"messages": [{"role": ..., "content": ...}, ...]}')
        first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
        if first is None or first == 0:
            raise ValueError(f"warm_start.data: {path} sample {lineno} needs a user message "
                             "followed by at least one assistant message")
        tools = rec.get("tools")
        if tools is not None and not (isinstance(tools, list)
                                      and all(isinstance(t, dict) for t in tools)):
            raise ValueError(f"warm_start.data: {path} sample {lineno}: \"tools\" must be a "
                             'list of function schemas, e.g. [{"type": "function", '
                             '"function": {"name": ...}}]')
        ids = codec.encode_prompt(msgs[:first], tools=tools)
        rows: list[tuple[int, int, float]] = []
        i = first
        while i < len(msgs):
            text = str(msgs[i].get("content") or "")
            turn = codec.encode_text(text) + [codec.end_id]
            rows += [(len(ids) + k, tok, 1.0) for k, tok in enumerate(turn)]
            ids += turn
            j = i + 1
            while j < len(msgs) and msgs[j]["role"] != "assistant":
                j += 1
            if j < len(msgs):
                ids += codec.encode_continuation(msgs[i + 1:j])
            i = j
        ids_out.append(np.asarray(ids, dtype=np.int64))
        tgt_out.append(np.asarray(rows, dtype=np.float64))
    return ids_out, tgt_out
