"""Runs that heal themselves: restart limits, rebuilding a restarted actor, and rewinds.

The runtime's supervisors restart a dead actor process under its `RestartPolicy`; this module
is the driver's side of it. A `Healer` watches the directory for each restart of the rollout,
producer and reference groups and rebuilds the new process' state before the loop uses it
again:

- rollout: the trainer's weights are pushed again at the current policy version (producers'
  `HealingEngine`, `earl.stages.healing_engine`, refuses generations from a replica that went
  back to older weights);
- producer: its policy version and its critic (from the last checkpoint) are restored, its
  dock shard is dropped from the index, and the groups it held are played again
  (`Dock.take_lost`; the batch it was playing is re-played by `HealingProduction`);
- reference: its shard is dropped too, which costs only the ``ref_logprobs`` it held (the
  dock forgets them and the new process scores those samples again), and its `serve_dock`
  loop is started again (`serve_reference`).

The trainer and the dock's index hold state no other process has (optimizer, leases), so their
death rewinds the run: every actor is stopped and the job resumes in-process from the last
checkpoint (`run_job`). Each restart and rewind counts against `HealingConfig.max_restarts`,
appears in the metrics (`restarts/<group>`) and in the trace. Past the limit the run stops with
one clear line and `earl train --resume` continues it.

Which actor died is read from the failure's fields (`died_actor`: `ActorDied.group`/`rank`, the
deaths an `ActorError` carries across the wire, a `DockFetchError`'s shard), never from error
messages: rewording a message cannot turn healing off.

Not here: the wrappers of the loop's parts (`earl.loop.healing_parts`), process supervision
itself (`earl.runtime.supervisor`), or fault injection (`earl.commands.chaos`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from earl.loop.ledger import Ledger
from earl.runtime.config import RestartPolicy
from earl.runtime.errors import ActorDied, ActorError, deaths_in

if TYPE_CHECKING:
    from pathlib import Path

    from earl.loop.job import Job
    from earl.loop.result import RunResult
    from earl.observe import Tracer

__all__ = ["HEALED", "REWOUND", "Healer", "HealingConfig", "HealingError", "Ledger",
           "died_actor", "run_job"]

HEALED = ("rollout", "producer", "reference")  # restarted in place, state rebuilt
REWOUND = ("trainer", "dock")                    # the run resumes from the last checkpoint


@dataclass(kw_only=True, slots=True)
class HealingConfig:
    """How a run's healer waits (how often it heals is the run's `max_restarts`).

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


Rebuild = Callable[[int], Awaitable[None]]


class Healer:
    """The driver's bookkeeping of restarts: watchers, rebuild hooks, limits, metrics, trace."""

    def __init__(self, config: HealingConfig | None = None, *, max_restarts: int = 3,
                 log: Callable[[str], None], tracer: Tracer | None = None,
                 ledger: Path | None = None) -> None:
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
        self.config, self.log, self.tracer = config or HealingConfig(), log, tracer
        self.max_restarts = max_restarts  # per actor rank, and rewinds per run
        self.restarts: dict[str, int] = {}
        self.rewinds = 0
        self.version = 0              # the policy version the rollout actors must serve
        self.events: list[dict[str, object]] = []
        self.ledger = Ledger(ledger)  # written only where a run is judged (`earl chaos`)
        self.rebuilds: dict[str, Rebuild] = {}
        self._rebuilt: dict[tuple[str, int], int] = {}  # (group, rank) -> restarts rebuilt
        self._stop = asyncio.Event()
        self.stopping = False         # the run is ending: deaths now are not healed
        self.stage: dict[str, str] = {}  # "group[rank]" -> the rebuild step in progress
        self.active_at = 0.0  # time.monotonic() of the last event or restart seen (watchdog)
        self.watched = False  # `watch` ran in this attempt (a death before it rewinds it)
        self._rt: Any = None  # while `watch` runs: the runtime, its task group, its watchers
        self._tg: asyncio.TaskGroup | None = None
        self._watchers: dict[tuple[str, int], asyncio.Task[None]] = {}

    def policy(self, group: str) -> RestartPolicy:
        """The supervisor's policy for `group` (rewound groups are not restarted in place)."""
        n = self.max_restarts if group in HEALED else 0
        return RestartPolicy(max_restarts=n, backoff_s=self.config.backoff_s)

    # ---- records -------------------------------------------------------------------------
    def note(self, what: str, group: str, **info: object) -> None:
        """One healing event: counted, logged, traced."""
        t = time.perf_counter()
        self.active_at = time.monotonic()
        self.events.append({"event": what, "actor": group, "t": t, **info})
        if self.tracer is not None:
            self.tracer.add(what, actor=group, start=t, end=t, **info)

    def metrics(self) -> dict[str, float]:
        """`restarts/<group>` for every group restarted so far, and `rewinds`."""
        out = {f"restarts/{g}": float(n) for g, n in sorted(self.restarts.items())}
        if self.rewinds:
            out["rewinds"] = float(self.rewinds)
        return out

    # ---- watching restarts ---------------------------------------------------------------
    async def watch(self, rt: Any, groups: dict[str, int]) -> None:
        """Rebuild every restart of `groups` (name -> ranks) until `close`; run it as a task.
        A group re-created or resized meanwhile is followed with `follow`."""
        self.watched = True
        async with asyncio.TaskGroup() as tg:
            self._rt, self._tg = rt, tg
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
        """End `watch` (the run is over or being rewound): deaths from now on are not healed."""
        self._stop.set()
        self.stopping = True

    def reopen(self) -> None:
        self._stop = asyncio.Event()
        self._rebuilt.clear()
        self.stopping = False
        self.watched = False

    async def _watch_rank(self, name: str, rank: int, current: bool = False) -> None:
        rt, seen = self._rt, 0
        if current:  # a group just (re)built: its restarts so far need no rebuild
            rec = await rt.dir_call("lookup", name)
            seen = rec.restarts[rank] if rec is not None and rank < len(rec.restarts) else 0
            self._rebuilt[(name, rank)] = seen
        while True:
            if not await rt.dir_call("wait_status", name, rank, "up", 3600.0, seen + 1):
                continue
            rec = await rt.dir_call("lookup", name)
            seen = rec.restarts[rank]
            self.restarts[name] = self.restarts.get(name, 0) + 1
            self.active_at = time.monotonic()
            t0 = time.perf_counter()
            self.log(f"healing: {name}[{rank}] restarted ({rec.reasons[rank] or 'died'}); "
                     f"restart {seen}/{self.max_restarts}, rebuilding its state")
            try:
                if name in self.rebuilds:
                    await self.rebuilds[name](rank)
            except Exception as exc:  # noqa: BLE001 - a failed rebuild is reported, not fatal here
                self.log(f"healing: rebuilding {name}[{rank}] failed: {exc}")
                self.note("rebuild_failed", name, rank=rank, error=str(exc)[:200])
            self.note("restart", name, rank=rank, restarts=seen,
                      rebuild_s=round(time.perf_counter() - t0, 3))
            self._rebuilt[(name, rank)] = seen

    async def wait_rebuilt(self, rt: Any, name: str, rank: int) -> None:
        """After a call to `name[rank]` failed with its death: wait until a restarted process
        is up and rebuilt.

        Raises:
            HealingError: the actor is dead for good (restart limit), not back in `wait_s`,
                or the run is ending (no restart is rebuilt then).
        """
        deadline = time.monotonic() + self.config.wait_s
        while True:
            if self.stopping:
                raise HealingError(f"{name}[{rank}] died while the run was ending")
            rec = await rt.dir_call("lookup", name)
            if rec is None or rank >= len(rec.status):
                raise HealingError(f"{name}[{rank}] is gone")
            if rec.status[rank] == "dead":
                raise HealingError(
                    f"{name}[{rank}] died and was not restarted ({rec.reasons[rank]}; restart "
                    f"limit {self.max_restarts})")
            if rec.status[rank] == "up" and rec.restarts[rank] > 0 \
                    and self._rebuilt.get((name, rank), 0) >= rec.restarts[rank]:
                return
            if time.monotonic() > deadline:
                where = self.stage.get(f"{name}[{rank}]", "")
                raise HealingError(f"{name}[{rank}] was not back within {self.config.wait_s:g} s"
                                   + (f" (rebuild stuck at: {where})" if where else ""))
            await asyncio.sleep(0.05)

    async def serve_reference(self, rt: Any, serve: Callable[[], Awaitable[object]]) -> None:
        """Keep the reference's `serve_dock` loop running across its restarts, and across
        a lease that failed because a producer's shard died under it (the lease expires; the
        dock reports the lost groups, which are re-played)."""
        retries = 0
        while not self.stopping:
            try:
                await serve()
                return
            except Exception as exc:
                who = died_actor(exc)
                if self.stopping:
                    return
                if who is not None and who[0] in REWOUND:
                    raise
                if who is not None and who[0] == "reference":
                    try:
                        await self.wait_rebuilt(rt, *who)
                    except HealingError:
                        if self.stopping:
                            return
                        raise
                    continue
                retries += 1
                if not isinstance(exc, ActorError) or retries > 50:
                    raise
                self.note("reference_retry", "reference", error=str(exc).splitlines()[0][:200])
                await asyncio.sleep(0.2)

    async def stop_reference(self, stop: Callable[[], Awaitable[object]]) -> None:
        self.stopping = True
        with contextlib.suppress(ActorDied, ActorError):
            await stop()


async def run_job(job: Job, resume: bool) -> RunResult:
    """One attempt of `job` (`earl.loop.main.train_attempt`), and another from the last
    checkpoint each time the trainer or the dock dies, the run stalls (`Stalled`: no step
    and no healing event within its limit, `earl.loop.watchdog`), or an actor dies while the
    attempt starts (spawn, restore: before its healer watches, nothing rebuilds it in place).

    Raises:
        HealingError: past the rewind limit (the original error, a death or the `Stalled`
            naming the stage the run waited in, is its cause).
    """
    from earl.loop.checkpoint import MANIFEST
    from earl.loop.main import train_attempt
    from earl.loop.watchdog import stalled_in

    healer = job.healer
    try:
        while True:
            try:
                return await train_attempt(job, resume)
            except Exception as exc:
                who = died_actor(exc)
                stall = stalled_in(exc) if who is None else None
                starting = who is not None and who[0] in HEALED and not healer.watched
                if stall is None and not starting and (who is None or who[0] not in REWOUND):
                    raise
                what = f"the run stalled: {stall}" if who is None else \
                    f"{who[0]}[{who[1]}] died" + (" while the attempt started" if starting
                                                  else "")
                healer.close()
                if healer.rewinds >= healer.max_restarts:
                    raise HealingError(f"{what}, and the run was already rewound "
                                       f"{healer.rewinds} time(s) (limit "
                                       f"{healer.max_restarts})") from exc
                healer.rewinds += 1
                if who is not None:
                    healer.restarts[who[0]] = healer.restarts.get(who[0], 0) + 1
                else:
                    assert stall is not None
                    healer.note("stall", "driver", stage=stall.stage,
                                idle_s=round(stall.idle_s, 1), healing=stall.healing,
                                dock=stall.detail)
                await job.stop_actors()
                manifest = job.out / "checkpoint" / MANIFEST
                resume = manifest.is_file()
                step = int(json.loads(manifest.read_text())["step"]) if resume else 0
                healer.ledger.rewind(step)
                healer.note("rewind", who[0] if who is not None else "driver",
                            rank=who[1] if who is not None else 0, to_step=step)
                job.log(f"healing: {what}; restarting the run's actors from the checkpoint "
                        f"of step {step} (rewind {healer.rewinds}/{healer.max_restarts})")
                healer.reopen()
    finally:
        job.close()
