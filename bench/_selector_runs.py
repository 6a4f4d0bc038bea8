"""One run of `bench/selector.py`'s sweep: its layout (`Config`), the `earl train` child that
runs it, what its files say (`one`: outcome, tokens/s, contexts, learning, the selector's
changes, rates per context bucket), its slots' CPU time and throttling (`SlotCpuSampler`),
the same work at another run's rates (`matched_seconds`),
and the resume by code (`run_or_read_back`, `code_key`, `device_sizes`): a finished run is read back from
`--out` when the code it executes, the warm start and its arguments are unchanged."""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
from dataclasses import dataclass
from typing import Self

import _results

# what a run executes: a finished run is read back only if these are unchanged (`code_key`)
CODE = ("earl", "runtime", "agents", "envs", "bench/selector.py", "bench/_selector_runs.py",
        "bench/_results.py",
        "pyproject.toml")
# what only a run with the selector on executes: `earl train --selector off` builds no
# `Selection`, policy or reconfigurer (earl.loop.spawn; of these modules it runs only their
# definitions, imported), so a static run's key leaves them out and a change of the policy
# re-runs the selector run alone
SELECTOR_ONLY = ("earl/loop/selection.py", "earl/loop/selection_actors.py",
                 "earl/loop/setting.py", "runtime/selector/policy.py",
                 "runtime/selector/policy_config.py", "runtime/selector/plan.py",
                 "runtime/selector/cost.py", "runtime/selector/switching.py")


@dataclass(frozen=True)
class Config:
    """One run's layout: devices, rollout replicas x TP, trainer DP, window, micro-batch budget."""

    devices: int
    replicas: int
    rollout_tp: int
    trainer: int
    window: int
    budget: int
    selector: bool = False
    first_context: int = 0  # the selector's first plan assumes contexts this long

    @property
    def name(self) -> str:
        tp = f"tp{self.rollout_tp}" if self.rollout_tp > 1 else ""
        kind = "selector" if self.selector else "static"
        return (f"{kind}/d{self.devices}/r{self.replicas}{tp}-t{self.trainer}"
                f"/w{self.window}/mb{self.budget // 1024}k")

    def args(self, device_mib: int) -> list[str]:
        out = [f"--placement.devices={self.devices}", f"--placement.slot_memory_mib={device_mib}",
               f"--placement.rollout={self.replicas}", f"--placement.rollout_tp={self.rollout_tp}",
               f"--placement.trainer={self.trainer}", f"--placement.context_window={self.window}",
               f"--placement.micro_batch_tokens={self.budget}"]
        if self.selector:
            out += ["--selector.mode=on", f"--selector.initial_context={self.first_context}"]
        return out


# `earl train` as a child process, printing the whole exception chain on failure (the CLI
# prints one line; an actor's "out of memory in slot ..." is the cause of the error it shows).
_CHILD = """
import asyncio, json, sys, traceback
from earl.config import load_config
from earl.run import run
cfg = load_config(None, sys.argv[1:])
try:
    res = asyncio.run(run(cfg, log=lambda line: print(line, file=sys.stderr, flush=True)))
except BaseException as exc:
    traceback.print_exception(exc)
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(1)
print(json.dumps(res.to_json()))
"""


def run_earl(args: list[str], timeout: float,
             slot_cpu: dict[str, dict[str, float | None]] | None = None) -> tuple[int, str, str]:
    """`earl train` with `args` as a child: its exit status, stdout and stderr (124, "",
    "timeout" past `timeout` s). `slot_cpu`, when given, receives its slots' CPU accounting
    (`SlotCpuSampler.slot_cpu`), a run cut by the timeout's too."""
    import contextlib
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.Popen([sys.executable, "-c", _CHILD, *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    sampler = SlotCpuSampler(p.pid) if slot_cpu is not None else None
    timed_out = False
    with sampler or contextlib.nullcontext():
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            timed_out = True
    if sampler is not None and slot_cpu is not None:
        slot_cpu.update(sampler.slot_cpu())
    return (124, "", "timeout") if timed_out else (p.returncode, out, err)


def _plus(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return b if a is None else a
    return a + b


class Sampler:
    """Calls `read()` every `every` s on a daemon thread while in its `with` block (the slot
    samplers of a run: `SlotCpuSampler`, `_selector_memory_runs.CgroupPeaks`)."""

    def __init__(self, every: float = 1.0) -> None:
        self.every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.read()

    def read(self) -> None:
        raise NotImplementedError


class SlotCpuSampler(Sampler):
    """Reads the CPU accounting of child `pid`'s slots (its `SlotPool`'s groups
    ``earl-<pid>/<slot>``, beside this process's own, which the child inherits) every `every`
    s while it runs, with `earl.runtime.cgroups.read_slot_cpu` as `SlotPool.cpu_usage` does: the
    pool removes its groups at exit, so a slot's last reading stands for the run (the last
    `every` s of a group may be missed). A group made anew (a joined slot released and joined
    again) counts from zero: the earlier one's last reading is added to it."""

    def __init__(self, pid: int, every: float = 1.0) -> None:
        from earl.runtime.cgroups import own_cgroup
        from earl.runtime.slots import CPU_ROOT, CPUACCT_ROOT

        super().__init__(every)
        tag = f"earl-{pid}"
        self._cpu = os.path.join(CPU_ROOT, own_cgroup("cpu").lstrip("/"), tag)
        self._acct = os.path.join(CPUACCT_ROOT, own_cgroup("cpuacct").lstrip("/"), tag)
        self._last: dict[str, tuple[int, dict[str, float | None]]] = {}  # group inode, reading
        self._gone: dict[str, dict[str, float | None]] = {}  # groups of the slot made earlier

    def read(self) -> None:
        """One reading of every slot group there is now."""
        from earl.runtime.cgroups import read_int, read_slot_cpu

        # cpu and cpuacct mounted as one hierarchy: the cpu groups count too (as SlotPool's)
        acct = self._acct if os.path.isdir(self._acct) else self._cpu
        try:
            names = [n for n in os.listdir(acct) if os.path.isdir(os.path.join(acct, n))]
        except OSError:
            return
        for name in names:
            d, q = os.path.join(acct, name), os.path.join(self._cpu, name)
            try:
                quota = q if os.path.isdir(q) and read_int(f"{q}/cpu.cfs_quota_us") > 0 else ""
                ino, got = os.stat(d).st_ino, read_slot_cpu(d, quota)
            except (OSError, ValueError, KeyError):  # a group going as the pool closes
                continue
            last = self._last.get(name)
            if last is not None and last[0] != ino:
                was = self._gone.setdefault(name, {})
                for k, v in last[1].items():
                    was[k] = _plus(was.get(k), v)
            self._last[name] = ino, {"cpu_s": got.cpu_s, "throttled_s": got.throttled_s,
                                     "nr_throttled": got.nr_throttled}

    def slot_cpu(self) -> dict[str, dict[str, float | None]]:
        """Slot name -> `cpu_s`, `throttled_s`, `nr_throttled` over the run (the last two None
        for a slot without a CPU share)."""
        out: dict[str, dict[str, float | None]] = {}
        for name, (_, now) in sorted(self._last.items()):
            was = self._gone.get(name, {})
            out[name] = {k: _plus(was.get(k), v) for k, v in now.items()}
            for k in ("cpu_s", "throttled_s"):
                if (v := out[name][k]) is not None:
                    out[name][k] = round(v, 3)
        return out


def _rows(out: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    from pathlib import Path

    path = Path(out) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if "reward" in r], [r for r in rows if "selector/when" in r]


def _p95(xs: list[int]) -> float:
    return float(sorted(xs)[min(len(xs) - 1, int(0.95 * len(xs)))]) if xs else 0.0


def _trajectories(out: str, window: int, played: dict[int, int]) -> dict[str, float]:
    """Per batch, its trajectories' token counts: p95 over the first and the last tenth of the
    batches, and the share cut by the window it was played with (`played`: batch -> window,
    from the selector's rollout decisions; else `window`), within a turn of it: all of them
    (`cut_rate`) and those cut by a window shorter than the model's positions
    (`cut_rate_below_model`; a cut at the model's own positions no layout or window avoids)."""
    from pathlib import Path

    from earl.recipes.gauntlet import MAX_MODEL_LEN
    from earl.stages.batch_types import batch_of

    path = Path(out) / "trajectories.jsonl"
    per: dict[int, list[int]] = {}
    cut = below = total = 0
    for line in path.read_text().splitlines() if path.is_file() else []:
        t = json.loads(line)
        b, n = batch_of(str(t["sample_id"])), len(t["token_ids"])
        per.setdefault(b, []).append(n)
        total += 1
        w = played.get(b, window)
        was_cut = bool(t["truncated"]) and n >= w - 32
        cut += was_cut
        below += was_cut and w < MAX_MODEL_LEN
    batches = sorted(per)
    tenth = max(1, len(batches) // 10)
    first = _p95([n for b in batches[:tenth] for n in per[b]])
    last = _p95([n for b in batches[-tenth:] for n in per[b]])
    return {"p95_first_tenth": first, "p95_last_tenth": last,
            "context_growth": round(last / first, 2) if first else 0.0,
            "cut_rate": round(cut / max(total, 1), 4),
            "cut_rate_below_model": round(below / max(total, 1), 4)}


def cut_below_model(run: dict[str, object], top: int) -> float:
    """The share of `run`'s trajectories cut by a window shorter than the model's positions
    `top`. A run saved before that was counted has only `cut_rate`: its cuts are all at `top`
    when every window it played was `top` (its `layouts`, else its `window`), else all count."""
    if "cut_rate_below_model" in run or not run["cut_rate"]:
        return float(str(run.get("cut_rate_below_model", 0.0)))
    layouts = [str(x) for x in run.get("layouts", []) or []]  # type: ignore[attr-defined]
    windows = {int(x.rsplit("-w", 1)[1]) for x in layouts} or {int(str(run["window"]))}
    return 0.0 if min(windows) >= top else float(str(run["cut_rate"]))


def code_key(leave_out: tuple[str, ...] = ()) -> str | None:
    """The code a run executes (the blobs of `CODE` but `leave_out`), hashed; None when one
    of them differs from the commit (nothing is read back then)."""
    import hashlib
    import subprocess

    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(_results.REPO), *a], capture_output=True,
                              text=True, check=True, timeout=30).stdout

    try:
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
        if any(line[3:] not in leave_out for line in changed.splitlines()):
            return None
        blobs = [line for line in git("ls-tree", "-r", "HEAD", "--", *CODE).splitlines()
                 if line.split("\t", 1)[1] not in leave_out]
        return hashlib.sha256("\n".join(blobs).encode()).hexdigest()[:16]
    except (OSError, subprocess.SubprocessError):
        return None


def sha256_16(path: str) -> str:
    import hashlib

    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


# a saved run is read back only on a machine this close to the one it ran on (`machine_speed`)
SPEED_TOLERANCE = 0.10


def machine_speed(trials: int = 30) -> dict[str, float]:
    """This machine's speed at the runs' two kinds of work (`_machine`: fp32 matmul GFLOP/s,
    memcpy GB/s of 256 MiB), fastest of `trials` matmuls and of up to 7 copies (within ~2%
    from probe to probe here): a run saved on another machine is compared with it."""
    from _machine import matmul_gflops, memcpy_gbps

    return {"matmul_gflops": round(matmul_gflops(reps=trials), 1),
            "copy_gbps": round(memcpy_gbps(256 << 20, min(trials, 7)), 2)}


def speed_differs(now: dict[str, float], then: object) -> str:
    """Why a run measured on a machine of speed `then` is not this one's (`now`), or ''."""
    if not isinstance(then, dict):
        return ""  # saved before runs recorded it: unchecked
    far = [f"{k} {then[k]} then, {v} now" for k, v in now.items()
           if k in then and abs(v / float(then[k]) - 1) > SPEED_TOLERANCE]
    return "; ".join(far)


def run_or_read_back(cfg: Config, args: list[str], root: str, code: str | None, timeout: float,
             device_mib: int, speed: dict[str, float]) -> tuple[dict[str, object], bool]:
    """The run of `cfg` with `args`: read back from `root` when an earlier invocation with the
    same `--out` finished it with the same `code` (`code_key()`/ the warm start's weights hash;
    None: the tree differs from its commit, nothing is read back) and arguments on a machine
    of this one's `speed` (within `SPEED_TOLERANCE`), else run now and saved there."""
    import datetime

    saved = f"{root}/{cfg.name.replace('/', '_')}.result.json"
    key = {"code": code, "args": args}
    if code and os.path.isfile(saved):
        with open(saved) as f:
            done = json.load(f)
        if done.get("key") == key:
            why = speed_differs(speed, done["run"].get("machine_speed"))
            if not why:
                return done["run"], True
            print(f"{cfg.name}: run again, another machine ran it ({why})", file=sys.stderr)
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    run = {**one(cfg, args, root, timeout), "device_mib": device_mib, "started": started,
           "load_avg_1m_before": load, "commit": _results.git_state()["commit"],
           "machine_speed": speed}
    with open(saved, "w") as f:
        json.dump({"key": key, "run": run}, f)
    return run, False


def one(cfg: Config, args: list[str], root: str, timeout: float) -> dict[str, object]:
    out = f"{root}/{cfg.name.replace('/', '_')}"
    slot_cpu: dict[str, dict[str, float | None]] = {}
    rc, stdout, stderr = run_earl([*args, f"--output_dir={out}"], timeout, slot_cpu)
    with open(f"{out}.log", "w") as f:  # the run's progress lines and errors, to look at
        f.write(stderr)
    last = stdout.strip().splitlines()[-1] if stdout.strip() else "{}"
    res = json.loads(last) if last.startswith("{") else {}
    steps, sel = _rows(out)
    oom = rc != 0 and "out of memory in slot" in stderr
    step_s = [float(str(r["step_s"])) for r in steps]
    tokens = [float(str(r.get("train/tokens", 0))) for r in steps]
    tenth = max(1, len(steps) // 10)
    played = {int(str(r["selector/step"])): int(str(r["selector/applied_max_model_len"]))
              for r in sel if r["selector/when"] == "rollout"}
    reconf = [float(str(r.get("selector/reconfig_s", 0.0))) for r in sel]

    def counter(key: str) -> int:
        return max((int(str(r.get(f"selector/{key}", 0))) for r in sel), default=0)

    # played but not trained in its step (a step trains its episodes plus self-imitation
    # replays, so it never trains fewer than it played unless some were lost)
    lost = sum(max(0, int(str(r["episodes"])) - int(float(str(r.get("train/samples", 0)))))
               for r in steps)
    return {
        "config": cfg.name, "devices": cfg.devices,
        "rollout": f"{cfg.replicas}x{cfg.rollout_tp}", "trainer_dp": cfg.trainer,
        "window": cfg.window, "micro_batch_tokens": cfg.budget,
        "outcome": "oom" if oom else "finished" if rc == 0 else f"error ({rc})",
        "error": str(res.get("error", "")).splitlines()[0] if rc and res.get("error") else "",
        "steps": len(steps), "oom_step": len(steps) if oom else None,
        "loop_s": round(sum(step_s), 2), "trained_tokens": int(sum(tokens)),
        "tokens_per_s": round(sum(tokens) / sum(step_s), 1) if sum(step_s) else 0.0,
        "tokens_per_s_first_tenth": round(sum(tokens[:tenth]) / sum(step_s[:tenth]), 1)
        if sum(step_s[:tenth]) else 0.0,
        **_trajectories(out, cfg.window, played),
        "reward_first_tenth": round(statistics.fmean(
            float(str(r["reward"])) for r in steps[:tenth]), 3) if steps else 0.0,
        "reward_last_tenth": round(statistics.fmean(
            float(str(r["reward"])) for r in steps[-tenth:]), 3) if steps else 0.0,
        "final_eval": res.get("eval", {}), "samples_lost": lost + counter("queue/lost"),
        "reconfigurations": counter("reconfigurations"),
        "trainer_layout_changes": counter("trainer_layout_changes"),
        "rollout_layout_changes": counter("rollout_layout_changes"),
        "device_moves": counter("device_moves"),
        "reconfig_seconds": [round(x, 2) for x in reconf if x > 0],
        "layouts": sorted({f"r{r.get('selector/applied_rollout_replicas')}"
                           f"x{r.get('selector/applied_rollout_tp')}"
                           f"-t{r.get('selector/applied_trainer_dp')}"
                           f"-w{r.get('selector/applied_max_model_len')}" for r in sel}),
        "by_context": by_context(steps, tokens, step_s), "slot_cpu": slot_cpu,
    }


def _context_bucket(tokens: int) -> int:
    """Half-octaves from 256: 256, 384, 512, 768, 1024, 1536, ..."""
    b = 256
    while True:
        for v in (b, b * 3 // 2):
            if v >= tokens:
                return v
        b *= 2


def by_context(steps: list[dict[str, object]], tokens: list[float], step_s: list[float]
                ) -> dict[str, list[float]]:
    """Trained tokens and loop seconds per context bucket of each step's longest trajectory
    (its `ctx_max`): the run's rate at each context length."""
    out: dict[str, list[float]] = {}
    for r, tok, sec in zip(steps, tokens, step_s, strict=True):
        acc = out.setdefault(str(_context_bucket(int(float(str(r.get("ctx_max", 0)))))),
                             [0.0, 0.0])
        acc[0] += tok
        acc[1] += sec
    return {b: [round(t), round(sec, 3)] for b, (t, sec) in sorted(
        out.items(), key=lambda kv: int(kv[0]))}


def matched_seconds(run: dict[str, object], work: dict[str, list[float]]
                    ) -> tuple[float | None, float]:
    """The seconds `run` takes for `work` (tokens per context bucket, the selector run's) at
    its own measured rate in each bucket, and the share of the work's tokens in buckets it
    measured. A bucket it never reached takes its rate in the longest one below (a shorter
    context trains no slower per token: this favours `run`); None for a run that OOMed.

    The runs learn differently, so their contexts differ: tokens per second over a whole run
    compare different work (a run that learned less trains shorter, faster trajectories).
    This compares the same tokens at the same context lengths."""
    if run["outcome"] != "finished" or not _rates(run):
        return None, 0.0
    ran = _rates(run)
    total = seconds = direct = 0.0
    for b, (tokens, _) in work.items():
        seconds += tokens / rate_at(run, int(b))
        total += tokens
        direct += tokens if int(b) in ran else 0.0
    return seconds, direct / total if total else 0.0


def _rates(run: dict[str, object]) -> dict[int, float]:
    """`run`'s tokens/s in each context bucket it trained in."""
    return {int(b): t / sec for b, (t, sec) in run["by_context"].items()  # type: ignore[attr-defined]
            if t > 0 and sec > 0}


def rate_at(run: dict[str, object], bucket: int) -> float:
    """`run`'s tokens/s in `bucket`: its own, else in the longest bucket below it it ran (a
    shorter context trains no slower per token: this favours `run`), else in its shortest."""
    rates = _rates(run)
    below = [b for b in rates if b <= bucket]
    return rates[max(below)] if below else rates[min(rates)]


def _machine(device_mib: int, cores: int) -> dict[int, int]:
    """Devices -> MiB per device: `device_mib`, or a quarter of MemAvailable split evenly."""
    if device_mib:
        return {cores: device_mib, 2 * cores: device_mib}
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) // 1024 for line in f
                     if line.startswith("MemAvailable:"))
    return {n: avail // 4 // n for n in (cores, 2 * cores)}


def device_sizes(root: str, device_mib: int, cores: int) -> dict[int, int]:
    """Devices -> MiB per device (`_machine`), kept in `root`: an invocation resumed with the
    same `--out` reuses the sizes its first one took (MemAvailable drifts between invocations,
    and a run's device size is one of the arguments it is resumed by); `device_mib` sets them
    anew."""
    path = f"{root}/machine.json"
    if not device_mib and os.path.isfile(path):
        with open(path) as f:
            return {int(k): int(v) for k, v in json.load(f).items()}
    sizes = _machine(device_mib, cores)
    os.makedirs(root, exist_ok=True)
    with open(path, "w") as f:
        json.dump(sizes, f)
    return sizes
