"""The evidence `earl chaos` judges a run by, and the fault that tests the judge.

`judge` reads the run's sample ledger back (`earl.loop.ledger.Ledger`: produced, acked,
dropped with a reason, rewound) and checks it against what the trainer ranks recorded, before
each step's ack, as the sample ids their step trained (`read_trained`:
`trained/trained.<rank>.jsonl`, written with `record_trained`): a sample counts as trained
only there, never by the driver's ack, which says a step was asked to train a sample, not that
the sample entered its gradient.

`lose_a_sample` is the fault `lose:sample`: it loses one sample on purpose, the way a
dispatcher bug would: the next step's plan leaves one sample out of a micro-batch, the trainer
never sees it, and the lease is acked whole. An oracle that reads acks counts it as trained;
this one must report it lost and fail the run's verdict.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from earl.runtime.dispatch import DispatchPlan
from earl.stages.batch_types import batch_of
from earl.stages.id_runs import unpack

__all__ = ["Book", "drop_one", "judge", "lose_a_sample", "out_of_step", "read_ledger",
           "read_records", "read_trained"]


def read_records(folder: Path) -> Iterator[tuple[int, list[str]]]:
    """Each record the trainer replicas wrote: (step, the sample ids it trained)."""
    for path in sorted(folder.glob("trained.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line, cut by a kill mid-write (its step was never acked)
            yield int(rec["step"]), list(unpack(rec["sample_ids"]))


def read_trained(folder: Path) -> list[str]:
    """Every sample id the trainer replicas recorded as trained (a multiset)."""
    return [sid for _, ids in read_records(folder) for sid in ids]


def out_of_step(records: Iterable[tuple[int, list[str]]]) -> list[str]:
    """Sample ids trained (`read_records`) at a step other than their batch's: step b + 1 trains
    batch b and nothing else (`earl.loop.schedule`), so a checkpoint of step b + 1 holds
    every batch before b + 1. One trained out of its step can be lost, or trained twice, by
    a rewind to that checkpoint."""
    return [sid for step, ids in records for sid in ids if batch_of(sid) != step - 1]


@dataclass(slots=True)
class Book:
    """The ledger read back: what it holds after replaying its records in order."""

    produced: dict[str, str] = field(default_factory=dict)   # sample id -> group id
    acked: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)    # sample id -> reason
    rewound: int = 0                                         # discarded by rewinds

    def apply(self, rec: dict[str, Any]) -> None:
        if "produced" in rec:
            for gid, ids in rec["produced"]:
                self.produced.update(dict.fromkeys(unpack(ids), gid))
        elif "acked" in rec:
            self.acked += unpack(rec["acked"])
        elif "dropped" in rec:
            for gid, ids in rec["dropped"]:
                for sid in unpack(ids):
                    self.produced.setdefault(sid, gid)
                    self.dropped[sid] = str(rec["reason"])
        elif "rewind" in rec:  # batches >= the step: the trainer went back before them
            step = int(rec["rewind"])
            keep = {s: g for s, g in self.produced.items() if batch_of(s) < step}
            self.rewound += len(self.produced) - len(keep)
            self.produced = keep
            self.acked = [s for s in self.acked if batch_of(s) < step]
            self.dropped = {s: r for s, r in self.dropped.items() if batch_of(s) < step}



def read_ledger(path: Path | None) -> Book:
    """The ledger's records so far (`earl.loop.ledger.Ledger`), replayed in order (None: a
    run that kept none)."""
    book = Book()
    if path is not None and path.is_file():
        for line in path.read_text().splitlines():
            try:
                book.apply(json.loads(line))
            except json.JSONDecodeError:
                continue  # the last line, cut by a kill of the driver mid-write
    return book


def judge(ledger: Path | None, trained: Sequence[str], resident: Iterable[str] = ()
          ) -> dict[str, object]:
    """The invariants of the run that kept `ledger`, against `trained` (every sample id the
    trainer ranks recorded as trained, a multiset: `earl.stages.trainer.TrainerActor`) and
    `resident` (ids still in the dock, not yet trained).

    `samples_lost`: produced, and neither trained, nor dropped with a reason, nor still in
    the dock. `samples_duplicated`: extra trainings of a sample, or of a group (a group
    re-played after it was trained: two plays' ids of one group).
    `samples_acked_untrained`: acked by a step that never trained them (a subset of lost).

    Raises:
        ValueError: the run kept no ledger (None): there is nothing to judge.
    """
    if ledger is None:
        raise ValueError("this run kept no sample ledger: set record_trained=true")
    book = read_ledger(ledger)
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


def drop_one(plan: DispatchPlan) -> tuple[DispatchPlan, str] | None:
    """`plan` without one sample of a micro-batch that has two or more (None: none has)."""
    for i, r in enumerate(plan.replicas):
        for j, mb in enumerate(r.micro_batches):
            if len(mb) >= 2:
                gone = mb[-1]
                replica = dataclasses.replace(
                    r, sample_ids=tuple(s for s in r.sample_ids if s != gone),
                    micro_batches=(*r.micro_batches[:j], mb[:-1], *r.micro_batches[j + 1:]))
                replicas = (*plan.replicas[:i], replica, *plan.replicas[i + 1:])
                return dataclasses.replace(plan, replicas=replicas), gone
    return None


def lose_a_sample(lost: list[str]) -> Callable[[], None]:
    """Make the next step's plan (`earl.stages.trainer_feed.plan_for`) leave one sample out;
    its id goes to `lost`. Returns the undo (done by itself after one loss)."""
    from earl.stages import trainer_feed

    plan_for = trainer_feed.plan_for

    def undo() -> None:
        trainer_feed.plan_for = plan_for

    def losing(*args: object, **kw: object) -> DispatchPlan:
        plan = plan_for(*args, **kw)  # type: ignore[arg-type]
        if (cut := drop_one(plan)) is None:
            return plan
        undo()
        lost.append(cut[1])
        return cut[0]

    trainer_feed.plan_for = losing
    return undo
