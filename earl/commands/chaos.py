"""`earl chaos`: a live tiny training run with faults injected; reports each fault and the
run's invariants (`--json`: as one JSON line).

    earl chaos --quick            # kills of rollout, producer, reference; a corrupt frame,
                                  # delayed control messages, a full disk at checkpoint time
    earl chaos --json             # also kills the dock's index and the trainer (rewinds),
                                  # drops calls to a producer and to the reference, stalls a
                                  # tool, and another user's attacks (shm names, slowloris),
                                  # and a kill while the checkpoint in force is re-saved
    earl chaos --faults kill:producer,disk_full --steps 6 --seed 3
    earl chaos --draw 4 --seed 17     # 4 faults, their order, steps, points of a step and
                                      # overlaps drawn from the seed (earl.commands.chaos_draw)
    earl chaos --soak 125 --seed 1 --json  # a run of 125 minutes, a drawn fault every ~5 min,
                                      # each actor's RSS and the folder's size sampled
                                      # (earl.commands.chaos_soak; bench/soak.py saves it)

Faults (each at a random point of a step, one at a time):
  kill:<group>   SIGKILL of rank 0 of rollout | producer | reference | dock | trainer
  kill:rollout_span  SIGKILL of rollout rank 0 right after a weight push, once it has
                 generations in flight: sessions of groups carried over by partial rollouts
                 span the update and the death (`requests_in_flight`, `groups_running`)
  drop:<group>   the driver's connection to rank 0 of producer | reference cut while
                 calls are in flight: their messages are lost, so the runtime treats the live
                 process as dead (killed, restarted, its state rebuilt)
  hang:<group>   SIGSTOP of rank 0 of producer | reference: alive and connected, it answers
                 nothing, so no death is seen; the run's watchdog must see the stall (after
                 --stall-s, 60 by default, naming the stage) and rewind the run (not in the
                 default lists)
  corrupt_frame  random bytes and a length lie sent to a producer's socket
  delay          the driver's control messages delayed 50-300 ms (30% of them) for 2 s
  disk_full      the checkpoint folder (a tmpfs of its own) filled up before a checkpoint
  stall:tool     the agent's sync tool hangs in every session until the stall is lifted:
                 each call must come back as a timeout error after --tool-timeout-s while
                 the producer goes on (the job's agent calls a `probe` tool before each game,
                 earl.commands.chaos_probe)
  squat:shm      another user (uid 65534 as root) pre-creates the names the run's next
                 /dev/shm segments could take, for a few seconds: no actor may fail
  slowloris      another user holds half-sent HTTP requests to the producer's OpenAI
                 endpoint, more than the producer may open files, for 40 s: the endpoint must
                 answer a new request and close every one of them, and no actor may fail
  kill:resave    SIGKILL of the trainer while the checkpoint in force is saved again (as a
                 resumed run re-saves its step): the rewind must find that checkpoint whole
  lose:sample    a test of the judge, not of healing: one sample is left out of a step's
                 plan and acked anyway (a dispatcher bug); the run must report it lost and fail

The JSON line: `faults_injected`, `recovered`, `samples_lost`, `samples_duplicated` (every
sample produced is trained exactly once or accounted for as dropped with its reason, in
`samples_dropped`, or still in the dock), `samples_out_of_step` (whole batches: trained at a
step other than their batch's, which a rewind can lose or repeat), `policy_versions_monotone`, `steps_reached`, `orphans`
(processes, shm segments, folders left), the restarts per actor, and `stalls` (the run made no
progress for its `stall_s`: rewound, `earl.loop.watchdog`; each names the stage it waited in). "Trained" is what the
trainer ranks recorded before each ack (`earl.commands.chaos_oracle`), not the driver's acks
(`samples_acked`, `samples_acked_untrained`). Exit status 0 when every invariant held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.commands.chaos_faults import mount_tmpfs, orphans, umount, versions_monotone
from earl.commands.chaos_injector import Injector
from earl.commands.chaos_oracle import judge, out_of_step, read_records

if TYPE_CHECKING:
    from earl.commands.chaos_draw import Drawn

__all__ = ["main"]

QUICK = ["kill:producer", "corrupt_frame", "kill:rollout", "delay", "disk_full",
         "kill:reference"]
# stall:tool last: it waits for sessions to call the tool, and the gate of the fault after it
# would hold the schedule (and with it new sessions) until it settles
FULL = QUICK + ["kill:rollout_span", "kill:dock", "kill:trainer", "drop:producer",
                "drop:reference", "squat:shm", "slowloris", "kill:resave", "stall:tool"]
SMALL = ["--warm_start.steps=0", "--batch_size=8", "--group_size=4", "--eval_games=4",
         "--eval_every=0", "--checkpoint_every=2", "--time_limit_minutes=30",
         "--record_trained=true"]  # the trainers' records: what the oracle reads
# a soak trains batches of the recipe's size and keeps a checkpoint every 10 steps; it tests
# healing, not the restart limit (a lifetime budget per run: 3 would end it at its 4th rewind)
SOAK = ["--batch_size=64", "--group_size=8", "--checkpoint_every=10", "--max_restarts=1000"]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="earl chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the short fault list, fewer steps")
    p.add_argument("--faults", help="comma-separated faults (default: by --quick)")
    p.add_argument("--steps", type=int, help="training steps (default 7 quick, 12 full)")
    p.add_argument("--seed", type=int, default=0,
                   help="where in a step faults land (with --draw: the whole schedule)")
    p.add_argument("--draw", type=int, default=0, metavar="N",
                   help="draw N distinct faults, their order, steps, points of a step and "
                        "overlaps from --seed (earl.commands.chaos_draw) instead of --faults")
    p.add_argument("--soak", type=float, default=0.0, metavar="MINUTES",
                   help="run for MINUTES (not --steps) with a fault drawn from --seed every "
                        "--every-s seconds, sampling each actor's RSS and the folder's size")
    p.add_argument("--every-s", type=float, default=300.0,
                   help="with --soak: seconds between faults")
    p.add_argument("--output-dir", help="run folder (default: a temp dir, removed)")
    p.add_argument("--verbose", action="store_true", help="progress and healing lines; the actors' library output on the terminal instead of <output_dir>/run.log")
    p.add_argument("--json", action="store_true",
                   help="print only the report's JSON line (default: one line per fault, then "
                        "the verdict)")
    p.add_argument("--tool-timeout-s", type=float, default=2.0,
                   help="the run's tool_timeout_s (what a stalled tool call waits)")
    p.add_argument("--stall-s", type=float, default=60.0,
                   help="the run's stall_s: a run without progress this long ends its attempt, "
                        "naming the stage, long before --deadline (a hang: fault waits it out)")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds after which the run counts as hung and is cancelled")
    args = p.parse_args(argv)
    faults = args.faults.split(",") if args.faults else (QUICK if args.quick else FULL)
    for f in faults:
        if f not in ("corrupt_frame", "delay", "disk_full", "stall:tool", "squat:shm",
                     "slowloris", "kill:resave", "lose:sample") and not (
                f.startswith("kill:") and f[5:] in ("rollout", "producer", "reference", "dock",
                                                    "trainer", "rollout_span")) and not (
                f.startswith(("drop:", "hang:")) and f[5:] in ("producer", "reference")):
            print(f"earl chaos: unknown fault {f!r} (see --help)", file=sys.stderr)
            return 2
    steps = args.steps or (7 if args.quick else 12)
    drawn, due = None, None
    if args.soak:
        from earl.commands.chaos_soak import schedule

        faults, due = schedule(args.soak, args.every_s, args.seed)
        steps, args.deadline = 10**6, max(args.deadline, args.soak * 60 + 1800)
    if args.draw:
        from earl.commands.chaos_draw import draw

        try:
            drawn = draw(args.draw, args.seed, steps)
        except ValueError as exc:
            print(f"earl chaos: {exc}", file=sys.stderr)
            return 2
        faults = list(drawn.faults)
    for k, v in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                 ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(k, v)
    with tempfile.TemporaryDirectory(prefix="earl-chaos-") as tmp:
        out = Path(args.output_dir or tmp)
        from earl.config import load_config

        # Partial rollouts run under kill:rollout_span, the fault made for them; the other
        # faults run on whole batches: a dropped connection under partial rollouts is not
        # healed yet (docs/design/healing.md)
        mode = "continue" if "kill:rollout_span" in faults else "off"
        cfg = load_config(None, [*SMALL, f"--steps={steps}", f"--output_dir={out}",
                                 f"--tool_timeout_s={args.tool_timeout_s}",
                                 f"--stall_s={args.stall_s}",
                                 f"--partial_rollouts={mode}",
                                 *(SOAK + [f"--time_limit_minutes={args.soak}"] if args.soak
                                   else [])])
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose \
            else (lambda line: None)
        report = asyncio.run(run_chaos(cfg, faults, seed=args.seed, log=log,
                                       deadline_s=args.deadline, verbose=args.verbose,
                                       drawn=drawn, due_s=due))
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print_report(report)
    return 0 if report["ok"] else 1


def _print_report(report: dict[str, Any]) -> None:
    for f in report["faults"]:
        extra = {k: v for k, v in f.items() if k not in ("fault", "recovered", "after_step")}
        print(f"{'ok  ' if f['recovered'] else 'FAIL'} {f['fault']:<16} after step "
              f"{f['after_step']}: {extra}")
    print(f"{'ok' if report['ok'] else 'FAILED'}: {report['faults_injected']} faults, "
          f"recovered {report['recovered']}, samples lost {report['samples_lost']}, "
          f"duplicated {report['samples_duplicated']}, steps {report['steps_reached']}/"
          f"{report['steps']}, orphans {sum(map(len, report['orphans'].values()))}"
          + (f", error: {report['error']}" if report["error"] else ""), flush=True)


async def run_chaos(cfg: Any, faults: list[str], *, seed: int = 0, log: Any = print,
                    deadline_s: float = 900.0, verbose: bool = False,
                    drawn: Drawn | None = None,
                    due_s: list[float] | None = None) -> dict[str, Any]:
    """Run `cfg` with `faults` injected; returns the report `earl chaos` prints. A run still
    going after `deadline_s` counts as hung: its tasks' stacks go to stderr, and it is
    cancelled. With `due_s` (a soak) fault i fires once `due_s[i]` s have passed, the run ends
    by its time limit, and the report's `soak` holds the samples and their summary."""
    from earl.commands.chaos_soak import Sampler, summarize
    from earl.loop.hooks import RunHooks
    from earl.loop.job import Job
    from earl.loop.main import run_job
    from earl.resolve import resolve_recipe
    from earl.run import runtime
    from earl.runtime.dock import Dock

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    # room for two checkpoints of a long run (the one in force and the one being staged: the
    # soak's grew to 12 MiB each and a 24 MiB tmpfs failed every save after); the fault fills
    # whatever is free
    disk = mount_tmpfs(out / "checkpoint", 256 << 20) if "disk_full" in faults else ""
    recipe, ref = resolve_recipe(cfg)
    stall = out / ".tool-stall"
    env: dict[str, str] = {}
    if "stall:tool" in faults:  # an agent with a tool to stall (Tic-Tac-Toe has none)
        from earl.commands.chaos_probe import STALL_ENV

        if cfg.recipe != "tictactoe" or cfg.agent:
            raise ValueError("stall:tool runs the tictactoe recipe's agent behind a probe tool")
        ref = "earl.commands.chaos_probe:probed_tictactoe"
        env[STALL_ENV] = str(stall)
    t0 = time.perf_counter()
    error, steps, resident = "", 0, []
    try:
        async with runtime(cfg, verbose=verbose) as rt:  # actors may write under `out`
            hooks = RunHooks(after_step=lambda r: inj.after_step(r),
                             before_checkpoint=lambda folder: inj.before_checkpoint(folder),
                             env=env)
            job = Job(cfg, recipe, ref, rt, log=log, trace=True, hooks=hooks)
            inj = Injector(job, rt, faults, seed=seed, disk=disk, stall=stall, drawn=drawn,
                           due_s=due_s)
            sampler = Sampler(rt, job, out) if due_s is not None else None
            sampling = asyncio.ensure_future(sampler.run()) if sampler is not None else None
            run = asyncio.ensure_future(run_job(job, False))
            watchdog = asyncio.get_running_loop().call_later(deadline_s, _hung, run)
            try:
                result = await run
                steps = result.steps
                resident = await Dock(await rt.lookup("dock")).resident("train")
            except Exception as exc:  # noqa: BLE001 - reported in the JSON line
                from earl.commands.train import _cause

                error = _cause(exc)
                steps = job.state.step if job.started else 0
            finally:
                watchdog.cancel()
                if sampling is not None:
                    sampling.cancel()
                    await asyncio.gather(sampling, return_exceptions=True)
                await inj.wait(120.0)
            await inj._collect_pids()
            pids = inj.pids
    finally:
        stall.unlink(missing_ok=True)
        if disk:
            umount(out / "checkpoint")
    records = list(read_records(out / "trained"))  # read once: a soak's are ~20 MB
    ledger = judge(job.supervisor.ledger.path, [s for _, ids in records for s in ids], resident)
    # whole batches: step b + 1 trains batch b alone (partial rollouts take the first groups
    # done, whatever batch started them)
    ledger["samples_out_of_step"] = len(out_of_step(records)) \
        if cfg.partial_rollouts == "off" else 0
    left_behind = orphans(pids | {os.getpid()})
    monotone = versions_monotone(out, cfg.max_policy_lag, cfg.partial_rollouts != "off")
    # a soak ends by its time limit, with the faults that came due by then
    recovered = (not error and (steps == cfg.steps or due_s is not None)
                 and len(inj.done) == (inj.due if due_s is not None else len(faults))
                 and all(f["recovered"] for f in inj.done))
    report: dict[str, Any] = {
        "faults_injected": len(inj.done), "recovered": recovered,
        "samples_lost": ledger["samples_lost"],
        "samples_duplicated": ledger["samples_duplicated"],
        "policy_versions_monotone": monotone, "steps_reached": steps, "orphans": left_behind,
        "steps": cfg.steps, "faults": inj.done, "restarts": dict(job.supervisor.restarts),
        "rewinds": job.supervisor.rewinds,
        "stalls": [e for e in job.supervisor.events if e["event"] == "stall"], "disk_full": disk or ("injected" if "disk_full" in
                                                             faults else ""),
        **{k: v for k, v in ledger.items() if k not in ("samples_lost", "samples_duplicated")},
        "error": error, "wall_s": round(time.perf_counter() - t0, 1), "seed": seed,
        **({"drawn": drawn.as_json()} if drawn is not None else {}),
        **({"soak": {"faults_planned": len(faults), "due_s": due_s,
                     **summarize(sampler.rows), "rows": sampler.rows,
                     "driver_rewinds": sampler.rewinds}}
           if sampler is not None else {})}
    report["ok"] = bool(recovered and not report["samples_lost"]
                        and not report["samples_duplicated"] and monotone
                        and not report["samples_out_of_step"]
                        and not any(left_behind.values()))
    return report


def _hung(run: asyncio.Future[Any]) -> None:
    print("earl chaos: the run is hung; its tasks:", file=sys.stderr)
    for t in asyncio.all_tasks():
        t.print_stack(limit=6, file=sys.stderr)
    run.cancel()
