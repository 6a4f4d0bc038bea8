"""The processes of `bench/selector.py --memory-bound`: the pilot, the arms, and the kernel's
word on each OOM.

Each arm is one or more `earl train` children (segments; only `restart_pick` has more than
one: after an OOM it resumes from the last checkpoint with the next layout). A child's stderr
is read line by line as it comes, so every validation eval ("eval @ step N: ...") is stamped
on the arm's own clock, which runs from the arm's first spawn across restarts: time to quality
counts the steps lost and the restarts. While a child runs, its slots' memory cgroups are
sampled (peak bytes per slot, by the process in it); after it exits, the kernel log is read for
the OOM kills of its cgroups (``oom-kill:... oom_memcg=.../earl-<pid>/<slot>``): an arm's
`kernel_oom` is that verdict, not the run's own error message.

Not here: the rules (`_selector_memory`), the layouts' arguments (`_selector_runs.Config`).
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from _selector_runs import Config, Sampler, by_context

# `earl train` as a child: argv[1] "resume" resumes the run in --output_dir from its last
# checkpoint; the whole exception chain goes to stderr on failure.
_CHILD = """
import asyncio, json, sys, traceback
from earl.config import load_config
from earl.run import run
cfg = load_config(None, sys.argv[2:])
try:
    res = asyncio.run(run(cfg, resume=sys.argv[1] == "resume",
                          log=lambda line: print(line, file=sys.stderr, flush=True)))
except BaseException as exc:
    traceback.print_exception(exc)
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(1)
print(json.dumps(res.to_json()))
"""

_EVAL = re.compile(r"eval @ step (\d+): (.*)$")


def parse_eval(line: str) -> dict[str, float] | None:
    """A validation eval's log line ("eval @ step 50: games_survived 1.234 (episodes 64, ...)")
    as {step, metric: value, ...}; None for any other line."""
    m = _EVAL.search(line)
    if not m:
        return None
    out = {"step": float(m.group(1))}
    for part in re.split(r"[(),]", m.group(2)):
        bits = part.split()
        if len(bits) == 2:
            try:
                out[bits[0]] = float(bits[1])
            except ValueError:
                continue
    return out


def kernel_oom_kills(pid: int, since_uptime: float) -> list[str]:
    """The kernel log's OOM kills in the memory cgroups of the run whose driver is `pid`
    (`runtime.slots.SlotPool` names them ``earl-<pid>``), logged after `since_uptime`."""
    try:
        log = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    out = []
    for line in log.splitlines():
        m = re.match(r"\[\s*([\d.]+)\]\s*(oom-kill:.*)", line)
        if m and float(m.group(1)) >= since_uptime and f"/earl-{pid}/" in m.group(2):
            out.append(m.group(2))
    return out


def _uptime() -> float:
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


class CgroupPeaks(Sampler):
    """Samples the memory cgroups of run `pid`'s slots every `every` s: the peak bytes of each
    slot (`memory.max_usage_in_bytes`), named by the process in it (``trainer0``, ...)."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        super().__init__(every)
        self.pid = pid
        self.peaks: dict[str, float] = {}

    def read(self) -> None:
        for d in glob.glob(f"/sys/fs/cgroup/memory/**/earl-{self.pid}/*/", recursive=True):
            try:
                peak = int(Path(d, "memory.max_usage_in_bytes").read_text()) / 2**20
                procs = Path(d, "cgroup.procs").read_text().split()
                who = Path(f"/proc/{procs[0]}/comm").read_text().strip() if procs else ""
            except (OSError, ValueError):
                continue
            if who:
                self.peaks[who] = max(self.peaks.get(who, 0.0), round(peak, 1))


def spawn(args: list[str], out: str, *, resume: bool, timeout: float, clock0: float
          ) -> dict[str, object]:
    """One `earl train` child into `out`; its outcome, evals on the arm's clock (`clock0`:
    the arm's first spawn, `time.time()`), step rows, the kernel's OOM kills, slot peaks."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    up0, spawned = _uptime(), time.time()
    p = subprocess.Popen([sys.executable, "-c", _CHILD, "resume" if resume else "fresh", *args,
                          f"--output_dir={out}"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    evals: list[dict[str, float]] = []
    err: list[str] = []

    def read_err() -> None:
        assert p.stderr is not None
        for line in p.stderr:
            err.append(line)
            ev = parse_eval(line)
            if ev is not None:
                evals.append({**ev, "wall_s": round(time.time() - clock0, 2)})

    reader = threading.Thread(target=read_err, daemon=True)
    reader.start()
    with CgroupPeaks(p.pid) as peaks:
        try:
            stdout, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, _ = p.communicate()
        reader.join(10)
    ended = time.time()
    stderr = "".join(err)
    Path(f"{out}.{int(spawned)}.log").write_text(stderr)
    last = stdout.strip().splitlines()[-1] if stdout.strip() else "{}"
    res = json.loads(last) if last.startswith("{") else {}
    kills = kernel_oom_kills(p.pid, up0)
    rows, sel = read_rows(out)
    recent = recent_context(out) if kills or "out of memory in slot" in stderr else None
    return {"rc": p.returncode, "spawned_s": round(spawned - clock0, 2),
            "ended_s": round(ended - clock0, 2), "evals": evals, "rows": rows, "sel_rows": sel,
            "kernel_oom_kills": kills, "oom_message": "out of memory in slot" in stderr,
            "slot_peak_mib": peaks.peaks, "result": res, "recent_context_max": recent,
            "error": next((ln for ln in reversed(err) if "Error" in ln), "").strip()[:300]}


def read_rows(out: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    """The step rows of a run's `metrics.jsonl` (those with a `reward`) and its selector's
    decision rows (those with a `selector/when`)."""
    path = Path(out) / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if "reward" in r], [r for r in rows if "selector/when" in r]


def recent_context(out: str, last: int = 64) -> int | None:
    """The longest of the run's last `last` trajectories dumped (`--dump_share=1` dumps every
    group as it finishes): at a kill, the contexts of the step being trained and the one
    being played."""
    path = Path(out) / "trajectories.jsonl"
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()[-last:]
    lens = [len(json.loads(x)["token_ids"]) for x in lines if x.strip()]
    return max(lens) if lens else None


def checkpoint_state(out: str) -> dict[str, object]:
    """The loop state of the run's checkpoint in force (its step, `wall_before`)."""
    root = Path(out) / "checkpoint"
    manifest = json.loads((root / "manifest.json").read_text())
    folder = root / str(manifest.get("folder", manifest.get("dir", "")))
    return json.loads((folder / "state.json").read_text())


def run_arm(cfg: Config, common: list[str], device_mib: int, out: str, timeout: float, *,
            extra: tuple[str, ...] = (), next_budget: object = None) -> dict[str, object]:
    """One arm: `cfg` on devices of `device_mib`; with `next_budget` (budget -> the next
    budget or None: the restart rule) an OOM resumes from the last checkpoint with it.
    Returns the arm's record (`_selector_memory.summarize` reads it)."""
    clock0 = time.time()
    segments: list[dict[str, object]] = []
    budget, resume, wall_before, resumed_at = cfg.budget, False, 0.0, 0
    while True:
        c = Config(cfg.devices, cfg.replicas, cfg.rollout_tp, cfg.trainer, cfg.window, budget,
                   cfg.selector, cfg.first_context)
        seg = spawn([*common, *c.args(device_mib), *extra], out, resume=resume,
                    timeout=timeout, clock0=clock0)
        seg.update(budget=budget, resumed_at=resumed_at, wall_before=wall_before)
        segments.append(seg)
        oom = bool(seg["kernel_oom_kills"]) or bool(seg["oom_message"])
        nb = next_budget(budget) if callable(next_budget) and oom else None  # type: ignore[operator]
        if nb is None:
            break
        budget = nb
        if os.path.isfile(f"{out}/checkpoint/manifest.json"):
            state = checkpoint_state(out)
            resume, resumed_at = True, int(str(state["step"]))
            wall_before = float(str(state["wall_before"]))
        else:  # killed before its first checkpoint: the user starts again
            shutil.rmtree(out, ignore_errors=True)
            resume, resumed_at, wall_before = False, 0, 0.0
    return arm_record(cfg, segments)


def arm_record(cfg: Config, segments: list[dict[str, object]]) -> dict[str, object]:
    """What `summarize` reads, from an arm's segments (pure: unit-tested)."""
    last = segments[-1]
    kept: list[dict[str, object]] = list(last["rows"])  # type: ignore[call-overload]
    measured: list[dict[str, object]] = []  # every step trained, lost ones included
    steps_lost, restart_s = 0, 0.0
    for i, seg in enumerate(segments):
        rows: list[dict[str, object]] = seg["rows"]  # type: ignore[assignment]
        start = int(str(seg["resumed_at"]))
        measured += [r for r in rows if int(str(r["step"])) > start]
        if i + 1 < len(segments):
            nxt = segments[i + 1]
            reached = max((int(str(r["step"])) for r in rows), default=start)
            steps_lost += max(0, reached - int(str(nxt["resumed_at"])))
            first = [r for r in nxt["rows"] if int(str(r["step"])) > int(str(nxt["resumed_at"]))]  # type: ignore[attr-defined]
            if first:  # the new child's start-up until its first step began
                at = _on_clock(nxt, first[0]) - float(str(first[0]["step_s"]))
                restart_s += at - float(str(seg["ended_s"]))
    wall = _on_clock(last, kept[-1]) if kept else None
    tokens = sum(float(str(r.get("train/tokens", 0))) for r in kept)
    step_s = [float(str(r["step_s"])) for r in measured]
    toks = [float(str(r.get("train/tokens", 0))) for r in measured]
    evals = arm_evals(segments)
    ooms = [s for s in segments if s["kernel_oom_kills"] or s["oom_message"]]
    lost = sum(max(0, int(str(r["episodes"])) - int(float(str(r.get("train/samples", 0)))))
               for r in kept)
    sel_rows: list[dict[str, object]] = list(last.get("sel_rows", []))  # type: ignore[call-overload]
    sel_lost = max((int(float(str(r.get("selector/queue/lost", 0)))) for r in sel_rows),
                   default=0)
    return {
        "config": cfg.name, "segments": len(segments),
        "budgets": [s["budget"] for s in segments],
        "outcome": "finished" if last["rc"] == 0 else "oom" if ooms and last in ooms
        else f"error ({last['rc']}): {last['error']}",
        "steps": len(kept), "wall_s": round(wall, 2) if wall is not None else None,
        "loop_s": round(sum(step_s), 2), "tokens": int(tokens),
        "evals": evals, "ooms": len(ooms),
        "kernel_oom": any(bool(s["kernel_oom_kills"]) for s in segments),
        "kernel_oom_kills": [k for s in segments for k in s["kernel_oom_kills"]],  # type: ignore[attr-defined]
        "oom_at": [oom_point(s) for s in ooms],
        "steps_lost": steps_lost, "restart_s": round(restart_s, 2),
        "samples_lost": lost + sel_lost,
        "slot_peak_mib": [s["slot_peak_mib"] for s in segments],
        "by_context": by_context(measured, toks, step_s),
        "final_eval": last["result"].get("eval", {}) if isinstance(last["result"], dict) else {},
        "first_plan": first_plan(sel_rows),
        "selector_changes": {k: max((int(float(str(r.get(f"selector/{k}", 0))))
                                     for r in sel_rows), default=0)
                             for k in ("reconfigurations", "trainer_layout_changes",
                                       "rollout_layout_changes", "device_moves")},
        "layouts": sorted({f"mb{r.get('selector/applied_micro_batch_tokens')}"
                           f"-w{r.get('selector/applied_max_model_len')}"
                           f"-rc{r.get('selector/applied_recompute')}" for r in sel_rows}),
    }


def arm_evals(segments: list[dict[str, object]]) -> list[dict[str, float]]:
    """The arm's validation evals on its clock: those of the last segment's result (each on
    the clock of the segment that ran its step: the one resumed last before it), and, for the
    steps the result lacks (evaluated in a segment later killed, or at the step of the
    checkpoint a restart resumed from), the eval lines as they came."""
    last = segments[-1]
    res = last["result"] if isinstance(last["result"], dict) else {}
    out: dict[float, dict[str, float]] = {}
    for ev in res.get("evals", []) or []:
        step = float(ev["step"])
        seg = [s for s in segments if int(str(s["resumed_at"])) < step][-1]
        wall = float(str(seg["spawned_s"])) + float(ev["minutes"]) * 60 \
            - float(str(seg["wall_before"]))
        out[step] = {**{k: float(v) for k, v in ev.items()}, "wall_s": round(wall, 2)}
    for seg in segments:
        for ev in seg["evals"]:  # type: ignore[attr-defined]
            out.setdefault(float(ev["step"]), ev)
    return sorted(out.values(), key=lambda e: float(e["wall_s"]))


def _on_clock(seg: dict[str, object], row: dict[str, object]) -> float:
    """A step row's end on the arm's clock: its run's `wall_s` (resumed segments included)
    less the checkpoint's `wall_before`, from the segment's spawn."""
    return float(str(seg["spawned_s"])) + float(str(row["wall_s"])) \
        - float(str(seg["wall_before"]))


def oom_point(seg: dict[str, object]) -> dict[str, object]:
    """Where a segment was killed: the step it was training and the last finished step's
    longest trajectory and tokens (the killed step's are never logged)."""
    rows: list[dict[str, object]] = seg["rows"]  # type: ignore[assignment]
    last = rows[-1] if rows else {}
    return {"step": int(str(last.get("step", seg["resumed_at"]))) + 1,
            "last_ctx_max": last.get("ctx_max"), "last_step_tokens": last.get("train/tokens"),
            "ctx_max_so_far": max((float(str(r.get("ctx_max", 0))) for r in rows), default=0),
            "step_tokens_max_so_far": max((float(str(r.get("train/tokens", 0))) for r in rows),
                                          default=0),
            "recent_context_max": seg.get("recent_context_max"),
            "budget": seg["budget"], "kernel": bool(seg["kernel_oom_kills"])}


def first_plan(rows: list[dict[str, object]]) -> dict[str, int] | None:
    """A selector run's first applied layout (its `selector/applied_*`); None for a static
    run."""
    for r in rows:
        if "selector/applied_micro_batch_tokens" in r:
            return {k: int(float(str(r[f"selector/applied_{k}"]))) for k in (
                "max_model_len", "micro_batch_tokens", "trainer_dp", "trainer_tp",
                "rollout_replicas", "rollout_tp", "recompute") if f"selector/applied_{k}" in r}
    return None
