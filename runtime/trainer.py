"""`TrainerActor`: the policy trainer as an actor group (one actor per data-parallel rank).

A thin wrapper over `TorchTrainer` (``backend="torch"``) or `MegatronTrainer`
(``backend="megatron"``, CUDA only): each endpoint runs the blocking torch work in a thread, one
call at a time, so collectives across ranks stay in order. Call data-parallel endpoints with
``.call(...)`` on the whole group, giving each rank its own shard (``TrainBatch.split``), or the
same arguments when the endpoint takes none per rank. With FSDP, every endpoint that touches
the weights (all but ``version``) is a collective: calling it on one rank only hangs.

Example:
    >>> url = free_dist_url()
    >>> g = await rt.spawn("trainer", TrainerActor, {"model": path, "dist_url": url}, n=2)
    >>> shards = batch.split(2)
    >>> metrics = await asyncio.gather(*(g[r].train_step.call_one(shards[r]) for r in range(2)))
    >>> await g.push_weights.call(rollout_group, version=1)   # every rank (FSDP gathers)

It does not build batches or decide when to sync: the run loop does (`earl.run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from earl.runtime import Actor, ActorGroup, endpoint
from earl.runtime.trainer_batch import TrainBatch
from earl.runtime.trainer_dist import free_dist_url
from earl.runtime.trainer_torch import TorchTrainer, TrainerConfig

__all__ = ["TorchTrainer", "TrainBatch", "TrainerActor", "TrainerConfig", "free_dist_url"]

if TYPE_CHECKING:
    from earl.runtime.dock import Dock

R = TypeVar("R")


class TrainerActor(Actor):
    """One trainer rank.

    Args:
        config: a `TrainerConfig` or its fields as a dict (``loss`` may be a nested dict).
        backend: ``"torch"`` (CPU or CUDA) or ``"megatron"`` (megatron-core, CUDA).
    """

    def __init__(self, config: TrainerConfig | dict[str, object],
                 backend: Literal["torch", "megatron"] = "torch") -> None:
        if isinstance(config, dict):
            config = TrainerConfig(**config)  # type: ignore[arg-type]
        if backend not in ("torch", "megatron"):
            raise ValueError(f"TrainerActor backend must be 'torch' or 'megatron', got {backend!r}")
        self.config = config
        self.backend = backend
        self.trainer: TorchTrainer | None = None
        self._lock = asyncio.Lock()
        self._dock: Dock | None = None  # made on first use

    async def setup(self) -> None:
        def build() -> TorchTrainer:
            if self.backend == "megatron":
                from earl.runtime.trainer_megatron import MegatronTrainer

                return MegatronTrainer(self.config, rank=self.rank,  # type: ignore[return-value]
                                       world_size=self.world_size)
            return TorchTrainer(self.config, rank=self.rank, world_size=self.world_size)

        self.trainer = await asyncio.to_thread(build)

    async def _run(self, fn: Callable[[TorchTrainer], R]) -> R:
        assert self.trainer is not None
        trainer = self.trainer
        async with self._lock:
            return await asyncio.to_thread(fn, trainer)

    @endpoint
    async def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; metrics are global (all ranks)."""
        return await self._run(lambda t: t.train_step(batch))

    @endpoint
    async def train_from_dock(self, n: int, columns: list[str], *, index: str = "dock",
                              stage: str = "train", whole_groups: bool = True,
                              timeout_s: float = 600.0, lr_scale: float = 1.0) -> dict[str, float]:
        """One optimizer step on `n` samples leased from the transfer dock.

        take -> fetch the columns straight from the warehouses holding them (the producer's
        shard, the reference's) -> train -> ack. Samples are ordered by id, so a batch trains
        the same whatever the lease order. A rank that dies before `ack` leaves its lease to
        expire and the samples go back to the pool: none is lost.
        """
        from earl.runtime import context
        from earl.runtime.dock import Dock

        if self._dock is None:
            self._dock = Dock(await context().lookup(index))
        dock = self._dock
        lease = await dock.take(stage, columns, n, whole_groups=whole_groups,
                                timeout_s=timeout_s)
        data, frames = await dock.fetch(lease)
        try:
            batch = TrainBatch.from_samples([data[sid] for sid in sorted(data)])
        finally:
            for f in frames:
                f.release()
        metrics = await self._run(lambda t: t.train_step(batch, lr_scale))
        await dock.ack(lease)
        return metrics

    @endpoint
    async def accumulate(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward into the gradients without stepping (for several mini-batches)."""
        return await self._run(lambda t: t.accumulate(batch))

    @endpoint
    async def optimizer_step(self) -> dict[str, float]:
        return await self._run(lambda t: t.optimizer_step())

    @endpoint
    async def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs ``[T]`` of this rank's shard under the current weights."""
        return await self._run(lambda t: t.compute_logprobs(batch))

    @endpoint
    async def version(self) -> int:
        """Optimizer steps taken (the policy version the trainer holds)."""
        assert self.trainer is not None
        return self.trainer.step

    @endpoint
    async def push_weights(self, rollout: ActorGroup[Any], version: int | None = None,
                           transport: Literal["shm", "rpc"] = "shm",
                           bucket_bytes: int = 64 << 20) -> dict[str, float]:
        """Send the current weights to every replica of ``rollout`` (call on all ranks).

        Rank 0 sends; other ranks only take part in FSDP's gathers. Returns the `WeightSync`
        numbers (seconds, bytes, buckets, load_s, version) on rank 0, ``{}`` elsewhere.
        """
        from earl.runtime.weights import WeightPublisher

        assert self.trainer is not None
        ver = self.trainer.step if version is None else version
        gathers = self.trainer.distributed and self.config.parallel == "fsdp"
        if self.rank != 0 and not gathers:
            return {}
        named = await self._run(lambda t: list(t.named_weights()))
        if self.rank != 0:
            return {}
        publisher = WeightPublisher(rollout, transport=transport, bucket_bytes=bucket_bytes)
        try:
            sync = await publisher.push(named, version=ver)
        finally:
            publisher.close()
        return {k: float(v) for k, v in asdict(sync).items()}

    @endpoint
    async def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """All weights with HF names (small models; big ones go through ``push_weights``)."""
        return await self._run(lambda t: list(t.named_weights()))

    @endpoint
    async def save_hf(self, path: str) -> str:
        return str(await self._run(lambda t: t.save_hf(path)))

    @endpoint
    async def save_checkpoint(self, path: str) -> None:
        await self._run(lambda t: t.save_checkpoint(path))

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint; returns the restored step."""
        await self._run(lambda t: t.load_checkpoint(path))
        assert self.trainer is not None
        return self.trainer.step

    @endpoint
    async def close(self) -> None:
        await self._run(lambda t: t.close())
