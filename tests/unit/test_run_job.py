"""earl.loop.main.run_job's decisions (its supervisor's `supervise`), with a fake job and
attempts: a death while an attempt starts (before the supervisor watches) and a stall are
healed by a rewind to the checkpoint; a death of a healed-in-place actor once the supervisor
watches is not; past `max_restarts` rewinds the run stops with the cause named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from earl.loop import main as loop_main
from earl.loop.main import run_job
from earl.loop.stages import STAGES
from earl.loop.supervisor import HealingError, Supervisor
from earl.loop.watchdog import Stalled, stalled_in
from earl.runtime.errors import ActorDied

pytestmark = pytest.mark.timeout(30)


class FakeJob:
    def __init__(self, out: Path, max_restarts: int = 3) -> None:
        self.out, self.lines = out, []
        self.supervisor = Supervisor(max_restarts=max_restarts, log=self.lines.append)
        for stage in STAGES:
            self.supervisor.adopt(stage.name, stage.heals)
        self.stopped = self.closed = 0

    def checkpoints(self) -> Any:
        class NoCheckpoint:
            def step_in_force(self) -> None:
                return None
        return NoCheckpoint()

    def log(self, line: str) -> None:
        self.lines.append(line)

    async def stop_actors(self) -> None:
        self.stopped += 1

    def close(self) -> None:
        self.closed += 1


def attempts(monkeypatch: pytest.MonkeyPatch, *outcomes: Any) -> list[bool]:
    """`train_attempt` raises each outcome that is an exception (a callable is called first
    with the job: what the attempt did before), then returns "done"; returns the resumes."""
    resumes: list[bool] = []
    todo = list(outcomes)

    async def fake(job: FakeJob, resume: bool) -> str:
        resumes.append(resume)
        step = todo.pop(0) if todo else "done"
        if callable(step) and not isinstance(step, BaseException):
            step = step(job)
        if isinstance(step, BaseException):
            raise step
        return str(step)

    monkeypatch.setattr(loop_main, "train_attempt", fake)
    return resumes


def producer_dies() -> ActorDied:
    return ActorDied("producer[0]", "killed", group="producer", rank=0, cause="killed")


async def test_a_death_while_an_attempt_starts_rewinds_it(monkeypatch, tmp_path) -> None:
    job = FakeJob(tmp_path)
    resumes = attempts(monkeypatch, producer_dies())  # watched stays False: spawn, restore
    assert await run_job(job, False) == "done"  # type: ignore[arg-type]
    assert resumes == [False, False] and job.supervisor.rewinds == 1 and job.stopped == 1
    assert any("while the attempt started" in line for line in job.lines)


async def test_a_death_once_the_supervisor_watches_is_not_rewound(monkeypatch, tmp_path) -> None:
    job = FakeJob(tmp_path)

    def watched_then_dies(j: FakeJob) -> ActorDied:
        j.supervisor._watched = True  # `serving` started the supervisor's watch
        return producer_dies()

    attempts(monkeypatch, watched_then_dies)
    with pytest.raises(ActorDied):
        await run_job(job, False)  # type: ignore[arg-type]
    assert job.supervisor.rewinds == 0


async def test_a_stall_rewinds_and_past_the_limit_stops_naming_the_stage(
        monkeypatch, tmp_path) -> None:
    job = FakeJob(tmp_path, max_restarts=1)
    stall = Stalled("step 3's training", 61.0, 60.0, {"producer[0]": "reproduce_lost"})
    attempts(monkeypatch, ExceptionGroup("tg", [stall]), ExceptionGroup("tg", [stall]))
    with pytest.raises(HealingError, match="step 3's training") as info:
        await run_job(job, False)  # type: ignore[arg-type]
    assert stalled_in(info.value) is stall  # the cause, as data
    assert job.supervisor.rewinds == 1
    (event,) = [e for e in job.supervisor.events if e["event"] == "stall"]
    assert event["stage"] == "step 3's training"


async def test_rewinds_count_within_their_window(monkeypatch, tmp_path) -> None:
    """One rewind allowed per 10 minutes: a stall 11 minutes after the first rewind is rewound
    again; one within the window stops the run, naming the limit."""
    now = [1000.0]

    def job_of() -> FakeJob:
        job = FakeJob(tmp_path, max_restarts=1)
        job.supervisor.window_s, job.supervisor.clock = 600.0, lambda: now[0]
        return job

    job = job_of()
    stall = Stalled("step 3's training", 61.0, 60.0, {})

    def later(minutes: float):  # the attempt ran for `minutes`, then stalled
        def run(j: FakeJob) -> BaseException:
            now[0] += minutes * 60
            return ExceptionGroup("tg", [stall])
        return run

    attempts(monkeypatch, later(1), later(11))
    assert await run_job(job, False) == "done"  # type: ignore[arg-type]
    assert job.supervisor.rewinds == 2
    job = job_of()
    attempts(monkeypatch, later(1), later(5))
    with pytest.raises(HealingError, match=r"limit 1 per 10 min"):
        await run_job(job, False)  # type: ignore[arg-type]


def test_a_rewind_does_not_count_the_time_before_its_checkpoint_twice(tmp_path) -> None:
    """The run's clock (what `time_limit_minutes` bounds) is the time of earlier processes
    (from the checkpoint, on a resume) plus this process' age. A rewind in the same process
    starts from a checkpoint whose saved time this process' age already counts: the soak's
    run stopped at its 2-hour limit after 38 minutes and three rewinds."""
    from types import SimpleNamespace

    from earl.config import RunConfig
    from earl.loop.job import Job
    from earl.loop.schedule import LoopState

    cfg = RunConfig(output_dir=str(tmp_path))
    job = Job(cfg, SimpleNamespace(), "agent:x", None)  # type: ignore[arg-type]
    job.begin(LoopState(step=10, wall_before=100.0), resume=True)  # a resumed process
    first = job.elapsed()
    assert first >= 100.0
    job.begin(LoopState(step=20, wall_before=first + 50.0), resume=True)  # rewound
    assert job.elapsed() - first < 5.0  # not +150 s


async def test_a_stall_after_an_in_place_death_rewinds(monkeypatch, tmp_path) -> None:
    """The 2-hour soak's end: a producer died, its rebuild re-played into a full dock, the run
    stalled; the `Stalled` carried the producer's death in its context, was taken for that
    death (healed in place, not rewound) and ended the run. A stall rewinds, whatever died."""
    job = FakeJob(tmp_path)

    def died_then_stalled(j: FakeJob) -> BaseException:
        j.supervisor._watched = True
        stall = Stalled("step 5043's training", 198.0, 197.0, {"producer[0]": "replay"})
        stall.__context__ = producer_dies()
        return ExceptionGroup("tg", [stall])

    resumes = attempts(monkeypatch, died_then_stalled)
    assert await run_job(job, False) == "done"  # type: ignore[arg-type]
    assert resumes == [False, False] and job.supervisor.rewinds == 1
    assert [e["stage"] for e in job.supervisor.events if e["event"] == "stall"] == [
        "step 5043's training"]
