"""The supervised warm start before RL: it writes the run's starting policy, `weights_start`.

With `warm_start.steps` > 0 and transcripts (the recipe's generator, or `warm_start.data`, a
JSONL file), a short-lived `Learner` actor trains the base model on the assistant turns (with
`lora`, adapters merged into the weights it writes); otherwise the base model is copied. The
result is the policy the rollout starts from and the KL anchor of the reference.

The warm start runs before any other actor of the run exists, so its `Learner` takes every core
this process may use (`placement.threads` is each actor's share once rollout and trainer run
side by side).

`warm_start.data`'s lines are `{"messages": [{"role": ..., "content": ...}, ...]}`, with an
optional `"tools": [...]` (function schemas, as in OpenAI's fine-tuning files) rendered into
the first prompt as a rollout's are. Each transcript is tokenized exactly as a rollout would
see it (first prompt, then each assistant turn's text and end token, then continuations), so
the warm start trains the same token format RL samples in. An assistant message's `content` is
the exact text the model should generate, tool calls included (e.g.
`<tool_call>{"name": ...}</tool_call>`). Targets are the assistant tokens (weight 1), in the
`Learner.warm_start` row format (pos, token, weight): `transcript_targets`.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING

import numpy as np

from earl.agents.chat import ChatCodec
from earl.recipe import load_jsonl

if TYPE_CHECKING:
    from earl.loop.job import Job

__all__ = ["transcript_targets", "warm_start", "warm_start_threads"]


def warm_start_threads(per_actor: int) -> int:
    """Torch threads of the warm start's `Learner`: every core this process may use (no other
    actor is alive yet), at least `per_actor`."""
    return max(per_actor, len(os.sched_getaffinity(0)))


async def warm_start(job: Job, base: str) -> None:
    """Write `job.start` from the base model folder `base`."""
    from transformers import AutoTokenizer

    from earl.learner import Learner

    w, cfg, source = job.cfg.warm_start, job.cfg, job.recipe.warm_start
    if w.steps == 0 or (source is None and not w.data):
        if job.start.exists():
            shutil.rmtree(job.start)
        shutil.copytree(base, job.start)
        return
    t0 = time.perf_counter()
    with job.tracer.span("warm_start", actor="trainer", steps=w.steps):
        codec = ChatCodec(AutoTokenizer.from_pretrained(base))
        if w.data:
            ids, tgts = transcript_targets(codec, w.data)
        else:
            assert source is not None
            ids, tgts = await source(codec, max(4 * w.batch_size, 512), cfg.seed)
        # the Learner runs on CPU, also in a CUDA run: placement.dtype "auto" is float32 there
        learner = await job.rt.spawn("warmstart", Learner, base, seed=cfg.seed,
                                     threads=warm_start_threads(cfg.placement.threads),
                                     lora=cfg.lora,
                                     dtype=cfg.placement.compute_dtype("cpu"),
                                     shared_prefix=cfg.placement.shared_prefix, env=job.env)
        losses = await learner[0].warm_start.call_one(ids, tgts, w.steps, w.batch_size, w.lr)
        await learner[0].save_weights.call_one(str(job.start))
        await job.rt.stop(learner)
    job.log(f"warm start: {w.steps} steps on {len(ids)} transcripts, loss "
            f"{losses[0]:.2f} -> {losses[-1]:.2f} ({time.perf_counter() - t0:.0f} s)")


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
