"""`earl chaos`: a live tiny training run with faults injected; reports each fault and the
run's invariants (`--json`: as one JSON line).

    earl chaos --quick            # kills of rollout, producer, reference; a corrupt frame,
                                  # delayed control messages, a full disk at checkpoint time
    earl chaos --json             # also kills the dock's index and the trainer (rewinds),
                                  # drops calls to a producer and to the reference, stalls a
                                  # tool, and another user's attacks (shm names, slowloris),
                                  # and a kill while the checkpoint in force is re-saved
    earl chaos --faults kill:producer,disk_full --steps 6 --seed 3

Faults (each at a random point of a step, one at a time):
  kill:<group>   SIGKILL of rank 0 of rollout | producer | reference | dock | trainer
  kill:rollout_span  SIGKILL of rollout rank 0 right after a weight push, once it has
                 generations in flight: sessions of groups carried over by partial rollouts
                 span the update and the death (`requests_in_flight`, `groups_running`)
  drop:<group>   the driver's connection to rank 0 of producer | reference cut while
                 calls are in flight: their messages are lost, so the runtime treats the live
                 process as dead (killed, restarted, its state rebuilt)
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
`samples_dropped`, or still in the dock), `policy_versions_monotone`, `steps_reached`, `orphans`
(processes, shm segments, folders left), and the restarts per actor. "Trained" is what the
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
from typing import Any

from earl.commands.chaos_attacks import http_status, open_files_limit, plant_shm_names, slowloris
from earl.commands.chaos_faults import (
    corrupt,
    delay_requests,
    fill,
    mount_tmpfs,
    orphans,
    umount,
    until,
    versions_monotone,
)
from earl.commands.chaos_oracle import lose_a_sample, read_trained

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


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="earl chaos", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the short fault list, fewer steps")
    p.add_argument("--faults", help="comma-separated faults (default: by --quick)")
    p.add_argument("--steps", type=int, help="training steps (default 7 quick, 12 full)")
    p.add_argument("--seed", type=int, default=0, help="where in a step faults land")
    p.add_argument("--output-dir", help="run folder (default: a temp dir, removed)")
    p.add_argument("--verbose", action="store_true", help="progress and healing lines; the actors' library output on the terminal instead of <output_dir>/run.log")
    p.add_argument("--json", action="store_true",
                   help="print only the report's JSON line (default: one line per fault, then "
                        "the verdict)")
    p.add_argument("--tool-timeout-s", type=float, default=2.0,
                   help="the run's tool_timeout_s (what a stalled tool call waits)")
    p.add_argument("--deadline", type=float, default=900.0,
                   help="seconds after which the run counts as hung and is cancelled")
    args = p.parse_args(argv)
    faults = args.faults.split(",") if args.faults else (QUICK if args.quick else FULL)
    for f in faults:
        if f not in ("corrupt_frame", "delay", "disk_full", "stall:tool", "squat:shm",
                     "slowloris", "kill:resave", "lose:sample") and not (
                f.startswith("kill:") and f[5:] in ("rollout", "producer", "reference", "dock",
                                                    "trainer", "rollout_span")) and not (
                f.startswith("drop:") and f[5:] in ("producer", "reference")):
            print(f"earl chaos: unknown fault {f!r} (see --help)", file=sys.stderr)
            return 2
    steps = args.steps or (7 if args.quick else 12)
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
                                 f"--partial_rollouts={mode}"])
        log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.verbose \
            else (lambda line: None)
        report = asyncio.run(run_chaos(cfg, faults, seed=args.seed, log=log,
                                       deadline_s=args.deadline, verbose=args.verbose))
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
                    deadline_s: float = 900.0, verbose: bool = False) -> dict[str, Any]:
    """Run `cfg` with `faults` injected; returns the report `earl chaos` prints. A run still
    going after `deadline_s` counts as hung: its tasks' stacks go to stderr, and it is
    cancelled."""
    from earl.loop.healing import run_job
    from earl.loop.hooks import RunHooks
    from earl.loop.job import Job
    from earl.resolve import resolve_recipe
    from earl.run import quiet_logs
    from earl.runtime import Runtime, RuntimeConfig
    from earl.runtime.dock import Dock

    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    disk = mount_tmpfs(out / "checkpoint", 24 << 20) if "disk_full" in faults else ""
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
        actor_log = None if verbose else quiet_logs(out)
        async with Runtime(RuntimeConfig(actor_log=actor_log)) as rt:
            hooks = RunHooks(after_step=lambda r: inj.after_step(r),
                             before_checkpoint=lambda folder: inj.before_checkpoint(folder),
                             env=env)
            job = Job(cfg, recipe, ref, rt, log=log, trace=True, hooks=hooks)
            inj = Injector(job, rt, faults, seed=seed, disk=disk, stall=stall)
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
                await inj.wait(120.0)
            await inj._collect_pids()
            pids = inj.pids
    finally:
        stall.unlink(missing_ok=True)
        if disk:
            umount(out / "checkpoint")
    ledger = job.healer.ledger.summary(read_trained(out / "trained"), resident)
    left_behind = orphans(pids | {os.getpid()})
    monotone = versions_monotone(out, cfg.max_policy_lag, cfg.partial_rollouts != "off")
    recovered = (not error and steps == cfg.steps and len(inj.done) == len(faults)
                 and all(f["recovered"] for f in inj.done))
    report: dict[str, Any] = {
        "faults_injected": len(inj.done), "recovered": recovered,
        "samples_lost": ledger["samples_lost"],
        "samples_duplicated": ledger["samples_duplicated"],
        "policy_versions_monotone": monotone, "steps_reached": steps, "orphans": left_behind,
        "steps": cfg.steps, "faults": inj.done, "restarts": dict(job.healer.restarts),
        "rewinds": job.healer.rewinds, "disk_full": disk or ("injected" if "disk_full" in
                                                             faults else ""),
        **{k: v for k, v in ledger.items() if k not in ("samples_lost", "samples_duplicated")},
        "error": error, "wall_s": round(time.perf_counter() - t0, 1)}
    report["ok"] = bool(recovered and not report["samples_lost"]
                        and not report["samples_duplicated"] and monotone
                        and not any(left_behind.values()))
    return report


class Injector:
    """Injects `faults`, spread over the steps: fault i is fired after step `plan[i]` is
    logged, at a random point of the next step (a uniform fraction of the recent step time).
    The step after must wait until it was fired, so a fast run cannot outrun its faults;
    whether the run recovered is checked in the background. The run calls it through its
    `RunHooks` (`after_step`, `before_checkpoint`)."""

    def __init__(self, job: Any, rt: Any, faults: list[str], *, seed: int, disk: str,
                 stall: Path | None = None) -> None:
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
        self.fired = [asyncio.Event() for _ in faults]
        self.settled = [asyncio.Event() for _ in faults]  # one fault at a time
        self.tasks: list[asyncio.Task[None]] = []
        self._last, self._dt, self._next = 0.0, 0.2, 0
        self._running = 0  # groups still playing at the last step's end (partial rollouts)
        self._disk_full_armed = False  # the next trainer save fails as a full disk would

    async def before_checkpoint(self, folder: str) -> None:
        if self._disk_full_armed:
            import errno

            self._disk_full_armed = False
            raise OSError(errno.ENOSPC, "No space left on device (injected)", folder)

    async def after_step(self, record: Any) -> None:
        """After each trained step is logged: fire what is due, hold the run until it is."""
        step = int(record.version)
        self._running = int(getattr(record, "groups_running", 0))
        now = time.perf_counter()
        if self._last:
            self._dt = 0.5 * self._dt + 0.5 * (now - self._last)
        self._last = now
        await self._collect_pids()
        while self._next < len(self.faults) and self.plan[self._next] <= step:
            i, self._next = self._next, self._next + 1
            delay = 0.0 if self.faults[i] == "kill:rollout_span" else \
                self.rng.uniform(0.0, max(self._dt, 0.05))
            self.tasks.append(asyncio.ensure_future(self._fire(i, step, delay)))
        for i in range(self._next):
            if not self.faults[i].startswith("drop:"):
                if self.plan[i] < step:
                    await self.fired[i].wait()
            elif self.plan[i] + 1 < step:  # a drop needs calls in flight: one more step runs,
                await self.settled[i].wait()  # then the run waits until the actor is back

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
        if i > 0:
            await self.settled[i - 1].wait()
        await asyncio.sleep(delay)
        fault = self.faults[i]
        rec: dict[str, Any] = {"fault": fault, "after_step": step, "delay_s": round(delay, 3)}
        t = time.perf_counter()
        try:
            rec.update(await self._inject(fault, self.fired[i]))
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected
            rec.update(recovered=False, note=f"not injected: {exc}")
        finally:
            self.fired[i].set()
            self.settled[i].set()
        rec["seconds"] = round(time.perf_counter() - t, 2)
        self.done.append(rec)

    async def wait(self, timeout: float) -> None:
        """Let the recovery checks of fired faults finish (at most `timeout` s)."""
        for ev in self.fired + self.settled:
            ev.set()  # a fault not fired by now never will be
        if self.tasks:
            _, pending = await asyncio.wait(self.tasks, timeout=timeout)
            for t in pending:
                t.cancel()

    async def _inject(self, fault: str, fired: asyncio.Event) -> dict[str, Any]:
        healer = self.job.healer
        target = fault.split(":", 1)[1] if fault.startswith(("kill:", "drop:")) else "producer"
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
            before = (healer.restarts.get(name, 0), healer.rewinds)
            os.kill(pid, 9)
            fired.set()
            ok = await until(lambda: (healer.restarts.get(name, 0), healer.rewinds) != before
                              and (name in ("trainer", "dock") or any(
                                  e["event"] == "restart" and e["actor"] == name
                                  and e.get("restarts", 0) > before[0]
                                  for e in healer.events)), 300)
            if fault == "kill:rollout_span":  # it must have hit sessions spanning the push
                return {"pid": pid, "groups_running": running, "requests_in_flight": in_flight,
                        "recovered": ok and in_flight > 0}
            return {"pid": pid, "recovered": ok}
        if fault.startswith("drop:"):
            return await self._drop(fault[5:], fired)
        if fault == "corrupt_frame":
            rec = await self.rt.dir_call("lookup", "producer")
            pid, addr = rec.pids[0], rec.addresses[0]
            await corrupt(addr, self.rng)
            fired.set()
            await asyncio.sleep(0.5)
            after = await self.rt.dir_call("lookup", "producer")
            group = await self.rt.lookup("producer")
            answers = isinstance(await group[0].state_dict.call_one(None), dict)
            return {"pid": pid, "answers": answers,
                    "recovered": after.pids[0] == pid and after.status[0] == "up" and answers}
        if fault == "delay":
            fired.set()
            self.settled[self.faults.index("delay")].set()
            n = await delay_requests(2.0, self.rng)
            return {"delayed": n, "recovered": True}
        if fault == "disk_full":
            return await self._disk_full(fired)
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

    async def _drop(self, name: str, fired: asyncio.Event) -> dict[str, Any]:
        """Cut the driver's connection to `name[0]` once calls to it are in flight (waits up
        to 30 s for one): the runtime must kill and restart the live process, and the healer
        rebuild it, as after a SIGKILL."""
        healer = self.job.healer
        rec = await self.rt.dir_call("lookup", name)
        pid, addr = rec.pids[0], rec.addresses[0]
        before = healer.restarts.get(name, 0)
        deadline = time.monotonic() + 30.0  # the schedule goes on for a step (see `_gate`)
        while True:
            conn = self.rt.pool.conns.get(addr)
            busy = 0 if conn is None else len(conn.pending) + len(conn.streams)
            if (busy and conn.transport is not None) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.005)
        if not busy:
            return {"pid": pid, "calls_in_flight": 0, "recovered": False,
                    "note": "no call in flight within 30 s"}
        conn.transport.abort()
        fired.set()
        ok = await until(lambda: healer.restarts.get(name, 0) > before and any(
            e["event"] == "restart" and e["actor"] == name for e in healer.events), 300)
        after = await self.rt.dir_call("lookup", name)
        return {"pid": pid, "calls_in_flight": busy, "new_pid": after.pids[0],
                "recovered": ok and after.pids[0] != pid}

    async def _disk_full(self, fired: asyncio.Event) -> dict[str, Any]:
        healer = self.job.healer
        folder = Path(self.job.out) / "checkpoint"
        filler = folder / ".filler"
        before = len([e for e in healer.events if e["event"] == "checkpoint_failed"])
        if self.disk:
            fill(filler)
        else:  # no tmpfs (not root): the trainer's next save raises ENOSPC
            self._disk_full_armed = True
        fired.set()
        self.settled[self.faults.index("disk_full")].set()
        ok = await until(lambda: len([e for e in healer.events
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
        before = dict(self.job.healer.restarts), self.job.healer.rewinds
        attack = plant_shm_names(max(4.0, 3 * self._dt))
        await asyncio.to_thread(attack.wait_ready)
        fired.set()
        res = await asyncio.to_thread(attack.result, 120.0)
        after = dict(self.job.healer.restarts), self.job.healer.rewinds
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
        before = dict(self.job.healer.restarts), self.job.healer.rewinds
        n = open_files_limit(pid) + 500
        attacks = [a for port in ports for a in slowloris(port, n, 40.0)]
        for a in attacks:
            await asyncio.to_thread(a.wait_ready)
        fired.set()
        answered = [await http_status(port, 30.0) for port in ports]
        group = await self.rt.lookup("producer")
        rpc = isinstance(await group[0].state_dict.call_one(None), dict)
        res = [await asyncio.to_thread(a.result, 120.0) for a in attacks]
        after = dict(self.job.healer.restarts), self.job.healer.rewinds
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

        job, healer = self.job, self.job.healer
        pid = (await self.rt.dir_call("lookup", "trainer")).pids[0]
        def rewinds() -> list[dict[str, Any]]:
            return [e for e in healer.events if e["event"] == "rewind"]

        before = len(rewinds())

        async def killed_midway(folder: str) -> None:
            os.kill(pid, 9)
            fired.set()
            await job.save_trainer(folder)

        root = Path(job.out) / "checkpoint"
        if not await until(lambda: (root / MANIFEST).is_file(), 300):
            return {"recovered": False, "note": "no checkpoint in force within 300 s"}
        store = CheckpointStore(root, save_trainer=killed_midway,
                                producer_states=job.producer_states, wall=job.elapsed)
        state, _, _ = store.load()
        try:
            await store.save(state, None)
        except Exception:  # noqa: BLE001, S110 - the trainer died under it: expected
            pass
        fired.set()
        ok = await until(lambda: len(rewinds()) > before, 300)
        to = rewinds()[-1].get("to_step") if ok else None
        return {"pid": pid, "step_in_force": state.step, "rewound_to": to,
                "recovered": ok and to == state.step}


def _hung(run: asyncio.Future[Any]) -> None:
    print("earl chaos: the run is hung; its tasks:", file=sys.stderr)
    for t in asyncio.all_tasks():
        t.print_stack(limit=6, file=sys.stderr)
    run.cancel()
