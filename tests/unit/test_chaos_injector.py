"""When `earl chaos`'s injector holds the run (`Injector.after_step`), and how a drop cuts a
connection with a call in flight (`cut_when_busy`).

A drop fires on the run's own calls, so the run must not be held for a fault that waits for
the drop to fire (seed 247 of `--draw 3 --steps 8`: a kill overlapping a drop held the run,
the drop saw no call for 30 s), and must be held until the drop is armed, or a fast run ends
before the drop (seed 38: 8 steps in a second while a squat before the drop lasted 4 s). A
poll for calls in flight misses short calls; the cut comes right after the next call is sent.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from earl.commands.chaos_draw import Drawn
from earl.commands.chaos_faults import cut_when_busy
from earl.commands.chaos_injector import Injector

pytestmark = pytest.mark.timeout(60)


def injector(faults: list[str], after: list[int], overlap: list[bool],
             out: Path = Path("/nonexistent")) -> Injector:
    """An injector whose faults fire only when a test sets their events; the run's folder is
    `out`."""
    job = SimpleNamespace(cfg=SimpleNamespace(steps=8, checkpoint_every=2), supervisor=None,
                          out=out)
    drawn = Drawn(faults=tuple(faults), after_step=tuple(after), at=(0.0,) * len(faults),
                  overlap=tuple(overlap))
    inj = Injector(job, None, faults, seed=0, disk="", drawn=drawn)

    async def fire(i: int, step: int, delay: float) -> None:
        await asyncio.Event().wait()

    async def no_pids() -> None:
        return None

    inj._fire = fire  # type: ignore[method-assign]
    inj._collect_pids = no_pids  # type: ignore[method-assign]
    return inj


async def held(inj: Injector, step: int) -> bool:
    """Whether `after_step(step)` holds the run (still waiting after 0.2 s)."""
    task = asyncio.ensure_future(inj.after_step(SimpleNamespace(version=step)))
    done, _ = await asyncio.wait({task}, timeout=0.2)
    if not done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return True
    task.result()
    return False


def done(inj: Injector, i: int) -> None:
    for ev in (inj.armed[i], inj.fired[i], inj.settled[i]):
        ev.set()


async def test_a_kill_overlapping_a_drop_does_not_hold_the_run_before_the_drop_fired() -> None:
    inj = injector(["corrupt_frame", "drop:producer", "kill:producer"], [1, 3, 4],
                   [False, False, True])
    for step in (1, 2, 3):
        done(inj, 0) if step == 2 else None
        assert not await held(inj, step)
    assert await held(inj, 4)  # the drop is due and not armed yet
    inj.armed[1].set()
    assert not await held(inj, 4)
    assert inj.waits_on_run(2)
    assert not await held(inj, 5)  # the kill waits for the drop, which needs the run's calls
    inj.fired[1].set()
    assert not inj.waits_on_run(2)
    inj.settled[1].set()
    assert await held(inj, 6)  # the drop fired: the kill comes next, the run waits for it
    inj.fired[2].set()
    assert not await held(inj, 6)


async def test_the_run_waits_until_a_drop_is_armed_so_it_cannot_outrun_it() -> None:
    inj = injector(["squat:shm", "drop:reference", "kill:resave"], [1, 1, 6],
                   [False, False, False])
    assert not await held(inj, 1)
    inj.fired[0].set()  # the squat goes on; the drop waits for it to end
    assert await held(inj, 2)
    inj.settled[0].set()
    inj.armed[1].set()
    assert not await held(inj, 2)
    assert inj.waits_on_run(2)  # kill:resave waits for the drop's healing: not held for it
    assert not await held(inj, 7)


async def test_kill_resave_does_not_hold_the_run_until_a_checkpoint_is_in_force(
        tmp_path: Path) -> None:
    """Seeds 316 and 336 of `--draw 3 --steps 8`: a producer killed during the checkpoint
    of step 2 failed that checkpoint; kill:resave, due after step 2, waited for a checkpoint
    in force while holding the run at step 3, so none came until the watchdog rewound the run
    (a stall, and the fault judged unrecovered)."""
    inj = injector(["kill:producer", "kill:resave", "stall:tool"], [1, 2, 3],
                   [False, False, False], out=tmp_path)
    assert not await held(inj, 1)
    done(inj, 0)
    assert inj.waits_on_run(1) and inj.waits_on_run(2)
    assert not await held(inj, 3)
    assert not await held(inj, 4)
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "manifest.json").write_text('{"step": 4}')
    assert await held(inj, 5)  # a checkpoint in force: the run waits for the kill
    inj.fired[1].set()
    assert not await held(inj, 5)


class FakeConnection:
    """What `cut_when_busy` reads of `earl.runtime.conn.Connection`."""

    def __init__(self) -> None:
        self.label, self.dead = "producer[0]", None
        self.pending: dict[int, Any] = {}
        self.streams: dict[int, Any] = {}
        self.transport = SimpleNamespace(abort=self.abort)
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1

    def request(self, kind: int, body: bytes, bufs: list[Any]) -> asyncio.Future[Any]:
        fut = asyncio.get_running_loop().create_future()
        self.pending[len(self.pending) + 1] = fut
        return fut


async def test_a_drop_cuts_right_after_the_next_call_is_sent() -> None:
    conn = FakeConnection()
    cut = cut_when_busy(conn)
    await asyncio.sleep(0.05)
    assert not cut.done() and conn.aborted == 0  # nothing in flight: wait for a call
    conn.request(1, b"", [])
    assert await asyncio.wait_for(cut, 1.0) == 1
    assert conn.aborted == 1
    assert "request" not in vars(conn)  # the connection is left as it was


async def test_a_call_answered_before_the_cut_waits_for_the_next_one() -> None:
    conn = FakeConnection()
    cut = cut_when_busy(conn)
    conn.request(1, b"", [])
    conn.pending.clear()  # answered within the same turn of the loop
    await asyncio.sleep(0.05)
    assert not cut.done() and conn.aborted == 0
    conn.request(1, b"", [])
    assert await asyncio.wait_for(cut, 1.0) == 1


async def test_a_drop_with_a_call_in_flight_cuts_at_once_and_can_be_called_off() -> None:
    conn = FakeConnection()
    conn.pending[7] = object()
    cut = cut_when_busy(conn)
    assert cut.done() and cut.result() == 1 and conn.aborted == 1
    idle = FakeConnection()
    off = cut_when_busy(idle)
    off.cancel()
    await asyncio.sleep(0)
    assert "request" not in vars(idle)
    idle.request(1, b"", [])
    await asyncio.sleep(0.05)
    assert idle.aborted == 0


async def test_a_kill_after_a_rewind_is_seen_healed_by_its_restart_event() -> None:
    """A rewind's actors count their restarts from 0 again, while the supervisor's count goes
    on: a kill of the reference after a rewind was healed but judged not recovered (the
    second soak's fault 8, `restarts` 1 in the event against 2 counted before)."""
    victim = await asyncio.create_subprocess_exec("sleep", "60")
    events: list[dict[str, Any]] = [
        {"event": "restart", "actor": "reference", "restarts": 1},  # the first attempt's
        {"event": "rewind", "actor": "trainer"}]
    sup = SimpleNamespace(events=events, restarts={"reference": 2}, rewinds=1, watched=True)
    rec = SimpleNamespace(pids=[victim.pid], status=["up"])

    async def dir_call(op: str, name: str) -> Any:
        return rec

    inj = injector(["kill:reference"], [1], [False])
    inj.job.supervisor, inj.rt = sup, SimpleNamespace(dir_call=dir_call)
    task = asyncio.ensure_future(inj._inject(0))
    await inj.fired[0].wait()
    await victim.wait()
    events.append({"event": "restart", "actor": "reference", "restarts": 1})  # the new actor's
    assert (await task)["recovered"]


def test_a_resave_kill_heals_by_a_rewind_to_the_checkpoint_in_force_or_a_newer_one() -> None:
    """The run's own step-end save can put a newer checkpoint in force while the re-save of
    the older one is killed (the 2-hour soak of 2026-11-30: in force 2010, rewound to 2020, 0
    lost): that is healed; a rewind to an older checkpoint, or none, is not."""
    from earl.commands.chaos_injector import resave_recovered

    assert resave_recovered(2010, 2010) and resave_recovered(2010, 2020)
    assert not resave_recovered(2010, 2000) and not resave_recovered(2010, 0)
    assert not resave_recovered(2010, None)
