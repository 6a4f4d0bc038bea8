"""Producer actors: they run the agent coroutines and keep the experience they make.

A `ProducerActor` is a rollout worker process. It imports the user's agent (and the recipe's
critic factory, if any) by reference, plays the groups the driver assigns to it against the
vLLM rollout actors (`RolloutClient`), turns the finished trajectories into training columns
(`earl.stages.advantages`, with that critic), and stores them in its own warehouse shard of
the transfer dock. The reference and the trainer fetch the columns straight from this process;
the driver only gets `Episode` metadata back (`earl.stages.batch_types`).

Not here: sampling tokens (the rollout actors), deciding when a batch may start (the
staleness gate in the driver, `earl.loop`), or the loss. Like every stage, it never imports
the loop that drives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np

from earl.config import AlgorithmConfig
from earl.runtime import Actor, context, endpoint
from earl.runtime.dock import Dock, WarehouseHost
from earl.runtime.types import Trajectory
from earl.runtime.wire import message
from earl.stages.advantages import Estimator
from earl.stages.batch_types import BatchResult, Episode, GroupTask, episode_of, sample_id
from earl.stages.dump import TrajectoryDump
from earl.stages.healing_engine import HealingEngine
from earl.stages.producer_settings import ProducerSettings

T = TypeVar("T")

__all__ = ["ProducerActor", "ProducerConfig", "first_finished"]


async def first_finished(plays: Sequence[Awaitable[T]], need: int) -> dict[int, T]:
    """Run `plays` at once; once `need` of them have finished, cancel the rest (and wait for
    them to unwind). Returns {index: result} of exactly the `need` that finished first (the
    lower index among ties). An exception from any play cancels the others and is raised."""
    if not 0 <= need <= len(plays):
        raise ValueError(f"need must be in [0, {len(plays)}], got {need}")
    tasks = [asyncio.ensure_future(p) for p in plays]
    index = {t: i for i, t in enumerate(tasks)}
    kept: dict[int, T] = {}
    pending = set(tasks)
    try:
        while len(kept) < need:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for t in sorted(done, key=index.__getitem__):
                if len(kept) < need:
                    kept[index[t]] = t.result()
    finally:
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return kept


message(AlgorithmConfig)


@message
@dataclass(kw_only=True, slots=True)
class ProducerConfig(ProducerSettings):
    """What a producer needs (all plain data: it crosses the process boundary): the run's
    `ProducerSettings` (`agent`, `reward`, `max_tokens`, `tool_timeout_s`, `dump_share`, the
    agent and per-turn cap resolved), and:

    Attributes:
        model: HF folder whose tokenizer the chat codec uses.
        rollout: name of the rollout actor group.
        index: name of the dock's index actor.
        max_total_tokens: per-trajectory cap (None: the engine's context length).
        context_window: the rollout's context length at spawn (0: unknown), what the OpenAI
            endpoint serves a client's `max_tokens` up to.
        dump_max_bytes: the most a rank's dump files take, rotated segments included (0: no
            cap; `earl.stages.dump`).
        dump: file rank 0 appends trajectories to ("" = none), for `earl inspect`; rank r
            writes "<stem>.r.jsonl" beside it.
        critic: the reference of the recipe's critic factory (`Recipe.critic`, "" = none):
            called once here, the critic then scores and learns from every batch.
        algorithm: the run's algorithm: advantages and the sampling temperature.
        failed_reward: what a failed trajectory scores (the recipe's).
    """

    model: str
    rollout: str = "rollout"
    index: str = "dock"
    max_total_tokens: int | None = None
    context_window: int = 0
    dump: str = ""
    dump_max_bytes: int = 0
    critic: str = ""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    failed_reward: float = 0.0


class ProducerActor(WarehouseHost, Actor):
    """Plays groups with the agent, prepares their columns, keeps them in its dock shard."""

    def __init__(self, config: ProducerConfig, version: int = 0) -> None:
        self.config = config
        self._version = version
        self._order = asyncio.Condition()
        self._next_put: int | None = None  # batches are prepared in order (critic updates)
        self._snapshots: dict[int, dict[str, object]] = {}  # batch -> estimator state after it
        # Rank 0 appends to `dump`, rank r to "<stem>.r.jsonl" (one writer per file).
        dump = config.dump if self.rank == 0 or not config.dump else \
            str(Path(config.dump).with_suffix(f".{self.rank}.jsonl"))
        self._dump = TrajectoryDump(dump, share=config.dump_share,
                                    max_bytes=config.dump_max_bytes) if dump else None

    async def setup(self) -> None:
        from transformers import AutoTokenizer

        from earl.agents.chat import ChatCodec
        from earl.recipe import load_agent, load_critic, load_reward
        from earl.stages.rollout import RolloutClient

        c = self.config
        self.agent = load_agent(c.agent)
        self.reward = load_reward(c.reward) if c.reward else None
        self.codec = ChatCodec(AutoTokenizer.from_pretrained(c.model))
        self.engine = HealingEngine(RolloutClient(await context().lookup(c.rollout)))
        self.engine.note_version(self._version)
        self.dock = Dock(await context().lookup(c.index), warehouse=self.warehouse)
        from earl.agents.openai_server import OpenAIEndpoint

        # Agents written against the OpenAI client reach the policy through this process's
        # endpoint (loopback, per-run key); sessions of in-process agents never touch it.
        self.openai = OpenAIEndpoint()
        await self.openai.start()
        self.estimator = Estimator(c.algorithm, load_critic(c.critic) if c.critic else None,
                                   failed_reward=c.failed_reward)

    def _rollout_config(self, temperature: float):  # -> RolloutConfig
        from earl.agents.rollout import RolloutConfig
        from earl.engine import SamplingParams

        c = self.config
        return RolloutConfig(sampling=SamplingParams(max_tokens=c.max_tokens,
                                                     temperature=temperature,
                                                     stop_token_ids=list(self.codec.stop_ids)),
                             max_total_tokens=c.max_total_tokens,
                             context_window=c.context_window or None,
                             tool_timeout_s=c.tool_timeout_s)

    async def _play(self, samples: list[object], ids: list[tuple[str, str]],
                    temperature: float) -> list[Trajectory]:
        from earl.agents.rollout import run_agent

        cfg = self._rollout_config(temperature)

        async def one(sample: object, sid: str, gid: str) -> list[Trajectory]:
            earlier: list[Trajectory] = []  # segments of an OpenAI client that rewrote history
            t0 = time.perf_counter()
            try:
                t = await run_agent(self.agent, sample, engine=self.engine, codec=self.codec,
                                    config=cfg, sample_id=sid, group_id=gid,
                                    endpoint=self.openai, segments=earlier)
            finally:  # a cut group's sessions end too
                self.engine.end_session(sid)
            if self.reward is not None and not t.failed:
                self._apply_reward(t, sample)
                for seg in earlier:
                    seg.reward, seg.failed, seg.error = t.reward, t.failed, t.error
            t.info["episode_s"] = round(time.perf_counter() - t0, 4)  # the session's wall time
            return [*earlier, t]

        played = await asyncio.gather(*(one(s, sid, gid)
                                        for s, (sid, gid) in zip(samples, ids, strict=True)))
        return [t for ts in played for t in ts]

    @endpoint
    async def play(self, batch: int, groups: list[GroupTask], snapshot: bool = False,
                   need: int | None = None) -> BatchResult:
        """Play batch `batch`'s groups, prepare their columns and put them in this shard.

        With `need`, the first `need` groups to finish are kept and the others are cut
        (over-sampling, `RunConfig.over_sample_groups`). Batches are prepared in the order they
        are asked for (a critic learns from each), so a batch whose games finish early waits
        for the previous one before its put. With `snapshot`, the estimator's state right
        after this batch is kept for `save_state` (a checkpoint after training this batch must
        not see later batches)."""
        t0 = time.perf_counter()
        async with self._order:
            if self._next_put is None:
                self._next_put = batch
        trajs, cut = await self._play_groups(batch, groups, "", need)
        seconds = time.perf_counter() - t0
        async with self._order:
            await self._order.wait_for(lambda: self._next_put == batch)
        try:
            n, rows = await self._put(batch, trajs, "", snapshot)
        finally:
            async with self._order:
                self._next_put = batch + 1
                self._order.notify_all()
        return BatchResult(batch=batch, episodes=[episode_of(t) for t in trajs], samples=n,
                           seconds=seconds, cut=cut, row_groups=rows)

    @endpoint
    async def play_group(self, batch: int, group: GroupTask, index: int, tag: str = ""
                         ) -> BatchResult:
        """Partial rollouts (`RunConfig.partial_rollouts`): play one group of batch `batch`
        (its `index`-th) and put it in this shard as soon as it is done, whatever the rest of
        its batch does; `tag` marks a re-play after a fault. Groups are prepared in the order
        they finish (a critic learns from each in that order)."""
        t0 = time.perf_counter()
        trajs, _ = await self._play_groups(batch, [group], tag, None)
        prefix = f"{tag}-g{index}" if tag else f"g{index}"
        n, rows = await self._put(batch, trajs, prefix, False)
        return BatchResult(batch=batch, episodes=[episode_of(t) for t in trajs], samples=n,
                           seconds=time.perf_counter() - t0, row_groups=rows)

    @endpoint
    async def replay(self, batch: int, groups: list[GroupTask], tag: str,
                     snapshot: bool = False, need: int | None = None) -> BatchResult:
        """Play groups of batch `batch` again after a fault lost them (`earl.loop.healing`):
        like `play`, outside the batch order, with sample ids tagged `tag`."""
        t0 = time.perf_counter()
        trajs, cut = await self._play_groups(batch, groups, tag, need)
        n, rows = await self._put(batch, trajs, tag, snapshot)
        return BatchResult(batch=batch, episodes=[episode_of(t) for t in trajs], samples=n,
                           seconds=time.perf_counter() - t0, cut=cut, row_groups=rows)

    async def _play_groups(self, batch: int, groups: list[GroupTask], tag: str,
                           need: int | None) -> tuple[list[Trajectory], list[str]]:
        """The trajectories of the first `need` groups to finish (all: None), in group order,
        and the ids of the groups cut."""
        prefix = f"b{batch:06d}-{tag + '-' if tag else ''}"
        plays = [self._play(g.samples, [(f"{prefix}{g.group_id}-{i}", g.group_id)
                                        for i in range(len(g.samples))],
                            self.config.algorithm.temperature) for g in groups]
        kept = await first_finished(plays, len(groups) if need is None else need)
        return ([t for i in sorted(kept) for t in kept[i]],
                [g.group_id for i, g in enumerate(groups) if i not in kept])

    async def _put(self, batch: int, trajs: list[Trajectory], tag: str, snapshot: bool
                   ) -> tuple[int, list[str]]:
        """Columns of `trajs` into this shard (whole groups); returns the rows put and the
        group of each."""
        rows, sources = self.estimator.columns(trajs)
        if snapshot:
            self._snapshots[batch] = self.estimator.state_dict()
        sizes: dict[str, int] = {}
        for i in sources:
            sizes[trajs[i].group_id] = sizes.get(trajs[i].group_id, 0) + 1
        await asyncio.gather(*(
            self.dock.put(sample_id(batch, j, tag, self.rank), {k: v[j] for k, v in rows.items()},
                          group_id=trajs[i].group_id, group_size=sizes[trajs[i].group_id])
            for j, i in enumerate(sources)))
        if self._dump is not None:
            self._write_dump(batch + 1, trajs, rows["advantages"])
        return len(sources), [trajs[i].group_id for i in sources]

    @endpoint
    async def evaluate(self, samples: list[object], prefix: str) -> list[Episode]:
        """Play `samples` greedily (temperature 0); nothing goes to the dock."""
        ids = [(f"{prefix}-{i}", f"{prefix}-{i}") for i in range(len(samples))]
        return [episode_of(t) for t in await self._play(samples, ids, 0.0)]

    @endpoint
    async def use_rollout(self, name: str, version: int) -> None:
        """Sample from the rollout group `name` again (the selector re-created it), which
        serves policy `version`. Call only while no batch is playing."""
        from earl.stages.rollout import RolloutClient

        self.engine = HealingEngine(RolloutClient(await context().lookup(name)))
        self.engine.note_version(version)

    def _apply_reward(self, t: Trajectory, sample: object) -> None:
        """Score the final assistant turn with the reward rule; a raising rule fails the
        episode with the reason (the run goes on)."""
        assert self.reward is not None
        start, end = t.turn_spans[-1] if t.turn_spans else (0, 0)
        ids = [i for i in t.token_ids[start:end] if i not in self.codec.stop_ids]
        try:
            value = self.reward(sample, self.codec.decode(ids))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"returned {type(value).__name__}; return a float")
            t.reward = float(value)
        except Exception as exc:  # noqa: BLE001 - the rule's bug fails this episode only
            t.failed, t.reward = True, None
            t.error = f"reward rule {self.config.reward}: {type(exc).__name__}: {exc}"

    @endpoint
    async def pin_version(self, version: int) -> None:
        """The rollout actors were set to serve `version` on purpose (model selection loaded
        an earlier step's weights): its tokens are current, not stale."""
        self.engine.pin(version)

    @endpoint
    async def note_version(self, version: int) -> None:
        """The rollout actors now serve policy `version`."""
        self.engine.note_version(version)

    @endpoint
    async def save_state(self, path: str, batch: int | None = None) -> None:
        """Write the estimator's state (the critic) after `batch` to `path`, as JSON: this
        producer's part of a checkpoint, which it writes itself (the driver never holds it).
        `batch`: the snapshot `play(..., snapshot=True)` kept after that batch (earlier ones
        are forgotten); None, or a snapshot this process never took (it was restarted since):
        the state now."""
        state = self._snapshots.pop(batch, None) if batch is not None else None
        for b in [b for b in self._snapshots if batch is not None and b < batch]:
            del self._snapshots[b]
        if state is None:
            state = self.estimator.state_dict()
        await asyncio.to_thread(_write_state, Path(path), state)

    @endpoint
    async def load_state(self, path: str) -> None:
        """Load the estimator's state from `path` (written by `save_state`)."""
        self.estimator.load_state_dict(
            await asyncio.to_thread(lambda: json.loads(Path(path).read_text())))

    def _write_dump(self, step: int, trajs: list[Trajectory], advs: Sequence[np.ndarray]) -> None:
        assert self._dump is not None
        records = []
        for t, adv in zip(trajs, advs, strict=False):
            if not self._dump.wants(step, t.group_id, failed=t.failed):
                continue
            d = asdict(t)
            d["step"] = step
            mask = t.loss_mask
            first = next((i for i, m in enumerate(mask) if m), None)
            d["advantage"] = float(adv[first]) if first is not None else 0.0
            records.append(d)
        self._dump.write(records)


def _write_state(path: Path, state: dict[str, object]) -> None:
    """`state` as JSON at `path`, flushed to disk (a checkpoint part: a full disk raises)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
