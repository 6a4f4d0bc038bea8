"""Training: one optimizer step per batch on the dock's samples, then the weight push, each
retried once the supervisor healed the actor whose death failed it.

The driver leases the batch (metadata), the dispatcher plans it for the trainer's layout
(`earl.stages.trainer_feed`), and each DP replica's leader fetches its slice straight from the
producers' and the reference's shards. A step whose fetch hit a dead shard is taken again once
the lost groups are re-played; a weight push that hit a dead rollout replica is pushed again,
and a restarted replica is given the current weights (`repush`).

Not here: restarts and their limits (`earl.loop.supervisor`), the trainer ranks themselves
(`earl.stages.trainer`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from earl.loop.supervisor import died_actor
from earl.observe import Tracer

if TYPE_CHECKING:
    from earl.loop.actors import Actors
    from earl.loop.production import ActorProduction
    from earl.loop.supervisor import Supervisor
    from earl.stages.vllm_engine import UpdateMode
    from earl.stages.weights import PushTransport

__all__ = ["ActorTraining"]


class ActorTraining:
    """Steps and weight pushes over the run's live groups.

    The groups are read from `actors` at each call (the selector may have re-created them).
    `flows` holds the bytes each transport carried in the last step
    (``transport/experience_bytes/<kind>``: warehouses -> trainer leaders;
    ``transport/weights_bytes/<kind>``: trainer -> rollout replicas). `weight_update`: what
    a push does to the requests a replica is running (`RunConfig.weight_update`).
    `max_policy_lag`: step b trains the tokens sampled at version `b - max_policy_lag` or later;
    older ones stay in their samples' context, out of the loss (``stale_tokens`` in a step's
    metrics; None: every token trains)."""

    def __init__(self, actors: Actors, columns: list[str], *, supervisor: Supervisor,
                 production: ActorProduction, tracer: Tracer | None = None,
                 weights_transport: PushTransport = "auto",
                 weight_update: UpdateMode = "inflight",
                 max_policy_lag: int | None = None) -> None:
        self.actors, self.columns = actors, columns
        self.max_policy_lag = max_policy_lag
        self.supervisor, self.production = supervisor, production
        self.weights_transport = weights_transport  # placement.weights_transport
        self.weight_update = weight_update
        self.tracer = tracer or Tracer(False)
        self.seconds = {"train_s": 0.0, "sync_s": 0.0}  # of the last step, for the metrics
        self.flows: dict[str, float] = {}
        self._push = asyncio.Lock()

    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: Sequence[str] | None = None) -> dict[str, float]:
        while True:
            try:
                return await self._train(batch, samples, lr_scale, groups)
            except Exception as exc:
                who = died_actor(exc)
                if who is None or who[0] not in ("producer", "reference") \
                        or self.supervisor.stopping:
                    raise
                self.supervisor.note("retry_step", who[0], rank=who[1], step=batch + 1)
                await self.supervisor.wait_healed(*who)
                await self.production.reproduce_lost(f"shard {who[0]}:{who[1]} died in a fetch")

    async def _train(self, batch: int, samples: int, lr_scale: float,
                     groups: Sequence[str] | None) -> dict[str, float]:
        from earl.stages.trainer_feed import train_from_dock

        t0 = time.perf_counter()
        a = self.actors
        with self.tracer.span("train_step", actor="trainer", step=batch + 1):
            metrics = await train_from_dock(a.trainer, a.dock, samples, self.columns,
                                            lr_scale=lr_scale,
                                            micro_batch_tokens=a.micro_batch_tokens,
                                            group_ids=groups,
                                            token_floor=None if self.max_policy_lag is None
                                            else batch - self.max_policy_lag)
        self.seconds["train_s"] = time.perf_counter() - t0
        self.flows = {k: v for k, v in metrics.items() if k.startswith("transport/")}
        return {k: v for k, v in metrics.items() if not k.startswith("transport/")}

    async def discard(self, groups: Sequence[str], reason: str) -> int:
        """Drop `groups` from the dock untrained, for `reason`; returns the rows dropped."""
        from earl.stages.trainer_feed import discard_from_dock

        return await discard_from_dock(self.actors.dock, groups, reason)

    async def publish(self, version: int) -> None:
        """Push the trainer's weights to the rollout replicas as policy `version`."""
        while True:
            try:
                async with self._push:
                    await self._publish(version)
                    self.supervisor.set_version(version)
                return
            except Exception as exc:
                who = died_actor(exc)
                if who is None or who[0] != "rollout":
                    raise
                await self.supervisor.wait_healed(*who)

    async def repush(self, rank: int) -> None:
        """A restarted rollout replica: push the current weights at the current version."""
        async with self._push:
            await self._publish(self.supervisor.version)

    async def _publish(self, version: int) -> None:
        t0 = time.perf_counter()
        with self.tracer.span("push_weights", actor="trainer", version=version):
            synced = await self.actors.trainer.push_weights.call(
                self.actors.rollout, version, self.weights_transport,
                mode=self.weight_update)
        self.seconds["sync_s"] = time.perf_counter() - t0
        self.flows.update({k: v for k, v in synced[0].items() if k.startswith("transport/")})
