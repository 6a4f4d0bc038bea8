"""The parallelism selector inside the RL loop: decide before each stage, apply to live actors.

`Selection` is the part `earl.loop.schedule.Schedule` calls when `--selector on`:
`rollout(b)` wraps the play of batch b, `train(b, result)` its training step and weight push,
`using()` anything else that talks to the rollout replicas (validation evals). Before a rollout
the policy (`earl.runtime.selector.Policy`) decides with ``when="rollout"``, before training
(experience preparation) with ``when="prep"``, from the live context-length statistics of the
episodes (p50/p95/max and trend), the dock's queue depths and the slots' memory. Every decision
becomes a metrics row (``selector/*`` keys) and a Perfetto instant event.

The first decision (`start`) is taken before the rollout replicas exist, so the run spawns them
with its plan instead of re-creating them. A decided plan is turned into a `Setting` (what the
live actors run) and applied through a `Reconfigurer` (`earl.loop.selection_actors`): a new
micro-batch budget or recompute at once (nothing restarts), a new layout, slots or context by
re-creating the actors that changed. The rollout's context only grows (a restart to shrink it
gains nothing). Re-creations wait until no play, push or eval is using the actors (a
readers-writer lock): samples already played stay in the dock, which is not touched.

Not here: the decision itself (`earl.runtime.selector.policy`), what a plan sets
(`earl.loop.setting`), re-creating actors
(`earl.stages.reconfigure`; `earl.loop.selection_actors` wires it to a run's actor groups).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol

from earl.loop.setting import Setting, keep_places, moves, setting_of, with_rollout_of
from earl.runtime import ActorDied, ActorError
from earl.runtime.selector import (
    ContextStats,
    ContextTracker,
    Decision,
    Parallel,
    Policy,
    RunProfile,
)
from earl.stages.batch_types import BatchResult

__all__ = ["Reconfigurer", "ReferenceProgress", "Selection", "SelectionStatistics", "Setting",
           "keep_places", "setting_of"]


class Reconfigurer(Protocol):
    """Applies settings to the live actors (`earl.loop.selection_actors.ActorReconfigurer`)."""

    async def set_micro_batch_tokens(self, tokens: int) -> None:
        """The trainer's next steps use this micro-batch token budget (no restart)."""
        ...

    async def set_recompute(self, on: bool) -> None:
        """The trainer's ranks recompute activations in the backward from now on, or stop
        (no restart)."""
        ...

    async def apply(self, old: Setting, new: Setting) -> dict[str, float]:
        """Re-create the actors whose layout, slots or context changed; returns seconds by
        phase, keyed "<actor>/<phase>_s" (e.g. "trainer/save_s", "rollout/spawn_s")."""
        ...


class ReferenceProgress(NamedTuple):
    """The reference group since it started, summed over its ranks: tokens scored and busy
    seconds; `peak_mib`: its ranks' largest memory peak since the last reading (0: not
    measured); `token_budget`: padded tokens per forward pass."""

    tokens: int
    busy_s: float
    peak_mib: float = 0.0
    token_budget: int = 0


class _Training(NamedTuple):
    """A batch in training: the setting it trains with, its longest trajectory, its
    trajectories' tokens and their token-weighted length (`Selection.trained`)."""

    setting: Setting
    longest: int
    played: int
    typical: int


@dataclass(frozen=True, slots=True)
class SelectionStatistics:
    decisions: int = 0
    reconfigurations: int = 0
    budget_changes: int = 0
    recompute_changes: int = 0
    trainer_layout_changes: int = 0  # trainer dp x tp changed (group re-created, resharded)
    rollout_layout_changes: int = 0  # rollout replicas x tp changed
    device_moves: int = 0  # slots whose holder changed (rollout, trainer, reference or none)
    reconfig_seconds: dict[str, float] = field(default_factory=dict)  # phase -> total seconds


class _SharedExclusive:
    """Readers-writer lock, writers first: many plays/pushes/evals at once, or one change."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writers = 0  # waiting or holding

    @contextlib.asynccontextmanager
    async def shared(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: self._writers == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers += 1
            await self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._writers -= 1
                self._cond.notify_all()


class Selection:
    """Runs the policy before each rollout and training step and applies its plans.

    Args:
        policy: the selector policy (its `PolicyConfig.actors` names "trainer" and/or "rollout").
        reconfigurer: applies settings to the actors.
        setting: what the actors run at the start.
        slots: slot name -> memory bytes now (`SlotPool.budgets`).
        queues: the dock's queue depths per stage ("train", "reference").
        max_context: the model's longest context (cap of the rollout's max_model_len).
        record: gets each decision's metrics row and each reconfiguration's seconds.
        trace: gets each decision (the run adds it to its Perfetto trace).
        log: one line per applied change.
        initial_context: the longest context assumed before any episode is measured (None:
            half the starting window, i.e. the start fits; a run passes the model's positions:
            plan for the worst case until measured, since growing later costs a vLLM start).
        profile: the run's live profile, given to the policy as its `measured` (None: no
            measuring): each batch's rollout and training step are recorded into it at the
            setting they ran with.
        equal_devices: the slots are interchangeable devices (`placement.devices`): a plan's
            devices are re-assigned so that each stage keeps its own (`keep_places`).
        context_steps: the steps whose longest trajectory the policy plans for
            (`ContextTracker.window`).
        device_peak: the largest memory peak (MiB) charged to any of the given devices since
            its last call (None: not measured). A stage's measured memory is then what its
            devices were charged, the budget the kernel enforces, instead of the peak its
            ranks report (a resident set counts pages charged elsewhere: what a warm host
            imported, shared libraries).
    """

    CUT = 0.7
    GROW = 4.0
    # steps after a change (or the start) not measured end to end: new processes warm up and
    # the pipeline refills (on the gauntlet the six steps after a move ran 1.0 s each, the
    # next ones 0.7 s at the same contexts)
    SETTLE_STEPS = 6

    def __init__(self, policy: Policy, reconfigurer: Reconfigurer, *, setting: Setting,
                 slots: Callable[[], Mapping[str, float]],
                 queues: Callable[[], Awaitable[Mapping[str, int]]], max_context: int,
                 record: Callable[[dict[str, float | int | str]], None] = lambda r: None,
                 trace: Callable[[Decision], None] = lambda d: None,
                 log: Callable[[str], None] = lambda line: None,
                 initial_context: int | None = None, profile: RunProfile | None = None,
                 equal_devices: bool = False, context_steps: int = 5,
                 reference_progress: Callable[[], Awaitable[ReferenceProgress]] | None = None,
                 device_peak: Callable[[tuple[str, ...]], float | None] | None = None
                 ) -> None:
        self.policy, self.reconfigurer, self.setting = policy, reconfigurer, setting
        self.equal_devices = equal_devices
        self.slots, self.queues, self.max_context = slots, queues, max_context
        self.record, self.trace, self.log = record, trace, log
        self.profile = profile
        self.reference_progress = reference_progress
        self.device_peak = device_peak
        self._unsettled: set[str] = set()  # devices moved since their peak was last read
        # actors re-created since they last started a batch, and the batches they started
        # first: those warm up (new processes or engines) and their rates go unmeasured
        self._fresh: set[str] = set()
        self._warming: set[tuple[str, int]] = set()
        self._reference_seen = (0, 0.0)  # tokens scored, busy seconds: at the last step
        self.tracker = ContextTracker(window=context_steps)
        c = setting.max_model_len // 2 if initial_context is None else initial_context
        self.contexts = ContextStats(p50=c, p95=c, max=c)  # before any episode
        self._lock = _SharedExclusive()
        self._decide_lock = asyncio.Lock()
        self._stats = SelectionStatistics()
        self._played: dict[int, Setting] = {}  # batch -> the setting it was played with
        self._training: dict[int, _Training] = {}  # batches in training
        self._busy: dict[int, float] = {}  # batch -> rollout seconds it alone accounts for
        self._last_end = float("-inf")  # when the latest play ended
        self.decisions: list[Decision] = []
        self._started: int | None = None  # the batch whose rollout decision `start` took
        # end-to-end steps for the policy (`observe_step`): when the last step ended, and how
        # many steps after a change go unmeasured (the change and new actors' warm-up)
        self._step_end: float | None = None
        self._unmeasured = self.SETTLE_STEPS
        self._observe(tokens=0.0, seconds=0.0, context=0)  # steps will come end to end

    def statistics(self) -> SelectionStatistics:
        return self._stats

    def observe(self, result: BatchResult) -> ContextStats:
        """Feed one batch's trajectory lengths (failed episodes included: they held memory).

        A truncated trajectory within `CUT` of the window its batch was played with was most
        likely cut by it (its next turn did not fit): its true length is unknown, so it counts
        as needing `GROW` times that window (each re-creation costs a vLLM start: grow boldly).
        """
        played = self._played.pop(result.batch, self.setting)
        window = played.max_model_len
        lengths = [max(e.tokens, int(window * self.GROW))
                   if e.truncated and e.tokens >= self.CUT * window else e.tokens
                   for e in result.episodes if e.tokens > 0]
        warming = ("rollout", result.batch) in self._warming
        self._warming.discard(("rollout", result.batch))
        if lengths:
            self.contexts = self.tracker.observe(lengths)
            if self.profile is not None and not warming:  # tokens per second of busy rollout
                longest = max(e.tokens for e in result.episodes)
                share = -(-len(result.episodes) // played.rollout_replicas)  # per replica
                self.profile.record("rollout", played.rollout_parallel(), longest,
                                    tokens=sum(e.tokens for e in result.episodes),
                                    seconds=self._busy.pop(result.batch, result.seconds),
                                    batch_tokens=min(played.kv_tokens, share * longest))
        return self.contexts

    async def start(self, batch: int, spawn: Callable[[Setting], Awaitable[None]]) -> None:
        """The decision before batch `batch`'s rollout, taken before the rollout replicas exist.

        `spawn(setting)` starts them with the decided window, KV budget, layout and slots (a
        plan applied at spawn costs no re-creation); then the trainer's part of the plan is
        applied like any later change (its budget, or a re-created group). The next
        `rollout(batch)` does not decide again.
        """
        async with self._decide_lock:
            d, new, queues = await self._decide(batch, "rollout")
            self.log(f"selector: first plan: rollout tp{new.rollout_tp} x{new.rollout_replicas} "
                     f"on {list(new.rollout_slots)}, trainer tp{new.trainer_tp}/dp"
                     f"{new.trainer_dp} on {list(new.trainer_slots)} (from "
                     f"{list(self.setting.rollout_slots)}, {list(self.setting.trainer_slots)})")
            first: dict[str, float] = {}
            if set(new.rollout_slots) & (set(self.setting.trainer_slots)
                                         | set(self.setting.reference_slots)):
                # the rollout starts in a device the trainer (or reference) gives up: it moves
                # first
                first = await self._apply(with_rollout_of(new, self.setting), decision=False)
            await spawn(new)
            self.setting = with_rollout_of(self.setting, new)
            times = await self._apply(new)
            self._record(d, queues, {k: first.get(k, 0.0) + times.get(k, 0.0)
                                     for k in first.keys() | times.keys()})
        self._started = batch

    @contextlib.asynccontextmanager
    async def rollout(self, batch: int) -> AsyncIterator[None]:
        """Decide (when="rollout") and apply, then hold the actors while batch `batch` plays."""
        if self._started == batch:  # decided at spawn (`start`)
            self._started = None
        else:
            await self._decide_and_apply(batch, "rollout")
        async with self._lock.shared():
            self._played[batch] = self.setting
            self._first_batch("rollout", batch)
            start = time.perf_counter()
            try:
                yield
            finally:
                # the rollout's busy time for this batch: plays overlap (max_policy_lag), so
                # count from the end of the previous play to finish, or from this start
                end = time.perf_counter()
                self._busy[batch] = end - max(start, min(self._last_end, end))
                self._last_end = max(self._last_end, end)

    @contextlib.asynccontextmanager
    async def train(self, batch: int, result: BatchResult) -> AsyncIterator[None]:
        """Observe batch `batch`'s contexts, decide (when="prep") and apply, then hold the
        actors while it trains and its weights are pushed."""
        self.observe(result)
        await self._decide_and_apply(batch, "prep")
        async with self._lock.shared():
            total = sum(e.tokens for e in result.episodes)
            self._training[batch] = _Training(
                self.setting, max((e.tokens for e in result.episodes), default=0), total,
                sum(e.tokens ** 2 for e in result.episodes) // max(total, 1))
            self._first_batch("trainer", batch)
            self._first_batch("reference", batch)
            yield
            await self._record_reference(batch, self._training[batch])

    def _first_batch(self, actor: str, batch: int) -> None:
        """`batch` is the first `actor` runs since it was re-created: its time goes unmeasured
        (a new trainer rank's first step took 1.4 s, its third 0.6 s: priced by the first, the
        layout it had just moved to looked 4x slower and the selector moved back)."""
        if actor in self._fresh:
            self._fresh.discard(actor)
            self._warming.add((actor, batch))

    async def _record_reference(self, batch: int, training: _Training
                                ) -> None:
        """The reference's tokens and busy seconds since the last step, into the profile at
        its layout (its ranks score in parallel). Counters that went down were a re-created
        group's: what it did is all new. Its first batch since re-created goes unmeasured."""
        setting, longest = training.setting, training.longest
        warming = ("reference", batch) in self._warming
        self._warming.discard(("reference", batch))
        if self.profile is None or self.reference_progress is None or not longest:
            return
        try:
            got = await self.reference_progress()
        except (ActorDied, ActorError):  # a rank restarting: this step goes unmeasured
            return
        seen_t, seen_b = self._reference_seen
        self._reference_seen = (got.tokens, got.busy_s)
        if got.tokens < seen_t or got.busy_s < seen_b:
            seen_t, seen_b = 0, 0.0
        if warming:
            return
        ranks = max(1, len(setting.reference_slots))
        peak, whole = self._peak(setting.reference_slots, got.peak_mib)
        # a forward pass holds as many sequences as `token_budget` padded tokens, one at least
        self.profile.record("reference", Parallel(dp=ranks), longest,
                            tokens=got.tokens - seen_t, seconds=(got.busy_s - seen_b) / ranks,
                            batch_tokens=max(longest, got.token_budget),
                            peak_bytes=peak * 2**20 if peak else None, whole_device=whole)

    def _peak(self, devices: tuple[str, ...], reported: float | None
              ) -> tuple[float | None, bool]:
        """A stage's memory peak (MiB) since the last step: its devices' charged peak (all a
        device holds: True), else what its ranks reported (a CUDA allocator's peak leaves out
        the context and the cache: False). None for the first step after a move brought one
        of `devices` to this stage: its peak counts what the device's last holder held."""
        charged = self.device_peak(devices) if self.device_peak and devices else None
        if charged is not None and self._unsettled & set(devices):
            self._unsettled -= set(devices)
            return None, False
        return (charged, True) if charged is not None else (reported, False)

    def trained(self, batch: int, metrics: Mapping[str, float]) -> None:
        """Record batch `batch`'s training step into the profile at the setting it ran with:
        its ``step_time_s`` and ``peak_rss_mib`` (per rank), and as its tokens the batch's
        trajectory tokens, the rollout's unit (a step also trains replayed samples, the
        trainer's ``tokens``: with the gauntlet's self-imitation 1.3-1.8x the batch's, which
        priced the trainer that much faster against the rollout than it keeps up)."""
        setting, longest, played, typical = self._training.pop(batch,
                                                                _Training(self.setting, 0, 0, 0))
        self._step_done(played, typical)
        if ("trainer", batch) in self._warming:  # its devices' peak is read at the next step
            self._warming.discard(("trainer", batch))
            return
        if self.profile is None or not longest:
            return
        tokens = int(metrics.get("tokens", 0))
        per_rank = -(-tokens // max(1, setting.trainer_dp))
        peak, whole = self._peak(setting.trainer_slots, metrics.get("peak_rss_mib"))
        self.profile.record("train", setting.trainer_parallel(), longest,
                            tokens=played or tokens,
                            seconds=float(metrics.get("step_time_s", 0.0)),
                            batch_tokens=max(longest, min(setting.micro_batch_tokens, per_rank)),
                            peak_bytes=peak * 2**20 if peak else None,
                            whole_device=whole)

    def _step_done(self, tokens: int, context: int) -> None:
        """A training step ended: its batch's trajectory tokens over the loop's seconds since
        the previous one, and their token-weighted length, to a policy that takes them
        (`observe_step`: `SearchPolicy` compares plans by them); with seconds 0 where a change
        came in between or shortly before (`SETTLE_STEPS`)."""
        now, last = time.perf_counter(), self._step_end
        self._step_end = now
        # seconds 0: a step that ran, unmeasured
        seconds = now - last if self._unmeasured == 0 and last is not None else 0.0
        self._unmeasured = max(0, self._unmeasured - 1)
        if tokens > 0:
            self._observe(tokens=tokens, seconds=seconds, context=context)

    def _observe(self, *, tokens: float, seconds: float, context: int) -> None:
        observe = getattr(self.policy, "observe_step", None)
        if observe is not None:
            observe(tokens=tokens, seconds=seconds, context=context)

    def using(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Hold the actors (no re-creation meanwhile), e.g. for a validation eval (the step
        it runs in is not measured end to end)."""
        self._unmeasured = max(self._unmeasured, 1)
        return self._lock.shared()

    async def _decide_and_apply(self, batch: int, when: str) -> None:
        async with self._decide_lock:  # one decision at a time (the policy has state)
            d, new, queues = await self._decide(batch, when)
            self._record(d, queues, await self._apply(new))

    async def _decide(self, batch: int, when: str) -> tuple[Decision, Setting, Mapping[str, int]]:
        """The policy's decision and the setting that runs it (not applied yet)."""
        queues = await self.queues()
        d = self.policy.decide(step=batch, when=when, contexts=self.contexts,
                               slots=self.slots(), queue_depths=queues)
        self.decisions.append(d)
        self.trace(d)
        if d.shortfall is not None:
            self.log(f"selector: {d.shortfall.message()}")
        if d.plan.feasible:
            return d, setting_of(d.plan, self.setting, max_context=self.max_context,
                                 equal_devices=self.equal_devices), queues
        # nothing is predicted to fit: keep the layouts, grow the window, and train one
        # context per micro-batch, recomputing activations (the least memory without a new
        # layout)
        cur, top = self.setting, min(d.plan.context_bucket, self.max_context)
        mml = max(cur.max_model_len, top)
        return d, replace(cur, max_model_len=mml, kv_tokens=max(cur.kv_tokens, mml),
                          micro_batch_tokens=top, trainer_recompute=True), queues

    def _record(self, d: Decision, queues: Mapping[str, int], times: Mapping[str, float]
                ) -> None:
        st, row = self._stats, d.record()
        row.update({**{f"selector/queue/{k}": v for k, v in queues.items()},
                    "selector/reconfigurations": st.reconfigurations,
                    "selector/reconfig_s": times.get("total_s", 0.0),
                    **{f"selector/reconfig/{k}": v for k, v in times.items()},
                    **{f"selector/applied_{k}": getattr(self.setting, k) for k in (
                        "max_model_len", "micro_batch_tokens", "kv_tokens", "trainer_dp",
                        "trainer_tp", "rollout_replicas", "rollout_tp")},
                    "selector/applied_recompute": int(self.setting.trainer_recompute),
                    "selector/applied_reference_ranks": len(self.setting.reference_slots),
                    **{f"selector/{k}": getattr(st, k) for k in (
                        "trainer_layout_changes", "rollout_layout_changes", "device_moves")},
                    **(self.profile.record_row() if self.profile is not None else {})})
        self.record(row)

    async def _apply(self, new: Setting, *, decision: bool = True) -> dict[str, float]:
        """Apply `new` (re-creating what changed); `decision`: it ends a decision (counted)."""
        old, st = self.setting, self._stats
        times: dict[str, float] = {}
        if changed := new.changed(old):
            # the policy holds the new plan from its decision on: a step that ends while the
            # change waits for the lock or runs ran the old one, and must not count in a trial
            self._unmeasured = self.SETTLE_STEPS
            async with self._lock.exclusive():
                t0 = time.perf_counter()
                times = await self.reconfigurer.apply(old, new)
                times.setdefault("total_s", time.perf_counter() - t0)
            if self.profile is not None:  # what a switch costs, for the next decisions
                self.profile.record_switch(times["total_s"])
            moved = moves(old, new)
            self._unsettled |= moved  # their next peak counts their last holder (`_peak`)
            self._unmeasured = self.SETTLE_STEPS
            self._fresh |= set(changed)
            total = dict(st.reconfig_seconds)
            for k, v in times.items():
                total[k] = total.get(k, 0.0) + v
            st = replace(
                st, reconfigurations=st.reconfigurations + 1, reconfig_seconds=total,
                trainer_layout_changes=st.trainer_layout_changes + int(
                    (new.trainer_tp, new.trainer_dp) != (old.trainer_tp, old.trainer_dp)),
                rollout_layout_changes=st.rollout_layout_changes + int(
                    (new.rollout_tp, new.rollout_replicas) != (old.rollout_tp,
                                                               old.rollout_replicas)),
                device_moves=st.device_moves + len(moved))
            self.log(f"selector: reconfigured in {times['total_s']:.1f} s: trainer tp{new.trainer_tp}"
                     f"/dp{new.trainer_dp} on {list(new.trainer_slots)}, rollout "
                     f"tp{new.rollout_tp} x{new.rollout_replicas} max_model_len "
                     f"{new.max_model_len}"
                     + (f", reference on {list(new.reference_slots)}"
                        if new.reference_slots != old.reference_slots else ""))
        # a kept trainer takes a new budget or recompute live (counted when nothing else
        # changed); a re-created one started with them
        if new.trainer_key() == old.trainer_key():
            if new.micro_batch_tokens != old.micro_batch_tokens:
                await self.reconfigurer.set_micro_batch_tokens(new.micro_batch_tokens)
                st = replace(st, budget_changes=st.budget_changes + int(not changed))
            if new.trainer_recompute != old.trainer_recompute:
                await self.reconfigurer.set_recompute(new.trainer_recompute)
                st = replace(st, recompute_changes=st.recompute_changes + int(not changed))
        self._stats = replace(st, decisions=st.decisions + int(decision))
        self.setting = new
        return times
