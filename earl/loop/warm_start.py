"""The supervised warm start before RL: it writes the run's starting policy, `weights_start`.

With `warm_start.steps` > 0 and transcripts (the recipe's generator, or `warm_start.data`, a
JSONL file), a short-lived `Learner` actor trains the base model on the assistant turns (with
`lora`, adapters merged into the weights it writes); otherwise the base model is copied. The
result is the policy the rollout starts from and the KL anchor of the reference.
"""

from __future__ import annotations

import shutil
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl.loop.job import Job

__all__ = ["warm_start"]


async def warm_start(job: Job, base: str) -> None:
    """Write `job.start` from the base model folder `base`."""
    from transformers import AutoTokenizer

    from earl.agents.chat import ChatCodec
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
            from earl.loop.transcripts import transcript_targets

            ids, tgts = transcript_targets(codec, w.data)
        else:
            assert source is not None
            ids, tgts = await source(codec, max(4 * w.batch_size, 512), cfg.seed)
        # the Learner runs on CPU, also in a CUDA run: placement.dtype "auto" is float32 there
        learner = await job.rt.spawn("warmstart", Learner, base, seed=cfg.seed,
                                     threads=cfg.placement.threads, lora=cfg.lora,
                                     dtype=cfg.placement.compute_dtype("cpu"),
                                     shared_prefix=cfg.placement.shared_prefix, env=job.env)
        losses = await learner[0].warm_start.call_one(ids, tgts, w.steps, w.batch_size, w.lr)
        await learner[0].save_weights.call_one(str(job.start))
        await job.rt.stop(learner)
    job.log(f"warm start: {w.steps} steps on {len(ids)} transcripts, loss "
            f"{losses[0]:.2f} -> {losses[-1]:.2f} ({time.perf_counter() - t0:.0f} s)")
