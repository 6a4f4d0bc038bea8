"""The schedule of an RL run: which batch is produced, trained, evaluated, checkpointed when.

`Schedule.run` drives four parts through small protocols, so it is unit-tested with fakes and
no processes: `Production` plays a batch (its experience lands in the dock, metadata comes
back), `Training` trains on the dock and publishes weights, `Evaluation` scores held-out
tasks, `Checkpoints` saves consistent state. Production runs ahead of training by up to
`max_policy_lag` batches (the `StalenessGate`); step b + 1 leases exactly batch b's groups
from the dock, and its lease waits for the reference's column, so a batch is never trained
before it is scored, nor in another batch's step. On a stop (steps, time,
target metric) the batches already in flight are trained too, so the checkpoint's critic and
the trainer agree on the step.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from earl.config import RunConfig
from earl.loop.failures import add_failures, describe
from earl.loop.gate import GroupGate, StalenessGate
from earl.loop.pool import DoneGroup, GroupPool, straggler_wait
from earl.loop.watchdog import Watchdog
from earl.stages.batch_types import BatchResult, Episode

__all__ = ["Checkpoints", "Evaluation", "LoopState", "NothingToTrain", "Production", "Schedule",
           "Selection", "StepRecord", "Training"]


class Production(Protocol):
    async def play(self, batch: int, snapshot: bool) -> BatchResult: ...

    async def play_groups(self, batch: int, done: Callable[[BatchResult], None]
                          ) -> BatchResult:
        """Partial rollouts: each group on its own, `done` called as each finishes."""
        ...

    async def note_version(self, version: int) -> None: ...


class Training(Protocol):
    async def train(self, batch: int, samples: int, lr_scale: float,
                    groups: Sequence[str] | None = None) -> dict[str, float]: ...

    async def discard(self, groups: Sequence[str], reason: str) -> int:
        """Drop `groups` from the dock untrained, for `reason`; returns the rows dropped."""
        ...

    async def publish(self, version: int) -> None: ...


class Evaluation(Protocol):
    async def evaluate(self, split: str, version: int) -> dict[str, float]: ...


class Checkpoints(Protocol):
    async def save(self, state: LoopState, critic_batch: int | None) -> None: ...


class Selection(Protocol):
    """The parallelism selector (`earl.loop.selection`): decides and applies a plan on entry,
    then holds the actors (no reconfiguration) while the wrapped stage runs."""

    def rollout(self, batch: int) -> contextlib.AbstractAsyncContextManager[None]: ...

    def train(self, batch: int, result: BatchResult
              ) -> contextlib.AbstractAsyncContextManager[None]: ...

    def trained(self, batch: int, metrics: Mapping[str, float]) -> None:
        """Batch `batch`'s training step is done: its metrics (the run's live profile)."""
        ...

    def using(self) -> contextlib.AbstractAsyncContextManager[None]: ...


class AsSpawned:
    """The `Selection` of a run without the selector or colocation: the layout stays as
    spawned, and every hook does nothing."""

    def rollout(self, batch: int) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    def train(self, batch: int, result: BatchResult
              ) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    def trained(self, batch: int, metrics: Mapping[str, float]) -> None:
        pass

    def using(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()


STALE = "stale: its newest token was over max_policy_lag versions behind its step"
RUN_ENDED = "the run ended before a step took it"
NO_SIGNAL = "no signal: its episodes all scored alike (algorithm.filter_groups)"


class NothingToTrain(ValueError):
    """A batch without one generated token to train on: its episodes failed (the agents'
    errors), were cut before the model generated (the context), or generated nothing. A
    setting or an agent to fix, not a fault a resume would heal.

    Attributes:
        batch: the batch.
        failures: the failed episodes' error texts -> episodes.
        need_tokens: the longest first prompt plus max_tokens of the cut episodes (0: none).
        limits: what cut them ("context_window", "max_total_tokens").
    """

    def __init__(self, batch: int, result: BatchResult) -> None:
        eps = result.episodes
        self.failures: dict[str, int] = {}
        add_failures(self.failures, eps)
        failed = sum(self.failures.values())
        cut = [e for e in eps if not e.failed and e.truncated and e.generated == 0]
        empty = sum(not e.failed and not e.truncated and e.generated == 0 for e in eps)
        self.batch, self.limits = batch, sorted({str(e.info.get("cut", "context_window"))
                                                 for e in cut})
        self.need_tokens = max((int(e.info.get("cut_need_tokens", 0)) for e in cut), default=0)
        why = []
        if failed:
            why.append(f"{failed} failed ({describe(self.failures, chars=400)}): fix the "
                       "agent's error (every text and count: the run's JSON `failures`)")
        if cut:
            fix = ("raise --model.max_model_len (and placement.context_window if set) to at "
                   f"least {self.need_tokens}" if "context_window" in self.limits else
                   f"raise the recipe's max_total_tokens to at least {self.need_tokens}")
            why.append(f"{len(cut)} were cut before the model generated a token (the longest "
                       f"first prompt plus the turn's max_tokens needs {self.need_tokens} "
                       f"tokens, over the {' and '.join(self.limits)}): {fix}, lower "
                       "--max_tokens, or shorten the prompt (tool schemas count)")
        if empty:
            why.append(f"{empty} ended without asking the model for a turn: the agent must "
                       "call rollout.generate or its OpenAI client before it returns")
        super().__init__(f"batch {batch}: no episode has a token to train on; of its "
                         f"{len(eps)} episodes " + "; ".join(why or ["none was played"]))


@dataclass(kw_only=True, slots=True)
class LoopState:
    """What a checkpoint restores: the step (= policy version = data cursor) and history."""

    step: int = 0
    episodes: int = 0
    wall_before: float = 0.0
    evals: list[dict[str, float]] = field(default_factory=list)
    best: tuple[int, float] = (-1, float("-inf"))   # (step, validation metric)
    eval_start: dict[str, float] = field(default_factory=dict)
    failures: dict[str, int] = field(default_factory=dict)  # error text -> episodes


@dataclass(kw_only=True, slots=True)
class StepRecord:
    """One trained step, for the observer (metrics, progress line, trace)."""

    version: int
    result: BatchResult
    train: dict[str, float]
    step_s: float
    lr_scale: float
    straggler_wait_s: float = 0.0  # the trainer's wait from its first done group to its last
    stale_groups: int = 0  # groups dropped over the staleness bound before this step
    filtered: list[Episode] = field(default_factory=list)  # episodes of groups skipped alike
    slots: int = 0  # episodes the staleness gate lets run at once
    groups_running: int = 0  # partial rollouts: groups still playing as the step ends
    new_errors: list[str] = field(default_factory=list)  # failed episodes' texts first seen


class Schedule:
    """Runs the loop; `observe` gets every step and `on_eval` every validation eval.

    It reads the run's `steps`, `max_policy_lag`, `time_limit_minutes`, `eval_every`,
    `checkpoint_every` and `target` from `config`; `target_key` names the metric `target`
    applies to (the recipe's)."""

    def __init__(self, config: RunConfig, *, production: Production, training: Training,
                 evaluation: Evaluation | None, checkpoints: Checkpoints, state: LoopState,
                 target_key: str = "reward",
                 lr_scale: Callable[[float], float] = lambda progress: 1.0,
                 observe: Callable[[StepRecord], Awaitable[None]] | None = None,
                 on_eval: Callable[[dict[str, float]], Awaitable[None]] | None = None,
                 clock: Callable[[], float] | None = None,
                 selection: Selection | None = None,
                 watchdog: Watchdog | None = None) -> None:
        self.config, self.state, self.target_key = config, state, target_key
        self.time_limit_s = config.time_limit_minutes * 60
        self.production, self.training = production, training
        self.evaluation, self.checkpoints = evaluation, checkpoints
        self.lr_scale, self.observe, self.on_eval = lr_scale, observe, on_eval
        t0 = time.perf_counter()
        # `clock()` is the run's elapsed wall seconds, earlier (resumed) segments included.
        self.clock = clock or (lambda: state.wall_before + time.perf_counter() - t0)
        self.gate = StalenessGate(config.max_policy_lag, state.step)
        self.stopped = ""
        self.selection = selection or AsSpawned()
        self.partial = config.partial_rollouts != "off"
        self.pool = GroupPool()  # partial rollouts: groups done, not yet trained
        self.groups_out = GroupGate(config.groups_out)
        self._began: dict[int, float] = {}  # batch -> when its play began
        # the run ends with `Stalled` (a rewind heals it) when no step or healing event comes
        # for its limit, naming what it waits for (None: a watchdog that never fires)
        self.watchdog = watchdog or Watchdog(stall_s=0, stall_steps=0)

    async def run(self) -> str:
        """Train until a stop rule fires; returns why ("steps", "time_limit", "target")."""
        c = self.config
        loop = asyncio.get_running_loop()
        # the batches started and not yet trained (whole batches) or still playing (partial
        # rollouts): a batch's result, its episodes included, is let go once it is used
        played: dict[int, asyncio.Future[BatchResult]] = {}

        def future(b: int) -> asyncio.Future[BatchResult]:
            return played.setdefault(b, loop.create_future())

        def group_done(res: BatchResult) -> None:  # partial rollouts: progress
            self.pool.add(res)
            self.watchdog.beat()

        async def produce_one(b: int) -> None:
            try:
                if self.partial:
                    res = await self.production.play_groups(b, group_done)
                else:
                    self._began[b] = time.perf_counter()
                    async with self.selection.rollout(b):
                        # a snapshot of the critic after the batches a checkpoint ends at
                        res = await self.production.play(b, (b + 1) % c.checkpoint_every == 0)
                    self.watchdog.beat()  # a batch played: progress
                future(b).set_result(res)
                if self.partial:  # its groups went to the pool as each finished
                    played.pop(b)
            except BaseException as exc:
                # The task group raises `exc` itself; the future only wakes a step waiting
                # for this batch, and may have none: mark it retrieved (no stray traceback).
                if not (f := future(b)).done():
                    if isinstance(exc, asyncio.CancelledError):
                        f.cancel()
                    else:
                        f.set_exception(exc)
                        f.exception()
                raise

        async def producer(tg: asyncio.TaskGroup) -> None:
            # partial rollouts: a dropped group leaves a step short, so batches go on until the
            # run stops (the gate bounds them)
            for b in itertools.count(self.state.step) if self.partial else \
                    range(self.state.step, c.steps):
                if not await (self.groups_out.wait_may_start(self.groups_per_step)
                              if self.partial else self.gate.wait_may_start(b)):
                    return
                future(b)  # registered before the task runs: `b in played` == started
                tg.create_task(produce_one(b), name=f"play-{b}")

        async def next_batch(b: int) -> tuple[BatchResult, float, int, list[Episode]]:
            """Step b's batch, the trainer's straggler wait, the groups dropped stale and the
            episodes of the groups skipped as alike."""
            if self.partial:
                with self.watchdog.waiting(f"step {b + 1}'s groups to finish (producers)"):
                    return await self._take_groups(b)
            t0 = time.perf_counter()
            with self.watchdog.waiting(f"batch {b}'s rollout for step {b + 1} (producers)"):
                res = await future(b)
            played.pop(b)
            return res, straggler_wait(res, self._began.pop(b, t0), t0), 0, []

        last = self.clock()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(producer(tg), name="producer")
            watch = tg.create_task(self.watchdog.watch(), name="watchdog")
            b = self.state.step
            while b < c.steps:
                last = await self._learn(b, *await next_batch(b), last)
                b += 1
                if stop := await self._after_step():
                    self.stopped = stop
                    break
            else:
                self.stopped = "steps"
            await self.gate.close()
            await self.groups_out.close()
            if self.partial:  # the groups still out finish and are dropped, with the reason
                with self.watchdog.waiting("the groups still out at the run's end (producers)"):
                    await self._drain(list(played.values()))
            else:
                # Batches already started are finished and trained: their experience is in
                # the dock and the critic has seen them, so the final checkpoint stays
                # consistent.
                while b in played:
                    last = await self._learn(b, *await next_batch(b), last)
                    b += 1
            watch.cancel()
        await self.checkpoints.save(self.state, None)
        return self.stopped

    async def _drain(self, plays: list[asyncio.Future[BatchResult]]) -> None:
        """Drop every group still out as it finishes, until every play is done (dropping
        makes room in the dock for the puts of the plays still running)."""
        while True:
            if rest := [g.group_id for g in self.pool.take_all() if g.result.samples]:
                await self.training.discard(rest, RUN_ENDED)
            pending: set[asyncio.Future[Any]] = {p for p in plays if not p.done()}
            if not pending and not self.pool.size():
                return
            async with asyncio.TaskGroup() as tg:  # owns the waiter: a group added, or a play
                added = tg.create_task(self.pool.wait_added())  # done, whichever comes first
                await asyncio.wait({added, *pending}, return_when=asyncio.FIRST_COMPLETED)
                added.cancel()

    @property
    def slots(self) -> int:
        """Episodes the gate lets run at once (whole batches: `max_concurrent_groups` is 0)."""
        return self.groups_out.limit * self.config.group_size

    @property
    def groups_per_step(self) -> int:
        return self.config.batch_size // self.config.group_size

    async def _take_groups(self, b: int) -> tuple[BatchResult, float, int, list[Episode]]:
        """Partial rollouts: groups done, the oldest first, whatever batch started them. Step `b`
        trains the tokens sampled at `b - max_policy_lag` or later (the trainer masks older ones
        out of the loss: `ActorTraining`); a group with no token that recent is dropped whole.
        With `algorithm.filter_groups`, a group whose episodes all scored alike is dropped too
        while the done groups left still cover what the step needs: skipping never makes a step
        wait (it spends only the rollout's surplus), and a policy that always fails still makes
        steps."""
        t0 = time.perf_counter()
        chosen: list[DoneGroup] = []
        stale: list[DoneGroup] = []
        alike: list[DoneGroup] = []
        skip = self.config.algorithm.filter_groups
        while len(chosen) < self.groups_per_step:
            g = await self.pool.wait_take()
            if 0 <= g.last_version < b - self.config.max_policy_lag:
                dropped, reason = stale, STALE
            elif (skip and g.scored_alike
                  and self.pool.size() >= self.groups_per_step - len(chosen)):
                dropped, reason = alike, NO_SIGNAL
            else:
                chosen.append(g)
                continue
            # a dropped group leaves the dock and frees its place at once (the trained ones
            # once their step is out): the step may need the groups that place lets start
            dropped.append(g)
            if g.result.samples:
                await self.training.discard([g.group_id], reason)
            await self.groups_out.done(1)
        first = max(min(g.done_at for g in chosen), t0)
        wait = max(max(g.done_at for g in chosen) - first, 0.0)
        res = BatchResult(batch=b, episodes=[e for g in chosen for e in g.result.episodes],
                          samples=sum(g.result.samples for g in chosen),
                          seconds=max(g.result.seconds for g in chosen),
                          row_groups=[g.group_id for g in chosen if g.result.samples])
        return res, wait, len(stale), [e for g in alike for e in g.result.episodes]

    async def _learn(self, b: int, res: BatchResult, wait_s: float, stale: int,
                     filtered: list[Episode], last: float) -> float:
        """Train on batch `b`, publish the weights as version b + 1, record the step."""
        s = self.state
        progress = max(self.clock() / self.time_limit_s, (b + 1) / self.config.steps)
        scale = self.lr_scale(progress)
        new_errors = add_failures(s.failures, res.episodes)
        if res.samples == 0:
            raise NothingToTrain(b, res)
        step = f"step {b + 1}"
        with self.watchdog.waiting(f"{step}'s layout (selector)"):
            async with self.selection.train(b, res):
                with self.watchdog.waiting(f"{step}'s training (the trainer's lease on the dock: "
                                   "scored by the reference; fetch; optimizer step)"):
                    # batch b's own groups, never the oldest ready: a group re-played after
                    # a fault can come back after the next batch's, and a step that trained
                    # those instead would leave the checkpoint of step b + 1 without batch b
                    # (a rewind to it would lose the group)
                    metrics = await self.training.train(
                        b, res.samples, scale, list(dict.fromkeys(res.row_groups)))
                with self.watchdog.waiting(f"{step}'s weight push to the rollout"):
                    await self.training.publish(b + 1)
        if self.partial:  # new groups start under the weights this step made
            await self.groups_out.done(self.groups_per_step)
        self.selection.trained(b, metrics)
        with self.watchdog.waiting(f"{step}'s policy version to the producers"):
            await self.production.note_version(b + 1)
        await self.gate.advance(b + 1)
        s.step = b + 1
        s.episodes += len(res.episodes)
        self.watchdog.step_done()
        now = self.clock()
        if self.observe is not None:
            with self.watchdog.waiting(f"{step}'s metrics (the observer)"):
                await self.observe(StepRecord(
                    version=s.step, result=res, train=metrics, step_s=now - last,
                    lr_scale=scale, straggler_wait_s=wait_s, stale_groups=stale,
                    filtered=filtered,
                    slots=self.slots, new_errors=new_errors,
                    groups_running=self.groups_out.out - self.pool.size() if self.partial
                    else 0))
        if s.step % self.config.checkpoint_every == 0 and s.step < self.config.steps:
            # partial rollouts: the critic has seen groups in the order they finished
            with self.watchdog.waiting(f"the checkpoint of step {s.step}"):
                await self.checkpoints.save(s, None if self.partial else b)
        return now

    async def _after_step(self) -> str:
        """Validation eval when due; returns the stop reason, or "" to go on."""
        c, s = self.config, self.state
        if c.eval_every > 0 and self.evaluation is not None and s.step % c.eval_every == 0:
            async with self.selection.using():
                with self.watchdog.waiting(f"the validation eval after step {s.step} (producers)"):
                    ev = await self.evaluation.evaluate("validation", s.step)
            ev.update(step=float(s.step), minutes=self.clock() / 60)
            s.evals.append(ev)
            value = ev.get(self.target_key, float("-inf"))
            if value > s.best[1]:
                s.best = (s.step, value)
            if self.on_eval is not None:
                await self.on_eval(ev)
            if c.target and value >= c.target:
                return "target"
        if self.clock() > self.time_limit_s:
            return "time_limit"
        return ""
