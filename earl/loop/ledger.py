"""The sample ledger `earl chaos` judges a run by: every sample produced, acked by a training
step, or dropped with its reason, and the rewinds, appended to a file in the run folder as they
happen (`trained/ledger.jsonl`, beside the trainers' own records), so the driver holds none of
it in memory however long the run. A run that records nothing (`record_trained` off: every
`earl train` but the judged ones) keeps no ledger at all. Id lists are written as runs
(`earl.stages.id_runs`), ~25x smaller than the ids one by one.

Not here: reading it back and judging it against the trainers' records
(`earl.commands.chaos_oracle`), the records themselves (`earl.stages.trainer`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING

from earl.runtime.dock import Dock
from earl.runtime.dock_index import LostSample
from earl.stages.id_runs import pack

if TYPE_CHECKING:
    from earl.runtime import ActorGroup
    from earl.runtime.dock_index import Lease, Location

__all__ = ["Ledger", "LedgerDock"]


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
        self._write({"produced": _by_group(zip(ids, group_ids, strict=True))})

    def add_acked(self, locations: tuple[Location, ...]) -> None:
        self._write({"acked": pack(sorted(loc.sample_id for loc in locations))})

    def add_dropped(self, lost: list[LostSample], reason: str) -> None:
        self._write({"dropped": _by_group((x.sample_id, x.group_id) for x in lost),
                     "reason": reason})

    def rewind(self, step: int) -> None:
        """Forget batches >= `step`: the trainer went back to a checkpoint of that step."""
        self._write({"rewind": step})

    def reset(self) -> None:
        """Start the file afresh (a fresh run in a folder an earlier run used)."""
        self.close()
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _by_group(pairs: Iterable[tuple[str, str]]) -> list[list[object]]:
    """(sample id, group id) pairs as `[[group id, packed ids], ...]`: rows are put as their
    groups finish, so a batch's group ids interleave and pack poorly side by side."""
    groups: dict[str, list[str]] = {}
    for sid, gid in pairs:
        groups.setdefault(gid, []).append(sid)
    return [[gid, pack(sorted(ids))] for gid, ids in groups.items()]


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
