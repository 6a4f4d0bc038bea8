"""The rollout stage as actors: `RolloutActor` serves one vLLM engine over RPC, and
`RolloutClient` is the `earl.engine.Engine` that agent coroutines call, spreading sessions over
the replicas of a rollout group.

A session (the `session_id` of `generate`, one agent trajectory) sticks to the replica that
served its first turn while it lives, so its multi-turn prompts hit that replica's prefix cache;
new sessions go to the replica with the fewest calls in flight from this client. Weight updates
reach every replica through `update_weights_from_path` or the bucketed path in
`earl.stages.weights`.

This module holds no model code (`earl.stages.vllm_engine`) and no trainer logic.

Example:
    >>> g = await rt.spawn("rollout", RolloutActor, EngineConfig(model=path), n=2,
    ...                    env={"OMP_NUM_THREADS": "1"})   # or tensor_parallel_size=2, n=1
    >>> engine = RolloutClient(g)
    >>> gen = await engine.generate(prompt_ids, SamplingParams(max_tokens=32), session_id="s1")
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from earl.engine import ContextLengthError, Generation, SamplingParams
from earl.runtime import Actor, ActorError, ActorGroup, endpoint
from earl.runtime.wire import message
from earl.stages.compute import Compute
from earl.stages.vllm_engine import EngineConfig, RolloutStatistics, UpdateMode, VLLMEngine
from earl.stages.weights_inbox import WeightEndpoints, WeightInbox

if TYPE_CHECKING:
    import torch

    from earl.runtime.transport import Frame

for _cls in (SamplingParams, Generation, EngineConfig, Compute, RolloutStatistics):
    message(_cls)

__all__ = ["RolloutActor", "RolloutClient"]


class RolloutActor(WeightEndpoints, Actor):
    """One vLLM engine replica (in-process core, stepped in a thread inside this actor).

    Args:
        config: what the engine serves (a typed record on the wire; a dict of its fields is
            still accepted for callers not yet passing the dataclass). With
            ``tensor_parallel_size > 1`` the engine starts that many vLLM worker processes.
        policy_version: version of the weights the engine starts with.
    """

    # what a warm host (Runtime.keep_warm) imports ahead: a replica's start goes 13.5 s -> 1.8 s
    preload = ("vllm", "vllm.v1.engine.llm_engine", "vllm.model_executor.models.llama",
               "vllm.model_executor.models.qwen2")

    def __init__(self, config: EngineConfig, policy_version: int = 0) -> None:
        if isinstance(config, dict):
            config = EngineConfig(**config)
        if not isinstance(config, EngineConfig):
            raise TypeError(f"RolloutActor config must be an EngineConfig, got "
                            f"{type(config).__name__}")
        self.config = config
        self.engine = VLLMEngine(config, policy_version=policy_version, on_death=_die)
        self._staged: list[tuple[str, torch.Tensor]] = []
        self.weights = WeightInbox(config.compute.device)  # where weight pushes arrive

    async def setup(self) -> None:
        await self.engine.start()

    @endpoint
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       session_id: str | None = None) -> Generation:
        return await self.engine.generate(prompt_ids, params, session_id=session_id)

    @endpoint
    async def generate_batch(self, prompts: list[list[int]],
                             params: SamplingParams) -> list[Generation]:
        """A whole batch in one engine-thread call (evaluation, raw-speed reference)."""
        return await self.engine.generate_batch(prompts, params)

    @endpoint
    async def policy_version(self) -> int:
        return self.engine.policy_version

    @endpoint
    async def engine_config(self) -> EngineConfig:
        """What this replica serves (what `earl.stages.reconfigure` re-spawns)."""
        return self.config

    @endpoint
    async def statistics(self) -> RolloutStatistics:
        return self.engine.statistics()

    @endpoint
    async def update_weights_from_path(self, path: str, version: int | None = None,
                                       mode: UpdateMode = "inflight") -> float:
        """Reload weights from an HF folder; returns the seconds the engine spent loading."""
        return await self.engine.update_weights(path=path, version=version, mode=mode)

    @endpoint
    async def stage_bucket(self, names: list[str], tensors: list[torch.Tensor]) -> int:
        """Keep one bucket of new weights sent over RPC; returns tensors staged so far."""
        if len(names) != len(tensors):
            raise ValueError(f"stage_bucket: {len(names)} names for {len(tensors)} tensors")
        self._staged += zip(names, tensors, strict=True)
        return len(self._staged)

    @endpoint
    async def commit_weights(self, version: int | None = None, mode: UpdateMode = "inflight",
                             frames: int = 0) -> float:
        """Load the staged buckets plus `frames` buckets arriving through `weights_address`'s
        kind, all in one in-place reload that consumes buckets as they come (call it before
        sending them); returns the seconds the engine spent loading, receiving included."""
        staged, self._staged = self._staged, []
        if not staged and not frames:
            raise ValueError("commit_weights: nothing staged; send buckets first")
        got: list[Frame] = []

        def stream() -> Iterator[tuple[str, torch.Tensor]]:  # runs in the engine thread
            yield from staged
            yield from self.weights.stream(frames, got)

        try:
            return await self.engine.update_weights(stream(), version=version, mode=mode)
        finally:
            for f in got:  # vLLM has copied the views into its parameters by now
                f.release()

    @endpoint
    async def sleep(self) -> bool:
        """Release the engine's GPU memory until `wake` (colocated placement: the trainer
        takes the GPU); False where nothing is released (CPU). See `VLLMEngine.sleep`."""
        return await self.engine.sleep()

    @endpoint
    async def wake(self) -> bool:
        """The engine's weights and KV cache back on the GPU (see `VLLMEngine.wake`)."""
        return await self.engine.wake()

    @endpoint
    async def rebuild(self, config: EngineConfig, policy_version: int) -> float:
        """Serve `config` from this warm process: the engine is closed and a new one built
        (about 2 s on the tiny model, against about 15 s for a new process, most of which is
        importing torch and vLLM). Requests in flight fail: the caller holds the replica idle
        first. The engine starts from `config.model`'s weights; returns the seconds it took."""
        t0 = time.perf_counter()
        await self.engine.close()
        self.config = config
        self.engine = VLLMEngine(config, policy_version=policy_version, on_death=_die)
        await self.engine.start()
        return time.perf_counter() - t0

    @endpoint
    async def close(self) -> None:
        await self.engine.close()
        self.weights.close()


def _die(exc: BaseException) -> None:
    """vLLM failed mid-serve: end this process so the supervisor sees it and can restart it."""
    traceback.print_exception(exc, file=sys.stderr)
    sys.stderr.flush()
    os._exit(70)


class RolloutClient:
    """`earl.engine.Engine` over a group of `RolloutActor` replicas, sticky per session.

    Args:
        group: the rollout actor group.
        max_sessions: sessions remembered (least recently used are forgotten first).
    """

    def __init__(self, group: ActorGroup[RolloutActor], *, max_sessions: int = 100_000) -> None:
        self.group = group
        self._n = len(group)
        self._load = [0] * self._n
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions
        self._version = 0

    @property
    def policy_version(self) -> int:
        """The newest policy version seen in any reply (or set by `note_version`)."""
        return self._version

    def note_version(self, version: int) -> None:
        self._version = max(self._version, version)

    def replica_of(self, session_id: str) -> int | None:
        """Rank serving `session_id`, or None when it has no replica yet."""
        return self._sessions.get(session_id)

    def end_session(self, session_id: str) -> None:
        """Forget a finished session so its replica is free to be chosen by load again."""
        self._sessions.pop(session_id, None)

    def _pick(self, session_id: str | None) -> int:
        if session_id is not None and (rank := self._sessions.get(session_id)) is not None:
            self._sessions.move_to_end(session_id)
            return rank
        rank = min(range(self._n), key=self._load.__getitem__)
        if session_id is not None:
            self._sessions[session_id] = rank
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        return rank

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        rank = self._pick(session_id)
        self._load[rank] += 1
        try:
            gen: Generation = await self.group[rank].generate.call_one(
                list(prompt_ids), params, session_id)
        except ActorError as exc:  # the agent loop handles this one: keep its type
            if exc.remote_type.endswith("ContextLengthError"):
                raise ContextLengthError(exc.remote_message) from None
            raise
        finally:
            self._load[rank] -= 1
        if gen.versions:
            self.note_version(gen.versions[-1])
        return gen
