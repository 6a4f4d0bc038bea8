"""One run's typed context: what it trains, where its files go, and what outlives a rewind.

A `Job` is built once per run (`earl.run.run`, `earl chaos`). It holds the config, the recipe
and the agent's reference, the runtime, the output paths, the actors' environment, the
supervisor, the tracer and the device slots. Each attempt of the run (the first, and one per
rewind, `earl.loop.supervisor.Supervisor.supervise`) spawns its actors and the loop's parts
over them, an `Attempt` (`earl.loop.spawn.spawn_attempt`); the attempt in force is
`Job.attempt`, and its `Actors` say which trainer and rollout are live.

Not here: the loop (`earl.loop.main`), what is spawned (`earl.loop.stages`), restarts and
rewinds (`earl.loop.supervisor`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.config import RunConfig
from earl.loop.checkpoint import CheckpointStore
from earl.loop.devices import device_roles, run_slots
from earl.loop.hooks import RunHooks
from earl.loop.supervisor import Supervisor
from earl.observe import Metrics, Tracer, progress_line
from earl.recipe import Recipe

if TYPE_CHECKING:
    from earl.loop.actors import Actors
    from earl.loop.evaluation import ActorEvaluation
    from earl.loop.production import ActorProduction
    from earl.loop.schedule import LoopState, Selection
    from earl.loop.training import ActorTraining
    from earl.runtime import Runtime
    from earl.runtime.slots import SlotPool

__all__ = ["Attempt", "Job", "process_seconds"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Attempt:
    """An attempt's live actors and the loop's parts over them."""

    actors: Actors
    production: ActorProduction
    training: ActorTraining
    evaluation: ActorEvaluation | None
    selection: Selection  # the selector's, colocation's turns (earl.loop.colocation), or none


def process_seconds() -> float:
    """Wall seconds since this process started (imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


_clock_taken: list[bool] = [False]  # a run in this process has started its clock already


def _clock_origin() -> float:
    """Where a new run's clock starts, in `process_seconds()`: the first run of a process
    counts its start-up (imports included: `time_limit_minutes` is the process' age, as a user
    timing `earl train` sees it); a later run in the same process (a benchmark running several)
    starts at its own beginning."""
    if not _clock_taken[0]:
        _clock_taken[0] = True
        return 0.0
    return process_seconds()


class Job:
    """A run's context (see the module docstring).

    Args:
        cfg: the validated run config.
        recipe: what to train (`earl.resolve.resolve_recipe`).
        agent: the agent's import reference ("module:name" or "path.py:name").
        rt: the runtime the actors run in.
        log: one line per event (evals, healing, new failures) for the person running it;
            every event and step line also goes to `<output_dir>/run.log`.
        progress: each step's metrics row, for a progress display (None: its progress line
            to `log`).
        trace: record a Perfetto trace (`trace.json`).
        hooks: callbacks for fault injection and observers (`RunHooks`).
        start: the HF folder of the starting policy (default: `<output_dir>/weights_start`,
            where the warm start writes it; `earl eval`: the saved policy it evaluates).
    """

    def __init__(self, cfg: RunConfig, recipe: Recipe, agent: str, rt: Runtime, *,
                 log: Callable[[str], None] = print, trace: bool = False,
                 hooks: RunHooks | None = None, start: Path | None = None,
                 progress: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.cfg, self.recipe, self.agent, self.rt = cfg, recipe, agent, rt
        self._log, self._progress = log, progress
        self.hooks = hooks or RunHooks()
        self.out = Path(cfg.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.start = start or self.out / "weights_start"  # the warm start: KL anchor
        self.weights = self.out / "weights"       # the trained policy, written at the end
        self.best_dir = self.out / "weights_best"
        self.env = {"OMP_NUM_THREADS": str(cfg.placement.threads),
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    "TRANSFORMERS_VERBOSITY": "error", **self.hooks.env}
        # placement.transport forces one data-plane transport for every pair ("": by locality)
        if prefer := cfg.placement.transport:
            from earl.runtime.transport.route import ENV_PREFER

            self.env[ENV_PREFER] = prefer
        self.trace = trace
        self.tracer = Tracer(trace, spool=self.out / ".trace.jsonl")  # none held in memory
        self.supervisor = Supervisor(
            max_restarts=cfg.max_restarts, window_s=cfg.restart_window_minutes * 60,
            log=self.log, tracer=self.tracer, rt=rt,
            ledger=self.out / "trained" / "ledger.jsonl" if cfg.record_trained else None)
        self.slots: SlotPool | None = None
        # each stage's device slots at the start (and with placement.devices the free ones)
        self.roles = device_roles(cfg.placement, reference=self.n_reference)
        if cfg.placement.slot_memory_mib > 0:
            self.slots = run_slots(cfg.placement, reference=self.n_reference)
        elif cfg.placement.device == "cuda" and cfg.placement.launcher == "local":
            # every rank on its own GPU(s); under Ray its bundle asks for them
            import torch

            from earl.loop.devices import gpu_slots

            visible = torch.cuda.device_count()
            self.slots = gpu_slots(cfg.placement, reference=self.n_reference,
                                   gpus=min(visible, cfg.placement.devices or visible))
        # wall seconds of earlier (resumed-from) processes' segments: read from the checkpoint
        # by this process' first attempt; a rewind keeps it (this process' clock never stopped)
        self.wall_before = 0.0
        self._begun = False
        self._origin = _clock_origin()  # process_seconds() when this run's clock started
        self.metrics: Metrics | None = None
        self._attempt: Attempt | None = None
        self._state: LoopState | None = None

    def log(self, line: str) -> None:
        """An event (an eval, a healing, a new failure): to run.log and to the person."""
        self._append(line)
        self._log(line)

    def step(self, row: dict[str, Any]) -> None:
        """A trained step's metrics row: its progress line to run.log, the row to `progress`."""
        line = progress_line(row)
        self._append(line)
        if self._progress is not None:
            self._progress(row)
        else:
            self._log(line)

    def _append(self, line: str) -> None:
        with (self.out / "run.log").open("a") as f:  # beside the actors' lines (O_APPEND)
            f.write(f"{time.strftime('%H:%M:%S')} earl: {line}\n")

    @property
    def attempt(self) -> Attempt:
        """The actors and parts of the attempt in force."""
        if self._attempt is None:
            raise RuntimeError("the job's actors are not spawned yet (Job.use_attempt)")
        return self._attempt

    def use_attempt(self, attempt: Attempt) -> None:
        """`attempt`'s actors and parts are the ones in force from now on."""
        self._attempt = attempt

    @property
    def state(self) -> LoopState:
        """The loop's state (step, evals, best) of the attempt in force."""
        if self._state is None:
            raise RuntimeError("the job has not started (Job.begin)")
        return self._state

    @property
    def started(self) -> bool:
        """Whether an attempt has begun (`state` is readable)."""
        return self._state is not None

    @property
    def max_model_len(self) -> int:
        """The rollout's context window (`model.max_model_len`, or the model's own)."""
        from earl.resolve import context_length

        return context_length(self.cfg.model, self.start)

    @property
    def n_reference(self) -> int:
        """Reference actors that run (`RunConfig.reference_actors`)."""
        return self.cfg.reference_actors

    def elapsed(self) -> float:
        """Wall seconds of the run, earlier (resumed-from) segments included."""
        return self.wall_before + process_seconds() - self._origin

    def begin(self, state: LoopState, *, resume: bool) -> None:
        """Start an attempt at `state`: the config file, the metrics file (appended to on a
        resume)."""
        import json

        from earl.config import to_dict

        self._state = state
        if not self._begun:  # a rewind's checkpoint counts time this process' clock counts
            self.wall_before, self._begun = state.wall_before, True
        self.supervisor.set_version(state.step)
        (self.out / "config.json").write_text(json.dumps(to_dict(self.cfg), indent=2))
        if self.metrics is not None:
            self.metrics.close()
        self.metrics = Metrics(self.out, append=resume)

    def checkpoints(self) -> CheckpointStore:
        """The run's checkpoint store (`<output_dir>/checkpoint`) over the attempt in force:
        the trainer ranks' checkpoint (parameters, optimizer; `hooks.before_checkpoint` first)
        and the producers' states (their critics); a failed save the supervisor accepts (a
        full disk) is reported and skipped."""

        async def save_trainer(folder: str) -> None:
            if self.hooks.before_checkpoint is not None:
                await self.hooks.before_checkpoint(folder)
            with self.tracer.span("checkpoint", actor="trainer"):
                await self.attempt.actors.trainer.save_checkpoint.call(folder)

        return CheckpointStore(self.out / "checkpoint", save_trainer=save_trainer,
                               save_producers=lambda folder, batch: self.attempt.production.save_states(
                                   folder, batch),
                               wall=self.elapsed, skip_failed=self.supervisor.checkpoint_failed)

    async def stop_actors(self) -> None:
        """Stop every stage's group, the last spawned first (a rewind starts them again)."""
        import contextlib

        if self.metrics is not None:
            self.metrics.close()
        for name in reversed(self.supervisor.stages):
            with contextlib.suppress(KeyError):
                await self.rt.stop(name)

    def close(self) -> None:
        """Release the device slots (processes still in them move to the parent cgroup)."""
        if self.slots is not None:
            self.slots.close()
