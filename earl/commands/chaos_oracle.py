"""The evidence `earl chaos` judges a run by, and the fault that tests the judge.

`read_trained` reads what the trainer ranks recorded, before each step's ack, as the sample ids
their step trained (`trained/trained.<rank>.jsonl`, written with `record_trained`): the oracle
counts a sample as trained only there, never by the driver's ack (`Ledger.summary`).

`lose_a_sample` is the fault `lose:sample`: it loses one sample on purpose, the way a
dispatcher bug would: the next step's plan leaves one sample out of a micro-batch, the trainer
never sees it, and the lease is acked whole. An oracle that reads acks counts it as trained;
this one must report it lost and fail the run's verdict.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

from earl.runtime.dispatch import DispatchPlan

__all__ = ["drop_one", "lose_a_sample", "read_trained"]


def read_trained(folder: Path) -> list[str]:
    """Every sample id the trainer replicas recorded as trained (a multiset)."""
    ids: list[str] = []
    for path in sorted(folder.glob("trained.*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # the last line, cut by a kill mid-write (its step was never acked)
            ids += rec["sample_ids"]
    return ids


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
