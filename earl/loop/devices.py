"""Which devices each stage of a run gets, and the device slots that hand them to the actors.

`device_roles` names the slots each stage's ranks take at the start (and, with
``placement.devices``, the ones no rank holds: the selector's to hand out); `run_slots` makes
a CPU run's slots (memory cgroup, core, CPU share); on GPUs:

`plan_gpus` is a pure function of the placement: from GPU 0 up, the rollout replicas
(`rollout_tp` consecutive GPUs each: one vLLM process and its TP workers), then the trainer
ranks (one GPU each; ranks count TP fastest, so each TP group is on consecutive GPUs), then the
reference actors (one GPU each): every stage has GPUs of its own. With ``placement.colocate``
the stages share the trainer ranks' GPUs instead (trainer rank r on GPU r, rollout replica r on
GPUs r*rollout_tp.., reference r on GPU r) and take turns on them (`earl.loop.colocation`).
`gpu_slots` makes the `SlotPool` whose slot "<stage><rank>" carries those GPUs: an actor rank
spawned in it sees only them (`Slot.env` sets its CUDA_VISIBLE_DEVICES), as its devices 0, 1...

    plan = plan_gpus(PlacementConfig(rollout=2, rollout_tp=2, trainer=4, trainer_tp=2),
                     reference=0, gpus=8)
    plan.rollout == ((0, 1), (2, 3)); plan.trainer == ((4,), (5,), (6,), (7,))
    # with colocate=True on 4 GPUs: rollout ((0, 1), (2, 3)), trainer ((0,), (1,), (2,), (3,))

Not here: moving devices between stages (the selector, `earl.loop.selection`), spawning
(`earl.loop.spawn`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from earl.config import PlacementConfig
    from earl.runtime.slots import Slot, SlotPool

__all__ = ["COLOCATED_SHARE", "STAGES", "GpuPlan", "device_roles", "gpu_memory_mib", "gpu_slots",
           "placed", "plan_gpus", "rollout_memory_mib", "run_slots"]

STAGES = ("rollout", "trainer", "reference")
COLOCATED_SHARE = 0.5  # vLLM's share of a GPU it shares with a trainer rank (verl's default)

Ranks = tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuPlan:
    """Per stage, the GPUs of each of its ranks: rank r of a stage gets `stage[r]`."""

    rollout: Ranks
    trainer: Ranks
    reference: Ranks

    @property
    def used(self) -> int:
        """GPUs the plan takes."""
        return sum(len(g) for stage in STAGES for g in getattr(self, stage))

    def stages(self) -> dict[str, Ranks]:
        return {stage: getattr(self, stage) for stage in STAGES}


def plan_gpus(placement: PlacementConfig, *, reference: int, gpus: int) -> GpuPlan:
    """The GPUs of every rank of every stage (see the module docstring).

    Args:
        placement: its `rollout`, `rollout_tp`, `trainer` and `trainer_tp`.
        reference: reference actors that will run (0 without a KL term).
        gpus: GPUs visible to the driver (`torch.cuda.device_count()`).

    Raises:
        ValueError: no GPU, or more GPUs needed than visible; names the fields to change.
    """
    pl = placement
    if gpus < 1:
        raise ValueError("config field 'placement.device': 'cuda' but no GPU is visible; use "
                         "placement.device=cpu or make GPUs visible (CUDA_VISIBLE_DEVICES)")
    assert pl.trainer % pl.trainer_tp == 0  # PlacementConfig checks it
    if pl.colocate:  # PlacementConfig checks that rollout and reference fit the trainer's GPUs
        if pl.trainer > gpus:
            raise ValueError(
                f"config field 'placement.trainer': {pl.trainer} colocated ranks need "
                f"{pl.trainer} GPUs, but {gpus} are visible; lower placement.trainer (and "
                "placement.rollout x rollout_tp with it) to at most that")
        tp = pl.rollout_tp
        return GpuPlan(rollout=tuple(tuple(range(r * tp, (r + 1) * tp))
                                     for r in range(pl.rollout)),
                       trainer=tuple((r,) for r in range(pl.trainer)),
                       reference=tuple((r,) for r in range(reference)))
    need = pl.rollout * pl.rollout_tp + pl.trainer + reference
    if need > gpus:
        ref = f" + reference {reference}" if reference else ""
        lower = "placement.rollout, placement.rollout_tp or placement.trainer"
        if reference:
            lower = ("placement.rollout, placement.rollout_tp, placement.trainer or "
                     "placement.reference (0 with algorithm.kl_coef=0)")
        raise ValueError(
            f"config field 'placement': rollout {pl.rollout} x rollout_tp {pl.rollout_tp} + "
            f"trainer {pl.trainer}{ref} = {need} GPUs, but {gpus} are visible and every rank "
            f"needs its own; lower {lower} by {need - gpus} GPU(s) in all")
    nxt = 0

    def take(ranks: int, per_rank: int) -> Ranks:
        nonlocal nxt
        out = tuple(tuple(range(nxt + r * per_rank, nxt + (r + 1) * per_rank))
                    for r in range(ranks))
        nxt += ranks * per_rank
        return out

    return GpuPlan(rollout=take(pl.rollout, pl.rollout_tp), trainer=take(pl.trainer, 1),
                   reference=take(reference, 1))


def gpu_slots(placement: PlacementConfig, *, reference: int, gpus: int) -> SlotPool:
    """A run's GPU slots: "rollout<r>", "trainer<r>", "reference<r>" with `plan_gpus`'s GPUs.

    Rollout slots hold `placement.rollout_slot_memory_mib` on each GPU (vLLM's budget; none:
    vLLM's default share, or half of each GPU when colocated, `COLOCATED_SHARE`); the others
    the whole GPU. No cgroups: the GPU is the limit.

    Raises:
        ValueError: as `plan_gpus`.
    """
    from earl.runtime.slots import SlotPool

    plan = plan_gpus(placement, reference=reference, gpus=gpus)
    pool = SlotPool(use_cgroups=False)
    rollout_mib = rollout_memory_mib(placement)
    for stage, ranks in plan.stages().items():
        for r, own in enumerate(ranks):
            pool.create(f"{stage}{r}", gpus=own,
                        memory_mib=rollout_mib if stage == "rollout" else None)
    return pool


def rollout_memory_mib(placement: PlacementConfig, *,
                       gpu_total_mib: int | None = None) -> int | None:
    """vLLM's budget on each GPU of a rollout replica: `placement.rollout_slot_memory_mib`,
    else half of each GPU when colocated (`COLOCATED_SHARE` of `gpu_total_mib`, default this
    process's first GPU's memory), else None (vLLM's default share)."""
    if placement.rollout_slot_memory_mib:
        return placement.rollout_slot_memory_mib
    if not placement.colocate:
        return None
    return int((gpu_total_mib or gpu_memory_mib()) * COLOCATED_SHARE)


def gpu_memory_mib() -> int:
    """The memory of this process's first GPU, in MiB."""
    import torch

    return int(torch.cuda.get_device_properties(0).total_memory >> 20)


def device_roles(placement: PlacementConfig, *, reference: int) -> dict[str, tuple[str, ...]]:
    """The slot names of each stage's ranks at the start ("rollout", "trainer", "reference")
    and the ones no rank holds ("free").

    Without ``placement.devices`` (or on CUDA, where `gpu_slots` names its slots by stage):
    "rollout<r>", "trainer<r>", "reference<r>", none free. With it, on CPU: "device<i>", taken
    in order by the rollout replicas (`rollout_tp` each) and the trainer ranks, the reference
    actors from the last device down; the rest are free.

    Raises:
        ValueError: the devices cannot hold every rank; names the field.
    """
    pl = placement
    if pl.devices == 0 or pl.device == "cuda":
        return {"rollout": tuple(f"rollout{r}" for r in range(pl.rollout)),
                "trainer": tuple(f"trainer{r}" for r in range(pl.trainer)),
                "reference": tuple(f"reference{r}" for r in range(reference)), "free": ()}
    rollout = pl.rollout * pl.devices_per_replica()
    ranks = rollout + pl.trainer + reference
    if ranks > pl.devices:
        raise ValueError(
            f"config field 'placement.devices': {pl.devices} devices cannot hold rollout "
            f"{pl.rollout} x rollout_tp {pl.rollout_tp} + trainer {pl.trainer} + reference "
            f"{reference} ranks (one device each); raise it to at least {ranks}, or lower "
            "those (reference: 0 with algorithm.kl_coef=0)")
    names = tuple(f"device{i}" for i in range(pl.devices))
    first_ref = pl.devices - reference
    return {"rollout": names[:rollout],
            "trainer": names[rollout:rollout + pl.trainer],
            "reference": names[first_ref:],
            "free": names[rollout + pl.trainer:first_ref]}


def run_slots(placement: PlacementConfig, reference: int = 0) -> SlotPool:
    """A CPU run's slot pool: the slots of `device_roles`, each with
    `placement.slot_memory_mib` (rollout ones `rollout_slot_memory_mib` when set, without
    ``devices``) and one core (round robin over this process's). With more slots than cores
    each also gets an equal CPU share (cores / slots, a CFS quota), so the slots that share a
    core bind like small devices of equal speed."""
    import os

    from earl.runtime.slots import SlotPool

    pool = SlotPool()
    cores = sorted(os.sched_getaffinity(0))
    roles = device_roles(placement, reference=reference)
    # in device order: with `devices`, the free ones lie between the trainer's and the reference's
    names = [*roles["rollout"], *roles["trainer"], *roles["free"], *roles["reference"]]
    share = len(cores) / len(names) if len(names) > len(cores) else None
    for i, name in enumerate(names):
        mib = placement.rollout_slot_memory_mib if name in roles["rollout"] else 0
        pool.create(name, cores=(cores[i % len(cores)],),
                    memory_mib=mib or placement.slot_memory_mib, cpu_share=share)
    return pool


def placed(pool: SlotPool | None, names: Sequence[str], ranks: int, owner: str,
           per_rank: int = 1) -> list[Slot] | None:
    """A slot per rank of `owner`, or None without slots (or too few `names`): rank r gets
    the r-th run of `per_rank` of `names`, joined into one slot when there are several (a
    tensor-parallel replica and its workers)."""
    if pool is None or len(names) < ranks * per_rank or ranks == 0:
        return None
    return [pool.join(names[r * per_rank:(r + 1) * per_rank], owner) for r in range(ranks)]
