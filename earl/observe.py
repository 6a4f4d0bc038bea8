"""Observability of a run: progress line, metrics (JSONL + TensorBoard), Chrome trace, plots.

- `Metrics` appends one JSON object per step to `metrics.jsonl` and mirrors scalars to
  TensorBoard (`tb/`).
- `Tracer` records spans (`with tracer.span("train_step", actor="trainer"):`) and writes a
  Chrome/Perfetto trace (`trace.json`, open in ui.perfetto.dev or chrome://tracing).
- `progress_line` formats the one-line status printed every step.
- `write_plots` draws the reward/win-rate curve and context lengths to PNG.
- `tree_rss_mib` is a process' resident memory with its children's (a soak, a benchmark).

Nothing here decides anything about training; all of it is optional output.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO


class Metrics:
    """Per-step scalars to `<dir>/metrics.jsonl` (and TensorBoard when available)."""

    def __init__(self, out_dir: Path, *, tensorboard: bool = True, append: bool = False) -> None:
        self.path = out_dir / "metrics.jsonl"
        self._f = open(self.path, "a" if append else "w")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(out_dir / "tb"))
            except ImportError:  # tensorboard is a declared dependency; keep runs alive anyway
                self._tb = None

    def log(self, record: dict[str, float | int | str]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        if self._tb is not None and "step" in record:
            step = int(record["step"])
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self) -> None:
        self._f.close()
        if self._tb is not None:
            self._tb.close()


def tree_rss_mib(pid: int, *, private: bool = False) -> float:
    """Summed RSS (MiB) of process `pid` and all its descendants; 0 once it is gone. With
    `private`, their USS instead: the pages only each process maps (no shared memory, such as
    the dock's shm arenas a consumer maps too; slower: it reads smaps)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0
    for p in procs:
        try:
            total += p.memory_full_info().uss if private else p.memory_info().rss
        except psutil.Error:  # gone meanwhile
            continue
    return total / 2**20


def read_metrics(path: Path) -> list[dict[str, float | int | str]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Tracer:
    """Chrome trace events ("X" complete events); disabled tracers cost one branch per span.

    With `spool` each event is appended to that file as it comes (a JSON line), so a long run
    holds none of them in memory; `write` assembles the trace from it. Without, they are kept
    in `events`."""

    def __init__(self, enabled: bool, *, spool: Path | None = None) -> None:
        self.enabled, self.spool = enabled, spool
        self.events: list[dict[str, object]] = []
        self._t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._spooled: IO[str] | None = None  # the spool's handle, opened at the first event
        if enabled and spool is not None:
            spool.write_text("")  # a fresh trace: an earlier run's events are not this one's

    @contextlib.contextmanager
    def span(self, name: str, *, actor: str, **args: object) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, actor=actor, start=start, end=time.perf_counter(), **args)

    def add(self, name: str, *, actor: str, start: float, end: float, **args: object) -> None:
        if not self.enabled:
            return
        with self._lock:
            tid = self._tids.setdefault(actor, len(self._tids) + 1)
            event = {"name": name, "ph": "X", "pid": 1, "tid": tid,
                     "ts": (start - self._t0) * 1e6, "dur": (end - start) * 1e6, "args": args}
            if self.spool is None:
                self.events.append(event)
            else:
                if self._spooled is None:
                    self._spooled = self.spool.open("a", buffering=1)  # a line at a time
                self._spooled.write(json.dumps(event, default=str) + "\n")

    def write(self, path: Path) -> Path:
        """The trace so far as `path` (Chrome's JSON object format), written line by line."""
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": a}}
                for a, tid in self._tids.items()]
        with path.open("w") as out:
            out.write('{"displayTimeUnit": "ms", "traceEvents": [\n')
            out.write(",\n".join(json.dumps(e) for e in meta + self.events))
            first = not (meta or self.events)
            if self.spool is not None and self.spool.is_file():
                with self.spool.open() as f:
                    for line in f:
                        if line.strip():
                            out.write(("" if first else ",\n") + line.rstrip("\n"))
                            first = False
            out.write("\n]}\n")
        return path


def progress_line(r: dict[str, float | int | str]) -> str:
    """`step 12/200 | reward +0.41 | win 0.62 draw 0.08 | 3.1k tok/s | staleness 0.9 | 41 s`
    (the outcome rates only where the episodes report an outcome; failures with the step's most
    frequent error, over-sampled groups cut, groups dropped as stale and groups skipped as
    alike only where there are some)."""
    rates = "".join(f"{name} {float(r[f'info/outcome={name}']):.2f} "
                    for name in ("win", "draw") if f"info/outcome={name}" in r)
    failed = f"failed {float(r['failed_rate']):.2f} ({r.get('failed_error', '')}) | " \
        if float(r.get("failed_rate", 0)) else ""
    cut = f"{int(r['groups_cut'])} groups cut | " if int(r.get("groups_cut", 0)) else ""
    stale = f"{int(r['stale_groups'])} stale groups dropped | " \
        if int(r.get("stale_groups", 0)) else ""
    alike = f"{int(r['filtered_groups'])} alike groups skipped | " \
        if int(r.get("filtered_groups", 0)) else ""
    return (f"step {r['step']}/{r['steps']} | reward {float(r['reward']):+.2f} | "
            + (f"{rates.strip()} | " if rates else "") + failed + cut + stale + alike
            + f"{float(r['tokens_per_s']) / 1000:.1f}k tok/s | "
            f"staleness {float(r['staleness']):.1f} | {float(r['wall_s']):.0f} s")


def write_plots(metrics: list[dict[str, float | int | str]],
                evals: list[dict[str, float]], out_dir: Path, *, key: str = "reward",
                title: str = "") -> dict[str, str]:
    """`reward.png` (train reward and the eval metric `key` vs minutes) and `context.png`."""
    os.environ.setdefault("MPLBACKEND", "Agg")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, str] = {}
    steps = [m for m in metrics if "reward" in m]
    fig, ax = plt.subplots(figsize=(7, 4))
    if steps:
        t = [float(m["wall_s"]) / 60 for m in steps]
        ax.plot(t, [float(m["reward"]) for m in steps], label="mean reward (train)", alpha=0.6)
    evals = [e for e in evals if key in e and "minutes" in e]
    if evals:
        ax.plot([e["minutes"] for e in evals], [e[key] for e in evals], "o-",
                label=f"{key} (eval, greedy)", color="black")
    ax.set_xlabel("wall minutes")
    ax.set_ylabel("rate / reward")
    ax.set_title(title or "training")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    paths["reward"] = str(out_dir / "reward.png")
    fig.savefig(paths["reward"], dpi=90)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    if steps:
        ax.plot([int(m["step"]) for m in steps], [float(m["ctx_mean"]) for m in steps],
                label="mean")
        ax.plot([int(m["step"]) for m in steps], [float(m["ctx_max"]) for m in steps],
                label="max")
    ax.set_xlabel("step")
    ax.set_ylabel("trajectory tokens")
    ax.set_title("context length")
    ax.legend()
    fig.tight_layout()
    paths["context"] = str(out_dir / "context.png")
    fig.savefig(paths["context"], dpi=90)
    plt.close(fig)
    return paths
