"""The sample ledger `earl chaos` judges a run by: every sample produced, acked by a training
step, or dropped with its reason, and the rewinds, appended to a file in the run folder as they
happen (`trained/ledger.jsonl`, beside the trainers' own records), so the driver holds none of
it in memory however long the run. A run that records nothing (`record_trained` off: every
`earl train` but the judged ones) keeps no ledger at all.

What was lost or trained twice is judged (`Ledger.summary`) against the trainers' records, not
against the acks: an ack says a step was asked to train a sample, not that the sample entered
its gradient. Not here: the trainers' records (`earl.stages.trainer`, read by
`earl.commands.chaos_oracle`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from earl.runtime.dock import Dock
from earl.runtime.dock_index import LostSample
from earl.stages.batch_types import batch_of

if TYPE_CHECKING:
    from earl.runtime import ActorGroup
    from earl.runtime.dock_index import Lease, Location

__all__ = ["Book", "Ledger", "LedgerDock"]


@dataclass(slots=True)
class Book:
    """The ledger read back: what it holds after replaying its records in order."""

    produced: dict[str, str] = field(default_factory=dict)   # sample id -> group id
    acked: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)    # sample id -> reason
    rewound: int = 0                                         # discarded by rewinds

    def apply(self, rec: dict[str, Any]) -> None:
        if "produced" in rec:
            ids, gids = rec["produced"]
            self.produced.update(zip(ids, gids, strict=True))
        elif "acked" in rec:
            self.acked += rec["acked"]
        elif "dropped" in rec:
            for sid, gid in rec["dropped"]:
                self.produced.setdefault(sid, gid)
                self.dropped[sid] = str(rec["reason"])
        elif "rewind" in rec:  # batches >= the step: the trainer went back before them
            step = int(rec["rewind"])
            keep = {s: g for s, g in self.produced.items() if batch_of(s) < step}
            self.rewound += len(self.produced) - len(keep)
            self.produced = keep
            self.acked = [s for s in self.acked if batch_of(s) < step]
            self.dropped = {s: r for s, r in self.dropped.items() if batch_of(s) < step}


class Ledger:
    """Appends the run's sample records to `path` (None: records nothing)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def _write(self, rec: dict[str, object]) -> None:
        if self.path is None:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1)  # a line at a time
        self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")

    def add_produced(self, ids: list[str], group_ids: list[str]) -> None:
        self._write({"produced": [list(ids), list(group_ids)]})

    def add_acked(self, locations: tuple[Location, ...]) -> None:
        self._write({"acked": [loc.sample_id for loc in locations]})

    def add_dropped(self, lost: list[LostSample], reason: str) -> None:
        self._write({"dropped": [[x.sample_id, x.group_id] for x in lost], "reason": reason})

    def rewind(self, step: int) -> None:
        """Forget batches >= `step`: the trainer went back to a checkpoint of that step."""
        self._write({"rewind": step})

    def read(self) -> Book:
        """The records so far, replayed in order."""
        book = Book()
        if self.path is not None and self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    book.apply(json.loads(line))
                except json.JSONDecodeError:
                    continue  # the last line, cut by a kill of the driver mid-write
        return book

    def summary(self, trained: Sequence[str], resident: Iterable[str] = ()) -> dict[str, object]:
        """The invariants, against `trained` (every sample id the trainer ranks recorded as
        trained, a multiset: `earl.stages.trainer.TrainerActor`) and `resident` (ids still in
        the dock, not yet trained).

        `samples_lost`: produced, and neither trained, nor dropped with a reason, nor still in
        the dock. `samples_duplicated`: extra trainings of a sample, or of a group (a group
        re-played after it was trained: two plays' ids of one group).
        `samples_acked_untrained`: acked by a step that never trained them (a subset of lost).

        Raises:
            ValueError: the ledger records nothing (no `path`): there is nothing to judge.
        """
        if self.path is None:
            raise ValueError("this run kept no sample ledger: set record_trained=true")
        book = self.read()
        done = set(trained)
        dup_samples = len(trained) - len(done)
        plays: dict[str, set[str]] = {}
        for s in done:
            if (g := book.produced.get(s)) is not None:
                plays.setdefault(g, set()).add(s.rsplit("-", 1)[0])
        dup_groups = sum(len(p) - 1 for p in plays.values())
        missing = set(book.produced) - done - set(book.dropped) - set(resident)
        reasons: dict[str, int] = {}
        for r in book.dropped.values():
            reasons[r] = reasons.get(r, 0) + 1
        return {"samples_produced": len(book.produced), "samples_trained": len(trained),
                "samples_acked": len(book.acked),
                "samples_acked_untrained": len(set(book.acked) - done),
                "samples_dropped": reasons, "samples_rewound": book.rewound,
                "samples_lost": len(missing), "lost_ids": sorted(missing)[:20],
                "samples_duplicated": dup_samples + dup_groups}

    def reset(self) -> None:
        """Start the file afresh (a fresh run in a folder an earlier run used)."""
        self.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class LedgerDock(Dock):
    """A `Dock` client that writes each acked (or dropped) lease's samples to `ledger`."""

    def __init__(self, index: ActorGroup[object], ledger: Ledger) -> None:
        super().__init__(index)
        self.ledger = ledger

    async def ack(self, lease: Lease) -> None:
        await super().ack(lease)
        self.ledger.add_acked(lease.samples)

    async def drop(self, lease: Lease, reason: str) -> None:
        await super().ack(lease)
        self.ledger.add_dropped(
            [LostSample(loc.sample_id, loc.group_id, ()) for loc in lease.samples], reason)
