"""The run's supervisor: it owns every restart and rewind, their limits and their records.

Like a Trio nursery with a restart policy, it sits over the stage groups
(`earl.loop.stages`): the runtime's process supervisors restart a dead rank under the policy
the supervisor gives its stage (`policy`), and the supervisor rebuilds the new process' state
before the loop uses it again (`watch`, with each stage's `rebuild`). A stage that heals in
place (rollout, producer, reference) is restarted and rebuilt; a death of one that holds state
no other process has (trainer, dock) rewinds the run: every actor is stopped and the run
resumes in-process from the last checkpoint (`supervise`). So does a stall (`Stalled`,
`earl.loop.watchdog`) and a death while an attempt starts (before `watch` runs, nothing would
rebuild it).

The loop's parts never count or assign any of this: a call that failed with a death waits
for the group to be healed (`wait_healed`) and is retried, or sees a typed `HealingError`.
Each restart and rewind counts against `max_restarts` within `window_s` (an Erlang supervisor's
intensity over its period: a long run survives faults that come now and then, one that
crash-loops stops), appears in the metrics
(`restarts/<group>`, `rewinds`), in the trace and in `events`. Which actor died is read from
the failure's fields (`died_actor`), never from error messages.

Not here: what each stage rebuilds (`earl.loop.stages`), process supervision itself
(`earl.runtime.supervisor`), the retries of the loop's parts (`earl.loop.production`,
`earl.loop.training`), fault injection (`earl.commands.chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from earl.loop.ledger import Ledger
from earl.runtime.config import RestartPolicy
from earl.runtime.errors import ActorDied, ActorError, deaths_in

if TYPE_CHECKING:
    from pathlib import Path

    from earl.observe import Tracer

__all__ = ["HealingConfig", "HealingError", "Supervisor", "died_actor"]

R = TypeVar("R")
Rebuild = Callable[[str, int], Awaitable[None]]


@dataclass(kw_only=True, slots=True)
class HealingConfig:
    """How the supervisor waits (how often it heals is the run's `max_restarts`).

    Attributes:
        backoff_s: delay before a rank's first restart (doubles per restart, see RestartPolicy).
        wait_s: how long a part waits for a restarted actor to be rebuilt.
    """

    backoff_s: float = 0.2
    wait_s: float = 300.0


class HealingError(RuntimeError):
    """A fault the run could not heal (restart limit reached, actor gone for good)."""


def died_actor(exc: BaseException) -> tuple[str, int] | None:
    """(group, rank) of the actor whose death caused `exc`, if any.

    The nearest death `earl.runtime.errors.deaths_in` finds (through exception groups, causes,
    the deaths a remote `ActorError` carries, a `DockFetchError`'s warehouse) that names one
    rank; a rank its owner stopped is no death to heal.
    """
    for d in deaths_in(exc):
        if d.rank is not None and d.cause != "stopped":
            return d.group, d.rank
    return None


class Supervisor:
    """Restarts and rewinds of one run (see the module docstring).

    Each stage group is adopted as it is spawned (`adopt`), saying how a death of one of its
    ranks heals: "in_place" (restarted and rebuilt) or "rewind" (the run resumes from its last
    checkpoint).

    Args:
        max_restarts: restarts per rank, and rewinds per run, within `window_s`.
        window_s: the span restarts and rewinds count over (0: the run's life).
        clock: seconds, monotonic (a test's fake; the runtime's restarts keep their own).
        log: one line per healing event, for the person running it.
        tracer: where events are traced (None: not traced).
        ledger: the file of the sample ledger (None: none kept; `earl.loop.ledger`).
        rt: the runtime whose directory it watches.
    """

    def __init__(self, config: HealingConfig | None = None, *,
                 max_restarts: int = 3, window_s: float = 0.0, log: Callable[[str], None],
                 tracer: Tracer | None = None, ledger: Path | None = None,
                 rt: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.config, self.log, self.tracer = config or HealingConfig(), log, tracer
        self._heals: dict[str, str] = {}  # stage -> "in_place" | "rewind" (`adopt`)
        self.max_restarts, self.window_s, self.clock = max_restarts, window_s, clock
        self.rt = rt
        self.ledger = Ledger(ledger)  # written only where a run is judged (`earl chaos`)
        self.version = 0  # the policy version the rollout serves (`set_version`)
        self._restarts: dict[str, int] = {}
        self._rewinds = 0
        self._rewound_at: list[float] = []  # time.monotonic() of each rewind
        self._events: list[dict[str, object]] = []
        self._rebuilding: dict[str, str] = {}  # "group[rank]" -> its rebuild's step now
        self._rebuilt: dict[tuple[str, int], int] = {}  # (group, rank) -> restarts rebuilt
        self._stop = asyncio.Event()
        self._stopping = False
        self._watched = False
        self._active_at = 0.0
        self._tg: asyncio.TaskGroup | None = None
        self._rebuild: Rebuild | None = None
        self._watchers: dict[tuple[str, int], asyncio.Task[None]] = {}

    # ---- what others read ----------------------------------------------------------------
    @property
    def restarts(self) -> Mapping[str, int]:
        """Restarts (and rewinds caused by a death) per group so far."""
        return dict(self._restarts)

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages adopted so far, in the order they were."""
        return tuple(self._heals)

    @property
    def rewinds(self) -> int:
        return self._rewinds

    @property
    def events(self) -> list[dict[str, object]]:
        """Every healing event so far (a copy): restart, rewind, stall, replay, retry..."""
        return list(self._events)

    @property
    def stopping(self) -> bool:
        """The attempt is ending: deaths now are not healed."""
        return self._stopping

    @property
    def watched(self) -> bool:
        """`watch` runs in this attempt (before it, a death rewinds the attempt)."""
        return self._watched

    @property
    def active_at(self) -> float:
        """time.monotonic() of the last event or restart seen (the watchdog's progress)."""
        return self._active_at

    @property
    def rebuilding(self) -> dict[str, str]:
        """What each rebuild in progress is doing ("producer[0]" -> its step)."""
        return dict(self._rebuilding)

    def adopt(self, stage: str, heals: str) -> RestartPolicy:
        """Supervise `stage`'s group from now on: a death of one of its ranks is healed
        `heals` ("in_place" or "rewind"). Returns the restart policy to spawn it with."""
        if heals not in ("in_place", "rewind"):
            raise ValueError(f"heals must be 'in_place' or 'rewind', got {heals!r}")
        self._heals[stage] = heals
        return self.policy(stage)

    def policy(self, stage: str) -> RestartPolicy:
        """The runtime's restart policy for `stage`'s ranks (a rewound stage: no restart)."""
        n = self.max_restarts if self._in_place(stage) else 0
        return RestartPolicy(max_restarts=n, window_s=self.window_s,
                             backoff_s=self.config.backoff_s)

    def _limit(self) -> str:
        per = f" per {self.window_s / 60:g} min" if self.window_s else ""
        return f"limit {self.max_restarts}{per}"

    def _in_place(self, stage: str) -> bool:
        return self._heals.get(stage) == "in_place"

    def _rewound(self, stage: str) -> bool:
        return self._heals.get(stage) == "rewind"

    def metrics(self) -> dict[str, float]:
        """`restarts/<group>` for every group restarted so far, and `rewinds`."""
        out = {f"restarts/{g}": float(n) for g, n in sorted(self._restarts.items())}
        if self._rewinds:
            out["rewinds"] = float(self._rewinds)
        return out

    # ---- what parts tell it --------------------------------------------------------------
    def note(self, what: str, group: str, **info: object) -> None:
        """One healing event: counted, traced, and progress for the watchdog."""
        t = time.perf_counter()
        self._active_at = time.monotonic()
        self._events.append({"event": what, "actor": group, "t": t, **info})
        if self.tracer is not None:
            self.tracer.add(what, actor=group, start=t, end=t, **info)

    def set_version(self, version: int) -> None:
        """The rollout serves policy `version` now (a restarted replica is given it)."""
        self.version = version

    @contextlib.contextmanager
    def step(self, who: str, what: str) -> Iterator[None]:
        """A rebuild of `who` ("producer[0]") is at `what` while the body runs (a stall
        names it)."""
        before = self._rebuilding.get(who)
        self._rebuilding[who] = what
        try:
            yield
        finally:
            if before is None:
                self._rebuilding.pop(who, None)
            else:
                self._rebuilding[who] = before

    def checkpoint_failed(self, step: int, exc: Exception) -> bool:
        """A checkpoint of `step` failed with `exc`. A full disk (any `OSError`) or an
        in-place stage's death is reported and the run goes on, the previous checkpoint in
        force (True); a rewound stage's death is not (False: it rewinds the run)."""
        if not isinstance(exc, OSError | ActorError | ActorDied):
            return False
        who = died_actor(exc)
        if who is not None and not self._in_place(who[0]):
            return False
        why = str(exc).splitlines()[0][:300]
        self.note("checkpoint_failed", "driver", step=step, error=why)
        self.log(f"healing: checkpoint at step {step} failed ({why}); the previous checkpoint "
                 "stays in force, the run goes on")
        return True

    # ---- watching restarts ---------------------------------------------------------------
    async def watch(self, groups: dict[str, int], rebuild: Rebuild) -> None:
        """Rebuild (`rebuild(group, rank)`) every restart of `groups` (name -> ranks) until
        `close`; run it as a task. A group re-created or resized meanwhile is followed with
        `follow`."""
        self._watched, self._rebuild = True, rebuild
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            for name, n in groups.items():
                for rank in range(n):
                    self._watchers[(name, rank)] = tg.create_task(self._watch_rank(name, rank))
            await self._stop.wait()
            for t in self._watchers.values():
                t.cancel()
        self._tg, self._watchers = None, {}

    def follow(self, name: str, ranks: int) -> None:
        """`name` was re-created or resized (a selector move) and has `ranks` ranks now: watch
        each of them from the restart count it has now (what the move built needs no
        rebuild; a re-created group's counts start again at 0). No-op outside `watch`."""
        if self._tg is None:
            return
        for key in [k for k in self._watchers if k[0] == name]:
            self._watchers.pop(key).cancel()
            self._rebuilt.pop(key, None)
        for rank in range(ranks):
            self._watchers[(name, rank)] = self._tg.create_task(
                self._watch_rank(name, rank, current=True))

    def close(self) -> None:
        """End `watch` (the attempt is over or being rewound): deaths are not healed now."""
        self._stop.set()
        self._stopping = True

    async def _watch_rank(self, name: str, rank: int, current: bool = False) -> None:
        rt, seen = self.rt, 0
        if current:  # a group just (re)built: its restarts so far need no rebuild
            rec = await rt.dir_call("lookup", name)
            seen = rec.restarts[rank] if rec is not None and rank < len(rec.restarts) else 0
            self._rebuilt[(name, rank)] = seen
        while True:
            if not await rt.dir_call("wait_status", name, rank, "up", 3600.0, seen + 1):
                continue
            rec = await rt.dir_call("lookup", name)
            seen = rec.restarts[rank]
            self._restarts[name] = self._restarts.get(name, 0) + 1
            self._active_at = time.monotonic()
            t0 = time.perf_counter()
            self.log(f"healing: {name}[{rank}] restarted ({rec.reasons[rank] or 'died'}); "
                     f"restart {seen} ({self._limit()}), rebuilding its state")
            try:
                assert self._rebuild is not None
                await self._rebuild(name, rank)
            except Exception as exc:  # noqa: BLE001 - a failed rebuild is reported, not fatal here
                self.log(f"healing: rebuilding {name}[{rank}] failed: {exc}")
                self.note("rebuild_failed", name, rank=rank, error=str(exc)[:200])
            self.note("restart", name, rank=rank, restarts=seen,
                      rebuild_s=round(time.perf_counter() - t0, 3))
            self._rebuilt[(name, rank)] = seen

    async def wait_healed(self, name: str, rank: int) -> None:
        """After a call to `name[rank]` failed with its death: wait until a restarted process
        is up and rebuilt.

        Raises:
            HealingError: the actor is dead for good (restart limit), not back in `wait_s`,
                or the attempt is ending (no restart is rebuilt then).
        """
        deadline = time.monotonic() + self.config.wait_s
        while True:
            if self._stopping:
                raise HealingError(f"{name}[{rank}] died while the run was ending")
            rec = await self.rt.dir_call("lookup", name)
            if rec is None or rank >= len(rec.status):
                raise HealingError(f"{name}[{rank}] is gone")
            if rec.status[rank] == "dead":
                raise HealingError(
                    f"{name}[{rank}] died and was not restarted ({rec.reasons[rank]}; restart "
                    f"{self._limit()})")
            if rec.status[rank] == "up" and rec.restarts[rank] > 0 \
                    and self._rebuilt.get((name, rank), 0) >= rec.restarts[rank]:
                return
            if time.monotonic() > deadline:
                where = self._rebuilding.get(f"{name}[{rank}]", "")
                raise HealingError(f"{name}[{rank}] was not back within {self.config.wait_s:g} s"
                                   + (f" (rebuild stuck at: {where})" if where else ""))
            await asyncio.sleep(0.05)

    async def serve(self, stage: str, serve: Callable[[], Awaitable[object]]) -> None:
        """Keep a stage's serving loop (the reference's `serve_dock`) running across its
        restarts, and across a lease that failed because a producer's shard died under it (the
        lease expires; the dock reports the lost groups, which are re-played)."""
        retries = 0
        while not self._stopping:
            try:
                await serve()
                return
            except Exception as exc:
                who = died_actor(exc)
                if self._stopping:
                    return
                if who is not None and self._rewound(who[0]):
                    raise
                if who is not None and who[0] == stage:
                    try:
                        await self.wait_healed(*who)
                    except HealingError:
                        if self._stopping:
                            return
                        raise
                    continue
                retries += 1
                if not isinstance(exc, ActorError) or retries > 50:
                    raise
                self.note(f"{stage}_retry", stage, error=str(exc).splitlines()[0][:200])
                await asyncio.sleep(0.2)

    async def stop_serving(self, stop: Callable[[], Awaitable[object]]) -> None:
        self._stopping = True
        with contextlib.suppress(ActorDied, ActorError):
            await stop()

    # ---- rewinds -------------------------------------------------------------------------
    async def supervise(self, attempt: Callable[[bool], Awaitable[R]], resume: bool, *,
                        stop: Callable[[], Awaitable[None]],
                        checkpoint_step: Callable[[], int | None]) -> R:
        """Run `attempt(resume)`, and again from the last checkpoint (`checkpoint_step()`:
        its step, None without one) after `stop()` each time the trainer or the dock dies,
        the run stalls, or an actor dies while the attempt starts.

        Raises:
            HealingError: past the rewind limit (the original error, a death or the `Stalled`
                naming the stage the run waited in, is its cause).
        """
        from earl.loop.watchdog import stalled_in

        while True:
            try:
                return await attempt(resume)
            except Exception as exc:
                # a stall first: the deaths in its context were being healed when progress
                # stopped, so whatever died, the remedy is the rewind
                stall = stalled_in(exc)
                who = died_actor(exc) if stall is None else None
                starting = who is not None and self._in_place(who[0]) and not self._watched
                if stall is None and not starting and (who is None or not self._rewound(who[0])):
                    raise
                what = f"the run stalled: {stall}" if who is None else \
                    f"{who[0]}[{who[1]}] died" + (" while the attempt started" if starting
                                                  else "")
                self.close()
                now = self.clock()
                self._rewound_at = [t for t in self._rewound_at
                                    if not self.window_s or now - t < self.window_s]
                if len(self._rewound_at) >= self.max_restarts:
                    raise HealingError(f"{what}, and the run was already rewound "
                                       f"{len(self._rewound_at)} time(s) "
                                       f"({self._limit()})") from exc
                self._rewound_at.append(now)
                self._rewinds += 1
                if who is not None:
                    self._restarts[who[0]] = self._restarts.get(who[0], 0) + 1
                else:
                    assert stall is not None
                    self.note("stall", "driver", stage=stall.stage,
                              idle_s=round(stall.idle_s, 1), healing=stall.healing,
                              dock=stall.detail)
                await stop()
                step = checkpoint_step()
                resume = step is not None
                step = step or 0
                self.ledger.rewind(step)
                self.note("rewind", who[0] if who is not None else "driver",
                          rank=who[1] if who is not None else 0, to_step=step)
                self.log(f"healing: {what}; restarting the run's actors from the checkpoint "
                         f"of step {step} (rewind {self._rewinds}, {self._limit()})")
                self._reopen()

    def _reopen(self) -> None:
        self._stop = asyncio.Event()
        self._rebuilt.clear()
        self._stopping = False
        self._watched = False
