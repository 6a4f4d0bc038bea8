"""The fault injector of `earl chaos`: fires each fault of a schedule at its point of the run
and checks, in the background, that the run recovered from it (the report's `faults`).

The run calls it through its `RunHooks` (`after_step`, `before_checkpoint`). What each fault
does is listed in `earl.commands.chaos`; how a schedule is drawn from a seed is
`earl.commands.chaos_draw`. Not here: the run, its report and its invariants
(`earl.commands.chaos`, `earl.commands.chaos_oracle`).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.commands.chaos_attacks import http_status, open_files_limit, plant_shm_names, slowloris
from earl.commands.chaos_faults import (
    corrupt,
    cut_when_busy,
    delay_requests,
    fill,
    healed_count,
    until,
)
from earl.commands.chaos_oracle import lose_a_sample

if TYPE_CHECKING:
    from earl.commands.chaos_draw import Drawn

__all__ = ["NEEDS_RUN", "Injector", "resave_recovered"]

# faults whose healing the run must go on for: the next fault must not hold it meanwhile
NEEDS_RUN = ("kill:trainer", "kill:dock", "kill:resave", "drop:producer", "drop:reference")


class Injector:
    """Injects `faults`, spread over the steps: fault i is fired after step `plan[i]` is
    logged, at a random point of the next step (a uniform fraction of the recent step time),
    once fault i - 1 has healed. A `drawn` schedule (`earl.commands.chaos_draw`) says instead
    after which step, at which fraction of a step, and whether it waits for the previous one.
    The step after must wait until it was fired, so a fast run cannot outrun its faults;
    whether the run recovered is checked in the background. The run calls it through its
    `RunHooks` (`after_step`, `before_checkpoint`)."""

    def __init__(self, job: Any, rt: Any, faults: list[str], *, seed: int, disk: str,
                 stall: Path | None = None, drawn: Drawn | None = None,
                 due_s: list[float] | None = None) -> None:
        import random

        self.job, self.rt, self.faults, self.disk, self.stall = job, rt, faults, disk, stall
        self.rng = random.Random(seed)
        self.done: list[dict[str, Any]] = []
        self.pids: set[int] = set()
        span = max(job.cfg.steps - 2, 1)
        self.plan = [1 + (i * span) // max(len(faults), 1) for i in range(len(faults))]
        if "kill:resave" in faults:  # it needs a checkpoint in force: after the first one
            i = faults.index("kill:resave")
            self.plan[i] = max(self.plan[i], job.cfg.checkpoint_every)
        self.at: list[float] | None = None  # drawn: the fraction of a step each waits
        self.overlap = [False] * len(faults)
        if drawn is not None:
            assert list(drawn.faults) == faults
            self.plan, self.at = list(drawn.after_step), list(drawn.at)
            self.overlap = list(drawn.overlap)
        # a soak (`earl.commands.chaos_soak`): fault i is due `due_s[i]` s after the first step
        self.due_s, self._first = due_s, 0.0
        if due_s is not None:
            assert len(due_s) == len(faults)
            self.plan = [2**62] * len(faults)  # set to the step after which each came due
        self.fired = [asyncio.Event() for _ in faults]
        # ready to fire: a drop waits for the run's next call from then on (others: fired)
        self.armed = [asyncio.Event() for _ in faults]
        self.settled = [asyncio.Event() for _ in faults]  # one fault at a time
        self.tasks: list[asyncio.Task[None]] = []
        self._last, self._dt, self._next = 0.0, 0.2, 0
        self._running = 0  # groups still playing at the last step's end (partial rollouts)
        self._disk_full_armed = False  # the next trainer save fails as a full disk would

    @property
    def due(self) -> int:
        """How many faults came due (fired or being fired)."""
        return self._next

    async def before_checkpoint(self, folder: str) -> None:
        if self._disk_full_armed:
            import errno

            self._disk_full_armed = False
            raise OSError(errno.ENOSPC, "No space left on device (injected)", folder)

    async def after_step(self, record: Any) -> None:
        """After each trained step is logged: fire what is due, hold the run until it is
        (a drop: until it is armed, since it fires on the run's next call to its actor; once
        fired, until its actor is back).

        The run is not held for a fault whose firing waits, through the faults before it, for
        what only the run going on brings (`waits_on_run`)."""
        step = int(record.version)
        self._running = int(getattr(record, "groups_running", 0))
        if self._last:  # the step's own time, without the holds (the previous call's waits)
            self._dt = 0.5 * self._dt + 0.5 * (time.perf_counter() - self._last)
        await self._collect_pids()
        if self.due_s is not None:
            self._first = self._first or time.perf_counter()
            now = time.perf_counter() - self._first
            for i in range(self._next, len(self.faults)):
                if self.plan[i] == 2**62 and self.due_s[i] <= now:
                    self.plan[i] = step
        while self._next < len(self.faults) and self.plan[self._next] <= step:
            i, self._next = self._next, self._next + 1
            # a drop and kill:rollout_span wait for calls in flight themselves, from now
            delay = 0.0 if self.faults[i].startswith(("kill:rollout_span", "drop:")) else \
                self.rng.uniform(0.0, max(self._dt, 0.05)) if self.at is None else \
                self.at[i] * max(self._dt, 0.05)
            self.tasks.append(asyncio.ensure_future(self._fire(i, step, delay)))
        for i in range(self._next):
            if self.plan[i] < step and not self.waits_on_run(i):
                await (self.armed if self.faults[i].startswith("drop:") else self.fired)[i].wait()
            if self.faults[i].startswith("drop:") and self.plan[i] + 1 < step \
                    and self.fired[i].is_set():
                await self.settled[i].wait()
        self._last = time.perf_counter()

    def waits_on_run(self, i: int) -> bool:
        """Whether fault `i` cannot fire before the run goes on: it waits for fault i - 1 to
        heal and that healing needs the run (`NEEDS_RUN`: a rewind is seen by the next step's
        call to the dead trainer or dock; a dropped actor's rebuild re-plays into the dock),
        or (overlapping) for fault i - 1 to fire and that is a drop (it fires on the run's
        next call to its actor), or fault i - 1 cannot fire yet for the same reasons; or
        fault i is kill:resave and no checkpoint is in force yet (it re-saves the one in
        force, and only the run's next checkpoint brings one: seeds 316 and 336 of `--draw 3
        --steps 8`, a producer killed during the checkpoint of step 2, held the run at step
        3 until the watchdog rewound it)."""
        if self.faults[i] == "kill:resave" and not self.fired[i].is_set() \
                and not self._checkpoint_in_force():
            return True
        if i == 0:
            return False
        prev = self.faults[i - 1]
        if self.overlap[i]:
            if self.fired[i - 1].is_set():
                return False
            if prev.startswith("drop:"):
                return True
        else:
            if self.settled[i - 1].is_set():
                return False
            if prev in NEEDS_RUN:
                return True
        return self.waits_on_run(i - 1)

    def _checkpoint_in_force(self) -> bool:
        from earl.loop.checkpoint import MANIFEST

        return (Path(self.job.out) / "checkpoint" / MANIFEST).is_file()

    async def _requests_in_flight(self, timeout: float = 60.0) -> int:
        """Wait (up to `timeout` s) until the rollout has generations in flight, right after a
        weight push; returns how many it had."""
        group = await self.rt.lookup("rollout")
        deadline = time.monotonic() + timeout
        while (n := (await group[0].statistics.call_one()).in_flight) == 0 \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        return n

    async def _collect_pids(self) -> None:
        for name in ("rollout", "producer", "reference", "dock", "trainer"):
            rec = await self.rt.dir_call("lookup", name)
            if rec is not None:
                self.pids.update(p for p in rec.pids if p)

    async def _fire(self, i: int, step: int, delay: float) -> None:
        if i > 0:  # after the previous fault healed, or (overlapping) was fired
            await (self.fired if self.overlap[i] else self.settled)[i - 1].wait()
        await asyncio.sleep(delay)
        fault = self.faults[i]
        rec: dict[str, Any] = {"fault": fault, "after_step": step, "delay_s": round(delay, 3)}
        t = time.perf_counter()
        try:
            rec.update(await self._inject(i))
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected
            rec.update(recovered=False, note=f"not injected: {exc}")
        finally:
            self.armed[i].set()
            self.fired[i].set()
            self.settled[i].set()
        rec["seconds"] = round(time.perf_counter() - t, 2)
        self.done.append(rec)

    async def wait(self, timeout: float) -> None:
        """Let the recovery checks of fired faults finish (at most `timeout` s)."""
        for ev in self.armed + self.fired + self.settled:
            ev.set()  # a fault not fired by now never will be
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=timeout)
            for t in pending:
                t.cancel()

    async def _inject(self, i: int) -> dict[str, Any]:
        fault, fired, sup = self.faults[i], self.fired[i], self.job.supervisor
        target = fault.split(":", 1)[1] if fault.startswith(("kill:", "drop:", "hang:")) \
            else "producer"
        target = "rollout" if target == "rollout_span" else target
        if target != "resave" and not await self._wait_live(target, 300.0):
            return {"recovered": False, "note": f"{target} not up within 300 s"}
        if fault == "kill:resave":
            return await self._kill_resave(fired)
        if fault == "squat:shm":
            return await self._squat_shm(fired)
        if fault == "slowloris":
            return await self._slowloris(fired)
        if fault.startswith("kill:"):
            name = "rollout" if fault == "kill:rollout_span" else fault[5:]
            running = self._running
            in_flight = await self._requests_in_flight() if fault == "kill:rollout_span" else 0
            rec = await self.rt.dir_call("lookup", name)
            pid = rec.pids[0]
            # counted in the supervisor's events: a restart event's own `restarts` is the
            # runtime's count for the actor, which starts again at 0 with each rewind's actors
            before = (healed_count(sup.events, "restart", name),
                      healed_count(sup.events, "rewind"))
            os.kill(pid, 9)
            fired.set()
            # healed: rebuilt in place, or (the trainer, the dock, any actor while an attempt
            # starts) rewound and the new attempt's supervisor watching (its actors up)
            ok = await until(lambda: healed_count(sup.events, "restart", name) > before[0] or (
                healed_count(sup.events, "rewind") > before[1] and sup.watched), 300)
            if fault == "kill:rollout_span":  # it must have hit sessions spanning the push
                return {"pid": pid, "groups_running": running, "requests_in_flight": in_flight,
                        "recovered": ok and in_flight > 0}
            return {"pid": pid, "recovered": ok}
        if fault.startswith("drop:"):
            return await self._drop(i, fault[5:])
        if fault.startswith("hang:"):
            return await self._hang(fault[5:], fired)
        if fault == "corrupt_frame":
            rec = await self.rt.dir_call("lookup", "producer")
            pid, addr = rec.pids[0], rec.addresses[0]
            await corrupt(addr, self.rng)
            fired.set()
            await asyncio.sleep(0.5)
            after = await self.rt.dir_call("lookup", "producer")
            group = await self.rt.lookup("producer")
            answers = await group[0].evaluate.call_one([], "probe") == []
            return {"pid": pid, "answers": answers,
                    "recovered": after.pids[0] == pid and after.status[0] == "up" and answers}
        if fault == "delay":
            fired.set()
            self.settled[i].set()
            n = await delay_requests(2.0, self.rng)
            return {"delayed": n, "recovered": True}
        if fault == "disk_full":
            return await self._disk_full(i)
        if fault == "lose:sample":
            lost: list[str] = []
            undo = lose_a_sample(lost)
            fired.set()
            ok = await until(lambda: bool(lost), 120)
            undo()
            return {"lost_on_purpose": lost, "recovered": ok}
        if fault == "stall:tool":
            return await self._stall_tool(fired)
        raise ValueError(fault)

    async def _stall_tool(self, fired: asyncio.Event) -> dict[str, Any]:
        """Hang the probe tool until sessions came back with errors (at most 120 s), then
        lift the stall. Recovered: the stalled calls came back while the stall was still on
        (by event order: not released by the lift), all of them as timeouts, and the run went
        on (checked by the caller). `longest_wait_s` reports how long they waited."""
        assert self.stall is not None
        timeout = float(self.job.cfg.tool_timeout_s)
        errors = Path(f"{self.stall}.errors")

        def seen() -> list[tuple[float, str]]:
            lines = errors.read_text().split() if errors.is_file() else []
            return [(float(w), e) for w, e in zip(lines[::2], lines[1::2], strict=True)]

        self.stall.touch()
        fired.set()
        ok = await until(lambda: bool(seen()), 120)
        self.stall.unlink(missing_ok=True)
        stalled = seen()
        longest = max((w for w, _ in stalled), default=0.0)
        return {"stalled_calls": len(stalled), "longest_wait_s": round(longest, 2),
                "tool_timeout_s": timeout,
                "recovered": ok and all(e == "timeout" for _, e in stalled)}

    async def _drop(self, i: int, name: str) -> dict[str, Any]:
        """Cut the driver's connection to `name[0]` with a call in flight (`cut_when_busy`:
        the one in flight now, or the run's next call to it; armed from then on, waits up to
        60 s): the runtime must kill and restart the live process, and the supervisor rebuild it,
        as after a SIGKILL."""
        sup, fired = self.job.supervisor, self.fired[i]
        rec = await self.rt.dir_call("lookup", name)
        pid, addr = rec.pids[0], rec.addresses[0]
        before = healed_count(sup.events, "restart", name)
        self.armed[i].set()  # the run may go on: the next call to `name[0]` is cut
        try:
            async with asyncio.timeout(60.0):
                # a restarted actor's connection opens with the run's first call to it
                while (conn := self.rt.pool.get_nowait(addr)) is None:
                    await asyncio.sleep(0.005)
                busy = await cut_when_busy(conn)
        except TimeoutError:
            return {"pid": pid, "calls_in_flight": 0, "recovered": False,
                    "note": f"no call to {name}[0] within 60 s"}
        fired.set()
        ok = await until(lambda: healed_count(sup.events, "restart", name) > before, 300)
        after = await self.rt.dir_call("lookup", name)
        return {"pid": pid, "calls_in_flight": busy, "new_pid": after.pids[0],
                "recovered": ok and after.pids[0] != pid}

    async def _hang(self, name: str, fired: asyncio.Event) -> dict[str, Any]:
        """SIGSTOP `name[0]`: alive and connected, it answers nothing, so no death is seen.
        Recovered: the run's watchdog saw the stall (a "stall" event naming its stage) and
        the run was rewound (which stops the frozen process)."""
        import signal

        sup = self.job.supervisor

        before = (healed_count(sup.events, "stall"), healed_count(sup.events, "rewind"))
        pid = (await self.rt.dir_call("lookup", name)).pids[0]
        os.kill(pid, signal.SIGSTOP)
        fired.set()
        # the rewind's event comes once the frozen process is stopped
        ok = await until(lambda: healed_count(sup.events, "stall") > before[0]
                         and healed_count(sup.events, "rewind") > before[1]
                         and sup.watched, 900)
        if not ok:
            os.kill(pid, signal.SIGKILL)
        stage = [e for e in sup.events if e["event"] == "stall"][-1]["stage"] if ok else ""
        return {"pid": pid, "stage": stage, "recovered": ok}

    async def _disk_full(self, i: int) -> dict[str, Any]:
        fired, sup = self.fired[i], self.job.supervisor
        folder = Path(self.job.out) / "checkpoint"
        filler = folder / ".filler"
        before = len([e for e in sup.events if e["event"] == "checkpoint_failed"])
        if self.disk:
            fill(filler)
        else:  # no tmpfs (not root): the trainer's next save raises ENOSPC
            self._disk_full_armed = True
        fired.set()
        self.settled[i].set()
        ok = await until(lambda: len([e for e in sup.events
                                       if e["event"] == "checkpoint_failed"]) > before, 300)
        filler.unlink(missing_ok=True)
        return {"recovered": ok, "mode": "tmpfs" if self.disk else "injected"}


    async def _wait_live(self, name: str, timeout: float) -> bool:
        """Wait until every rank of `name` is up (a rewind re-spawns every group)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rec = await self.rt.dir_call("lookup", name)
            if rec is not None and rec.pids and all(s == "up" for s in rec.status):
                return True
            await asyncio.sleep(0.1)
        return False

    async def _squat_shm(self, fired: asyncio.Event) -> dict[str, Any]:
        """Recovered: names were planted while the run made segments, and no actor failed."""
        before = dict(self.job.supervisor.restarts), self.job.supervisor.rewinds
        attack = plant_shm_names(max(4.0, 3 * self._dt))
        await asyncio.to_thread(attack.wait_ready)
        fired.set()
        res = await asyncio.to_thread(attack.result, 120.0)
        after = dict(self.job.supervisor.restarts), self.job.supervisor.rewinds
        return {"as_uid": attack.as_user, "planted": res.get("planted", 0),
                "recovered": res.get("planted", 0) > 0 and after == before}

    async def _slowloris(self, fired: asyncio.Event) -> dict[str, Any]:
        """Recovered: while the attack holds more half-sent requests than the producer may open
        files (for 40 s), a new request to its endpoint is answered within 30 s (401: it has no
        key), the producer answers its RPC, the server closed every attack connection before
        the attacker let go, and no actor failed."""
        import psutil

        rec = await self.rt.dir_call("lookup", "producer")
        pid = rec.pids[0]
        ports = sorted({c.laddr.port for c in psutil.Process(pid).net_connections("tcp")
                        if c.status == psutil.CONN_LISTEN and c.laddr.ip == "127.0.0.1"})
        if not ports:
            return {"recovered": False, "note": "the producer listens on no loopback port"}
        before = dict(self.job.supervisor.restarts), self.job.supervisor.rewinds
        n = open_files_limit(pid) + 500
        attacks = [a for port in ports for a in slowloris(port, n, 40.0)]
        for a in attacks:
            await asyncio.to_thread(a.wait_ready)
        fired.set()
        answered = [await http_status(port, 30.0) for port in ports]
        group = await self.rt.lookup("producer")
        rpc = await group[0].evaluate.call_one([], "probe") == []
        res = [await asyncio.to_thread(a.result, 120.0) for a in attacks]
        after = dict(self.job.supervisor.restarts), self.job.supervisor.rewinds
        opened = sum(r.get("opened", 0) for r in res)
        closed = sum(r.get("closed_by_server", 0) for r in res)
        return {"as_uid": attacks[0].as_user, "ports": ports, "connections": opened,
                "closed_by_server": closed, "answered": answered, "producer_rpc": rpc,
                "recovered": all(answered) and rpc and 0 < opened == closed
                and after == before}

    async def _kill_resave(self, fired: asyncio.Event) -> dict[str, Any]:
        """Save the checkpoint in force again, SIGKILL the trainer while it writes, and check
        the rewind that follows starts from that checkpoint (the run's own recovery)."""
        from earl.loop.checkpoint import MANIFEST, CheckpointStore

        job, sup = self.job, self.job.supervisor

        def rewinds() -> list[dict[str, Any]]:
            return [e for e in sup.events if e["event"] == "rewind"]

        root = Path(job.out) / "checkpoint"
        if not await until(lambda: (root / MANIFEST).is_file(), 300):
            return {"recovered": False, "note": "no checkpoint in force within 300 s"}
        # the trainer and the rewinds as they are now: a rewind while no checkpoint was in
        # force replaced the trainer, and is not this fault's
        if not await self._wait_live("trainer", 300.0):
            return {"recovered": False, "note": "trainer not up within 300 s"}
        pid = (await self.rt.dir_call("lookup", "trainer")).pids[0]
        before = len(rewinds())
        run_store = job.checkpoints()  # the run's own saves, the trainer killed as it starts

        async def killed_midway(folder: str) -> None:
            os.kill(pid, 9)
            fired.set()
            await run_store.save_trainer(folder)

        store = CheckpointStore(root, save_trainer=killed_midway,
                                save_producers=run_store.save_producers, wall=job.elapsed)
        state, _, _ = store.load()
        try:
            await store.save(state, None)
        except Exception:  # noqa: BLE001, S110 - the trainer died under it: expected
            pass
        fired.set()
        ok = await until(lambda: len(rewinds()) > before and sup.watched, 300)
        to = rewinds()[-1].get("to_step") if ok else None
        return {"pid": pid, "step_in_force": state.step, "rewound_to": to,
                "recovered": resave_recovered(state.step, to)}


def resave_recovered(step_in_force: int, rewound_to: int | None) -> bool:
    """A kill during a re-save of the checkpoint in force is healed when the run rewound to
    that checkpoint, or to one the run itself saved while the fault ran (its step-end save
    races the re-save): never to an older one, which would mean the re-save damaged it."""
    return rewound_to is not None and rewound_to >= step_in_force
