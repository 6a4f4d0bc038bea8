"""`TrainerActor`: the policy trainer as an actor group (one actor per rank of its layout).

A thin wrapper over `TorchTrainer` (``backend="torch"``) or `MegatronTrainer`
(``backend="megatron"``: megatron-core, CPU or CUDA): each endpoint runs the blocking torch work
in a thread, one call at a time, so collectives across ranks stay in order. The group's ranks
form ``Layout(dp=n // (tp * pp), tp=config.tp, pp=config.pp)``. Its data path is the
dispatcher's: the driver leases samples and plans them (`earl.stages.trainer_feed.train_from_dock`),
every rank gets the plan (`train_planned`), each DP replica's leader fetches only its slice
straight from the warehouses and forwards it to its TP and PP peers. With FSDP, TP or PP, every
endpoint that touches the weights (all but ``version``, ``trainer_config``, ``layout``) is a
collective: calling it on one rank only hangs.
Weights go to the rollout through one `WeightPublisher` kept for the trainer's life.

Example:
    >>> cfg = TrainerConfig(model=path, tp=2, dist_url=free_dist_url())
    >>> g = await rt.spawn("trainer", TrainerActor, cfg, n=2)
    >>> metrics = await train_from_dock(g, dock, 64, ["input_ids", "loss_mask", "advantages"])
    >>> await g.push_weights.call(rollout_group, version=1)   # every rank (FSDP/TP gathers)

It does not build batches or decide when to sync: the run loop does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import torch

from earl.algorithms.objective import LossConfig
from earl.runtime import Actor, ActorGroup, endpoint, registry, wire
from earl.runtime.dispatch import DispatchPlan, FetchOp, ReplicaPlan, receive_replica
from earl.runtime.dispatch import forward as forward_frames
from earl.runtime.layout import Layout
from earl.stages.compute import Compute
from earl.stages.id_runs import pack
from earl.stages.lora import LoraConfig
from earl.stages.optim import OptimConfig
from earl.stages.trainer_batch import TrainBatch, bound_staleness
from earl.stages.trainer_dist import free_dist_url
from earl.stages.trainer_offload import Moved
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig
from earl.stages.weights import PushTransport

__all__ = ["TorchTrainer", "TrainBatch", "TrainerActor", "TrainerConfig", "free_dist_url"]

if TYPE_CHECKING:
    from earl.runtime.dock import Dock
    from earl.runtime.transport import Frame, Sender
    from earl.stages.vllm_engine import UpdateMode
    from earl.stages.weights import WeightPublisher

# Typed configs and plans travel to trainer ranks as records (decoded after this import).
for _cls in (TrainerConfig, Compute, LossConfig, OptimConfig, LoraConfig, Layout, FetchOp,
             ReplicaPlan, DispatchPlan):
    wire.message(_cls)

R = TypeVar("R")


class TrainerActor(Actor):
    """One trainer rank.

    Args:
        config: the recipe; ``config.tp`` must divide the group size.
        backend: ``"torch"`` or ``"megatron"`` (megatron-core), both on CPU or CUDA.
    """

    # what a warm host (Runtime.keep_warm) imports ahead: a rank's start goes 4.5 s -> 0.3 s
    preload = ("torch", "torch.distributed", "transformers", "earl.stages.trainer_torch",
               "transformers.models.qwen2.modeling_qwen2",
               "transformers.models.llama.modeling_llama")

    def __init__(self, config: TrainerConfig,
                 backend: Literal["torch", "megatron"] = "torch") -> None:
        if not isinstance(config, TrainerConfig):
            raise TypeError(f"TrainerActor config must be a TrainerConfig, got "
                            f"{type(config).__name__}")
        if backend not in ("torch", "megatron"):
            raise ValueError(f"TrainerActor backend must be 'torch' or 'megatron', got {backend!r}")
        self.config = config
        self.backend = backend
        self.trainer: TorchTrainer | None = None
        self._lock = asyncio.Lock()
        self._dock: Dock | None = None  # made on first use
        self._peers: dict[int, Sender] = {}  # this replica's other ranks (leader only)
        self._leader_host: str | None = None  # this replica's leader's host (peers only)
        self._publisher: WeightPublisher | None = None  # one per trainer life (and rollout group)
        self._publisher_key: tuple[object, ...] = ()

    async def setup(self) -> None:
        def build() -> TorchTrainer:
            if self.backend == "megatron":
                from earl.stages.trainer_megatron import MegatronTrainer

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
    async def train_planned(self, plan: DispatchPlan, index: str = "dock",
                            lr_scale: float = 1.0, timeout_s: float = 120.0,
                            token_floor: int | None = None) -> dict[str, float]:
        """One optimizer step on this rank's slice of a dispatch plan (call on every rank).

        The leader of each DP replica fetches the replica's samples straight from the
        warehouses (`Dock.fetch_replica`) and forwards the frames to its TP peers (on one host,
        the same read-only shm pages); the micro-batches are the plan's. The caller acks the
        lease (`earl.stages.trainer_feed.train_from_dock` does all of it). With a
        `token_floor`, tokens sampled before that policy version are out of the loss
        (`bound_staleness`; the plan's lease must carry ``versions``).
        """
        replica = plan.for_rank(self.rank)
        before = self._dock.fetched_bytes() if self._dock is not None else {}
        batch, bound = await self._fetch_planned(plan, index, timeout_s, token_floor)
        pos = {sid: i for i, sid in enumerate(replica.sample_ids)}
        micro = [[pos[sid] for sid in mb] for mb in replica.micro_batches]
        metrics = await self._run(lambda t: t.train_step(batch, lr_scale, micro))
        if plan.is_leader(self.rank):
            metrics.update(bound)  # once per replica: train_from_dock sums them
            if self.config.record_dir:
                self._record(replica.sample_ids)
        assert self._dock is not None
        for kind, n in self._dock.fetched_bytes().items():  # what carried this step's data
            if n > before.get(kind, 0):
                metrics[f"transport/experience_bytes/{kind}"] = float(n - before.get(kind, 0))
        for r in replica.ranks:  # peers have read the forwarded pages by now: free them
            wait = getattr(self._peers.get(r), "wait_released", None)
            if wait is not None:
                await asyncio.to_thread(wait, timeout_s)
        return metrics

    def _record(self, sample_ids: Sequence[str]) -> None:
        """The samples this replica's step just trained, on disk before the caller acks."""
        assert self.trainer is not None
        path = Path(self.config.record_dir) / f"trained.{self.rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps({"step": self.trainer.step, "rank": self.rank,
                           "sample_ids": pack(sorted(sample_ids))})  # a set: sorted packs
        with path.open("a") as f:
            f.write(line + "\n")

    async def _fetch_planned(self, plan: DispatchPlan, index: str, timeout_s: float,
                             token_floor: int | None) -> tuple[TrainBatch, dict[str, float]]:
        from earl.runtime import context
        from earl.runtime.dock import Dock
        from earl.runtime.locality import host_id
        from earl.runtime.transport.route import open_sender

        if self._dock is None:
            self._dock = Dock(await context().lookup(index))
        replica = plan.for_rank(self.rank)
        frames: list[Frame]
        if plan.is_leader(self.rank):
            data, frames = await self._dock.fetch_replica(plan, self.rank, timeout_s=timeout_s)
            peers = [r for r in replica.ranks if r != self.rank]
            if peers:
                group = await context().lookup(self.name)
                for r in peers:
                    if r not in self._peers:
                        self._peers[r] = open_sender(
                            await group[r].data_address.call_one(index, host_id()))
                forward_frames(frames, [self._peers[r] for r in peers])
        else:
            if self._leader_host is None:
                group = await context().lookup(self.name)
                self._leader_host = await group[replica.leader].data_host.call_one()
            receiver = self._dock.receiver(self._leader_host)
            data, frames = await asyncio.to_thread(receive_replica, receiver,
                                                   len(replica.fetches), timeout_s=timeout_s)
        try:
            samples = [data[sid] for sid in replica.sample_ids]
            if token_floor is None:
                return TrainBatch.from_samples(samples), {}  # copies
            samples, masked, oldest = bound_staleness(samples, token_floor)
            bound = {"stale_tokens": float(masked)}
            if oldest >= 0:
                bound["oldest_version"] = float(oldest)
            return TrainBatch.from_samples(samples), bound
        finally:
            for f in frames:
                f.release()

    @endpoint
    async def data_address(self, index: str = "dock", peer_host: str | None = None) -> str:
        """Address where this rank receives its replica's data forwarded by its replica leader
        on `peer_host` (a `host_id()`; None: this host); `index` names the dock's index group."""
        from earl.runtime import context
        from earl.runtime.dock import Dock

        if self._dock is None:
            self._dock = Dock(await context().lookup(index))
        return str(self._dock.receiver(peer_host).address)

    @endpoint
    async def data_host(self) -> str:
        """This rank's `host_id()` (its replica peers pick their transport to it by it)."""
        from earl.runtime.locality import host_id

        return host_id()

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
    async def set_recompute(self, on: bool) -> None:
        """Recompute activations in the backward from the next step on, or stop (call on
        every rank; `TorchTrainer.set_recompute`). A re-spawn keeps it (`trainer_config`)."""
        await self._run(lambda t: t.set_recompute(on))
        assert self.trainer is not None
        self.config = self.trainer.config

    @endpoint
    async def trainer_config(self) -> TrainerConfig:
        """The recipe this rank was built with (what `earl.stages.reconfigure` re-spawns)."""
        return self.config

    @endpoint
    async def layout(self) -> Layout:
        """This group's parallel layout (``dp`` replicas of ``tp`` x ``pp`` ranks)."""
        c = self.config
        return Layout(dp=self.world_size // (c.tp * c.pp), tp=c.tp, pp=c.pp)

    @endpoint
    async def version(self) -> int:
        """Optimizer steps taken (the policy version the trainer holds)."""
        assert self.trainer is not None
        return self.trainer.step

    @endpoint
    async def push_weights(self, rollout: ActorGroup[Any], version: int | None = None,
                           transport: PushTransport = "auto",
                           bucket_bytes: int = 64 << 20,
                           mode: UpdateMode = "inflight") -> dict[str, float]:
        """Send the current weights to every replica of ``rollout`` (call on all ranks).

        Rank 0 sends; other ranks only take part in FSDP's / TP's gathers. Rank 0 keeps one
        `WeightPublisher` (its connections and warm buffers) for as long as it pushes to the
        same rollout group with the same settings. `transport`: see `WeightPublisher` ("auto":
        each replica's by locality). `mode`: what the replicas do with the requests they are
        running (`earl.stages.vllm_engine.VLLMEngine.update_weights`). Returns the `WeightSync`
        numbers (seconds, bytes, buckets, load_s, version, and
        ``transport/weights_bytes/<kind>``) on rank 0, ``{}`` elsewhere.
        """
        assert self.trainer is not None
        ver = self.trainer.step if version is None else version
        if self.rank != 0 and not self.trainer.collective_weights:
            return {}
        named = await self._run(lambda t: list(t.named_weights()))
        if self.rank != 0:
            return {}
        publisher = self._publisher_for(rollout, transport, bucket_bytes)
        try:
            sync = await publisher.push(named, version=ver, mode=mode)
        except BaseException:
            self._close_publisher()  # reconnect next time (e.g. a replica was restarted)
            raise
        return sync.metrics()

    def _publisher_for(self, rollout: ActorGroup[Any], transport: PushTransport,
                       bucket_bytes: int) -> WeightPublisher:
        from earl.stages.weights import WeightPublisher

        key = (rollout.name, tuple(rollout.addresses), transport, bucket_bytes)
        if self._publisher is None or key != self._publisher_key:
            self._close_publisher()
            self._publisher = WeightPublisher(rollout, transport=transport,
                                              bucket_bytes=bucket_bytes)
            self._publisher_key = key
        return self._publisher

    def _close_publisher(self) -> None:
        if self._publisher is not None:
            self._publisher.close()
        self._publisher, self._publisher_key = None, ()

    @endpoint
    async def offload(self) -> dict[str, float]:
        """Colocated placement: this rank's parameters, gradients and optimizer state to host
        memory while the rollout uses the GPU (the next computing call brings them back, or
        `onload`). Returns the bytes moved and seconds (zeros on CPU)."""
        return _moved(await self._run(lambda t: t.offload()))

    @endpoint
    async def onload(self) -> dict[str, float]:
        """The state `offload` moved, back on this rank's GPU."""
        return _moved(await self._run(lambda t: t.resident()))

    @endpoint
    async def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """All weights with HF names (small models; big ones go through ``push_weights``)."""
        return await self._run(lambda t: list(t.named_weights()))

    @endpoint
    async def save_hf(self, path: str) -> str:
        """Export an HF folder at `path` (under an allowed root: `earl.runtime.registry`)."""
        registry.check_path(path, what="TrainerActor.save_hf path")
        return str(await self._run(lambda t: t.save_hf(path)))

    @endpoint
    async def save_checkpoint(self, path: str) -> None:
        registry.check_path(path, what="TrainerActor.save_checkpoint path")
        await self._run(lambda t: t.save_checkpoint(path))

    @endpoint
    async def load_checkpoint(self, path: str) -> int:
        """Restore a checkpoint; returns the restored step."""
        registry.check_path(path, what="TrainerActor.load_checkpoint path")
        await self._run(lambda t: t.load_checkpoint(path))
        assert self.trainer is not None
        return self.trainer.step

    @endpoint
    async def close(self) -> None:
        self._close_publisher()
        for sender in self._peers.values():
            sender.close()
        self._peers.clear()
        if self._dock is not None:
            self._dock.close()
        await self._run(lambda t: t.close())


def _moved(m: Moved) -> dict[str, float]:
    return {"parameters": float(m.parameters), "gradients": float(m.gradients),
            "optimizer": float(m.optimizer), "total": float(m.total), "seconds": m.seconds}
