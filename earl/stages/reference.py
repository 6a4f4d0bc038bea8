"""Reference stage: a frozen copy of the initial policy (transformers, torch) that gives the
per-token log-probs of finished samples, for the KL term.

`ReferenceModel` is the plain class (usable in any process); `ReferenceActor` serves it. Samples
are token-id arrays; the result for a sample of length L is a float32 array of length L whose
entry i is log p_ref(token_i | tokens_<i) (entry 0, which has no context, is 0.0), aligned with
the dock's "input_ids" column so it can be stored as "ref_logprobs". Work is cut into
micro-batches of at most `token_budget` padded tokens, longest samples first.

`ReferenceActor.score_dock` runs the reference stage on the transfer dock: samples in, the
"ref_logprobs" column out (kept on the reference actor's own warehouse shard).

This module never updates weights and knows nothing about rewards or the loss.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from earl.algorithms.loss_config import LossConfig
from earl.runtime import Actor, context, endpoint
from earl.runtime.dock import Dock, WarehouseHost
from earl.runtime.selector.profile import peak_bytes, reset_peak
from earl.runtime.wire import message
from earl.stages.compute import Compute

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ReferenceActor", "ReferenceConfig", "ReferenceModel", "microbatches"]


for _cls in (Compute, LossConfig):  # they travel inside a ReferenceConfig
    message(_cls)


@message
@dataclass(kw_only=True, slots=True)
class ReferenceConfig:
    """Args:
    model: HF folder of the initial policy.
    compute: device ("cuda": the first GPU this process sees, its slot's), dtype ("auto"
        resolved here) and torch threads (`earl.stages.compute.Compute`).
    token_budget: most padded tokens per forward pass (bounds the B x T x vocab logits).
    loss: the objective these log-probs feed; they are of softmax(logits / loss.temperature),
        as the policy samples.
    """

    model: str
    compute: Compute = field(default_factory=Compute)
    token_budget: int = 4096
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        self.compute = Compute.coerce(self.compute)
        if isinstance(self.loss, dict):
            self.loss = LossConfig(**self.loss)
        if self.token_budget < 1:
            raise ValueError(f"ReferenceConfig.token_budget must be >= 1, got {self.token_budget}")


def microbatches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that len(group) * max length in group <= token_budget (a sample
    longer than the budget is alone), longest first, so padding stays small."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= token_budget:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class ReferenceModel:
    """The frozen model and its batched scorer."""

    def __init__(self, config: ReferenceConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        c = config.compute
        torch.set_num_threads(c.threads)
        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model, dtype=getattr(torch, c.dtype)).eval()
        self.model.to(c.device)  # type: ignore[arg-type]
        self.model.requires_grad_(False)
        self.tokens_scored = 0

    def logprobs(self, samples: Sequence[Sequence[int] | np.ndarray],
                 masks: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Per-token reference log-probs of each sample (see module docstring).

        With `masks` (one per sample, e.g. the "loss_mask" column), only tokens whose mask is
        > 0 are scored and the rest are 0: the KL term reads nothing else, and the LM head then
        runs on those positions alone (most tokens of an RL sample are prompt).
        """
        import torch

        seqs = [np.asarray(s, dtype=np.int64).reshape(-1) for s in samples]
        if any(len(s) == 0 for s in seqs):
            raise ValueError("ReferenceModel.logprobs: empty sample; every sample needs >= 1 token")
        if masks is not None and [len(m) for m in masks] != [len(s) for s in seqs]:
            raise ValueError("ReferenceModel.logprobs: each mask needs its sample's length")
        out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(seqs)
        for group in microbatches([len(s) for s in seqs], self.config.token_budget):
            width = len(seqs[group[0]])
            ids = torch.zeros((len(group), width), dtype=torch.long)
            mask = torch.zeros((len(group), width), dtype=torch.long)
            for row, i in enumerate(group):
                ids[row, : len(seqs[i])] = torch.from_numpy(seqs[i])
                mask[row, : len(seqs[i])] = 1
            with torch.inference_mode():
                want = mask > 0  # the tokens to score: all, or the masked ones
                if masks is not None:
                    for row, i in enumerate(group):
                        want[row, : len(seqs[i])] = torch.from_numpy(np.asarray(masks[i]) > 0)
                rows, cols = torch.nonzero(want[:, 1:], as_tuple=True)
                dev = self.config.compute.device  # inputs go over; log-probs come back to the host
                lp = self._score(ids.to(dev), mask.to(dev), rows.to(dev),
                                 (cols + 1).to(dev)).cpu().numpy()
            rows_np, cols_np = rows.numpy(), cols.numpy() + 1
            for row, i in enumerate(group):
                res = np.zeros(len(seqs[i]), np.float32)
                sel = rows_np == row
                res[cols_np[sel]] = lp[sel]
                out[i] = res
            self.tokens_scored += int(mask.sum())
        return out

    def _score(self, ids: Tensor, mask: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
        """log p(ids[rows, cols] | ids[rows, :cols]); the LM head runs on those rows only."""
        hidden = self.model.get_decoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = self.model.get_output_embeddings()(hidden[rows, cols - 1]).float()
        temperature = self.config.loss.temperature
        if temperature != 1.0:
            logits = logits / temperature
        return logits.gather(-1, ids[rows, cols][:, None])[:, 0] - logits.logsumexp(-1)


class ReferenceActor(WarehouseHost, Actor):
    """Serves a `ReferenceModel` (config as a ReferenceConfig or its dict of fields).

    It is also a dock warehouse shard: `score_dock` leases samples' "input_ids" for the
    "reference" stage, scores them, and adds their "ref_logprobs" column in this process.
    """

    preload = ("torch", "transformers")

    def __init__(self, config: ReferenceConfig, index: str = "dock") -> None:
        if not isinstance(config, ReferenceConfig):
            raise TypeError(f"ReferenceActor config must be a ReferenceConfig, got "
                            f"{type(config).__name__}")
        self.ref = ReferenceModel(config)
        self.index_name = index
        self._dock: Dock | None = None
        self._lock = asyncio.Lock()
        self._serving = False
        self._idle = asyncio.Event()  # no serve_dock loop running
        self._idle.set()
        self.busy_s = 0.0  # seconds spent scoring

    @endpoint
    async def score_dock(self, n: int = 32, stage: str = "reference",
                         timeout_s: float | None = None, trained_only: bool = False,
                         at_least: int | None = None) -> int:
        """One lease of `n` samples (or `at_least` to `n`: what is ready): take -> fetch ->
        score -> add "ref_logprobs" -> ack.

        `trained_only`: lease "loss_mask" too and score only the trained tokens (others 0).
        Returns the number of samples scored. Raises TimeoutError when none is ready in time.
        """
        if self._dock is None:
            self._dock = Dock(await context().lookup(self.index_name), warehouse=self.warehouse)
        dock = self._dock
        columns = ["input_ids", "loss_mask"] if trained_only else ["input_ids"]
        lease = await dock.take(stage, columns, n, whole_groups=False, timeout_s=timeout_s,
                                at_least=at_least)
        batch, frames = await dock.fetch(lease)
        try:
            ids = [batch[loc.sample_id]["input_ids"] for loc in lease.samples]
            masks = [batch[loc.sample_id]["loss_mask"] for loc in lease.samples] \
                if trained_only else None
            async with self._lock:
                t0 = time.perf_counter()
                scores = await asyncio.to_thread(self.ref.logprobs, ids, masks)
                self.busy_s += time.perf_counter() - t0
        finally:
            for f in frames:
                f.release()
        for loc, lp in zip(lease.samples, scores, strict=True):
            await dock.add_columns(loc.sample_id, {"ref_logprobs": lp}, group_id=loc.group_id,
                                   stage=stage)
        await dock.ack(lease)
        return len(scores)

    @endpoint
    async def serve_dock(self, max_samples: int = 256, stage: str = "reference",
                         trained_only: bool = False) -> int:
        """Score the dock continuously: lease whatever is ready (1 to `max_samples`), score,
        add "ref_logprobs", ack, repeat, until `stop_serving`. Returns the samples scored.

        The trainer's lease names "ref_logprobs", so it waits for this column: a batch is
        never trained before the reference has scored it.
        """
        self._serving = True
        self._idle.clear()
        scored = 0
        try:
            while self._serving:
                try:
                    scored += await self.score_dock(max_samples, stage, timeout_s=0.5,
                                                    trained_only=trained_only, at_least=1)
                except TimeoutError:
                    continue
        finally:
            self._idle.set()
        return scored

    @endpoint
    async def stop_serving(self) -> None:
        """End `serve_dock` after the lease in progress; returns once it has ended (no lease
        of this rank is in flight then)."""
        self._serving = False
        await self._idle.wait()

    @endpoint
    async def logprobs(self, samples: list[np.ndarray]) -> list[np.ndarray]:
        """Reference log-probs of each sample (runs in a worker thread, one call at a time)."""
        async with self._lock:
            return await asyncio.to_thread(self.ref.logprobs, samples)

    @endpoint
    async def config(self) -> dict[str, object]:
        return asdict(self.ref.config)

    @endpoint
    async def index(self) -> str:
        """The name of the dock index this rank scores for."""
        return self.index_name

    @endpoint
    async def tokens_scored(self) -> int:
        return self.ref.tokens_scored

    @endpoint
    async def busy_seconds(self) -> float:
        """Seconds spent in forward passes so far (the reference stage's share of a step)."""
        return self.busy_s

    @endpoint
    async def memory_peak_mib(self) -> float:
        """This rank's memory peak (MiB) since the last call, then a new one starts: the
        resident set on CPU (the model, the forward passes and the dock columns it holds),
        the CUDA allocator's peak on a GPU (the selector's measured reference memory)."""
        peak = peak_bytes(self.ref.config.compute.device) / 2**20
        reset_peak(self.ref.config.compute.device)
        return peak

    @endpoint
    async def fetched_bytes(self) -> dict[str, int]:
        """Bytes fetched from the dock so far, per transport kind (see `Dock.fetched_bytes`)."""
        return {} if self._dock is None else self._dock.fetched_bytes()
