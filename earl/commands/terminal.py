"""What `earl train` shows a person: a progress bar, and a line for each event.

On a terminal, a rich progress bar stands at the bottom (steps, the run's share done, its last
reward and throughput) and each event (an eval, a healing, a new failure, a warning) is printed
above it as one line. Piped into a file or CI log, where a live bar cannot redraw, a progress
line is printed each time the run gets a further `1 / LINES` along (by steps or by its time limit,
whichever is nearer), besides the event lines. Every step's line is in `<output_dir>/run.log`
and `metrics.jsonl` either way (`earl.loop.job.Job.step`); `--quiet` shows nothing here.

Not here: what a line says (`earl.observe.progress_line`), the run itself (`earl.run`).
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from earl.observe import progress_line

__all__ = ["LINES", "Terminal"]

LINES = 10  # piped output: a progress line per tenth of the run


class Terminal:
    """The person's view of one run.

    Args:
        stream: where to write (stderr under `--json`, so stdout stays one JSON line).
        quiet: show nothing.
        time_limit_s: the run's time limit (0: none); with `steps` it sets how far along it is.
        live: draw a live bar (None: when `stream` is a terminal).
    """

    def __init__(self, stream: TextIO = sys.stdout, *, quiet: bool = False,
                 time_limit_s: float = 0.0, live: bool | None = None) -> None:
        self.quiet, self.time_limit_s = quiet, time_limit_s
        self._console = Console(file=stream, highlight=False, soft_wrap=True)
        self._stream = stream
        self._live = self._console.is_terminal if live is None else live
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._next = 1  # piped: the tenth of the run at which the next line is printed
        self._last: dict[str, Any] | None = None  # the newest step not yet printed (piped)

    def event(self, line: str) -> None:
        """An event: one line, above the bar."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(line, markup=False)
        else:
            print(line, file=self._stream, flush=True)

    def step(self, row: dict[str, Any]) -> None:
        """A trained step's metrics row (`earl.loop.step_log.step_row`)."""
        if self.quiet:
            return
        done = self.share(row)
        if self._live:
            self._draw(row, done)
        elif (k := int(done * LINES + 1e-9)) >= self._next:
            print(progress_line(row), file=self._stream, flush=True)
            self._next = k + 1
            self._last = None
        else:
            self._last = row

    def share(self, row: dict[str, Any]) -> float:
        """How far along the run is: by steps or by its time limit, whichever is further."""
        by_steps = float(row["step"]) / max(float(row["steps"]), 1.0)
        by_time = float(row["wall_s"]) / self.time_limit_s if self.time_limit_s > 0 else 0.0
        return min(max(by_steps, by_time), 1.0)

    def close(self) -> None:
        """End the bar (its last state stays on screen); piped: the last step's line."""
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        if self._last is not None and not self.quiet:
            print(progress_line(self._last), file=self._stream, flush=True)
            self._last = None

    def _draw(self, row: dict[str, Any], done: float) -> None:
        if self._bar is None:
            self._bar = Progress(
                TextColumn("step {task.fields[step]}"), BarColumn(),
                TextColumn("{task.percentage:>3.0f}%"), TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"), console=self._console, transient=False)
            self._bar.start()
            self._task = self._bar.add_task("train", total=1000, step="", status="")
        assert self._task is not None
        failed = float(row.get("failed_rate", 0.0))
        status = (f"reward {float(row['reward']):+.2f} | "
                  + (f"failed {failed:.2f} | " if failed else "")
                  + f"{float(row['tokens_per_s']) / 1000:.1f}k tok/s")
        self._bar.update(self._task, completed=round(done * 1000), status=status,
                         step=f"{row['step']}/{row['steps']}")
