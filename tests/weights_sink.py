"""`Sink`: the rollout side of a weight push as `RolloutActor` speaks it (its `WeightInbox`),
without vLLM: it keeps what arrives (copied to host memory) for the test to compare. Used by
tests/integration/test_weights_locality.py (shm, network, gloo) and
tests/gpu/test_weights_lanes_gpu.py (CUDA IPC, on a GPU)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import torch

from earl.runtime import Actor, endpoint
from earl.runtime.locality import ENV_HOST_ID, host_id
from earl.stages.weights_inbox import WeightEndpoints, WeightInbox


class Sink(WeightEndpoints, Actor):
    """Rank `remote_rank` declares another host (before anything asks this process's host);
    `device` is what the replica would serve on ("cuda": IPC or nccl by the publisher's GPU)."""

    def __init__(self, remote_rank: int = -1, device: str = "cpu") -> None:
        if self.rank == remote_rank:
            os.environ[ENV_HOST_ID] = f"elsewhere-{self.rank}"
            host_id.cache_clear()
        self.weights = WeightInbox(device)
        self.got: list[tuple[str, torch.Tensor]] = []

    @endpoint
    async def commit_weights(self, version: int, mode: str, frames: int) -> float:
        def load() -> list[tuple[str, torch.Tensor]]:
            frames_read: list[Any] = []
            try:
                return [(n, t.to("cpu", copy=True))
                        for n, t in self.weights.stream(frames, frames_read)]
            finally:
                for f in frames_read:
                    f.release()

        self.got += await asyncio.to_thread(load)
        return 0.0

    @endpoint
    async def received(self) -> list[tuple[str, torch.Tensor]]:
        out, self.got = self.got, []
        return out

    @endpoint
    async def kind(self) -> str:
        return self.weights.kind
