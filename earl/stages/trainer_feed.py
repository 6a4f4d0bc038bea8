"""The trainer's data path, driver side: lease, plan for the trainer's layout, train, ack.

`train_from_dock` leases `n` samples from the transfer dock (metadata only), has the dispatcher
split them across the trainer's DP replicas and into micro-batches of at most
``micro_batch_tokens`` tokens (`earl.runtime.dispatch.plan_step`), and sends the plan to every
trainer rank (`TrainerActor.train_planned`): each replica's leader fetches its slice straight
from the warehouses and forwards it to its TP peers. The driver never holds sample data. On
success the lease is acked; on failure it is released, so the samples go back to the dock.

Not here: what the trainer does with its slice (`earl.stages.trainer`), the plan itself
(`earl.runtime.dispatch`, `earl.runtime.layout`).

Example:
    >>> dock = Dock(await rt.lookup("dock"))
    >>> metrics = await train_from_dock(trainer, dock, 64, ["input_ids", "loss_mask",
    ...                                                     "advantages", "rollout_logprobs"])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from earl.runtime.dispatch import DispatchPlan, plan_step
from earl.runtime.dock_index import Lease
from earl.runtime.layout import Layout, TokenBudget

if TYPE_CHECKING:
    from earl.runtime import ActorGroup
    from earl.runtime.dock import Dock
    from earl.stages.trainer import TrainerActor

__all__ = ["discard_from_dock", "plan_for", "train_from_dock"]


def plan_for(lease: Lease, layout: Layout, micro_batch_tokens: int, *,
             step: int = 0) -> DispatchPlan:
    """The dispatcher's plan of `lease` for `layout`, micro-batches within the token budget.

    A sample longer than the budget cannot be split (no context parallel here), so the budget
    is raised to its length: the peak memory of a step is that sample's either way.
    """
    longest = max(loc.length for loc in lease.samples)
    return plan_step(lease, layout, TokenBudget(max_tokens=max(micro_batch_tokens, longest)),
                     step=step)


async def train_from_dock(trainer: ActorGroup[TrainerActor], dock: Dock, n: int,
                          columns: Sequence[str], *, stage: str = "train",
                          whole_groups: bool = True, min_version: int | None = None,
                          lr_scale: float = 1.0, index: str = "dock",
                          timeout_s: float | None = 600.0, fetch_timeout_s: float = 120.0,
                          layout: Layout | None = None,
                          micro_batch_tokens: int | None = None,
                          group_ids: Sequence[str] | None = None,
                          token_floor: int | None = None) -> dict[str, float]:
    """One optimizer step of the whole trainer group on `n` samples from the dock.

    Args:
        trainer: the `TrainerActor` group (all its ranks train).
        dock: a `Dock` client on the index the trainer reads (named `index`).
        n: samples in the step (at least the number of DP replicas).
        columns: the columns to fetch (e.g. ``input_ids``, ``loss_mask``, ``advantages``).
        stage, whole_groups, min_version: what to lease (see `Dock.take`).
        lr_scale: multiplies this step's learning rate.
        timeout_s: how long to wait for `n` samples to be ready.
        layout, micro_batch_tokens: the trainer's, asked from rank 0 when not given.
        group_ids: train exactly these groups (`n` is then their rows): a step's batch.
        token_floor: the oldest policy version whose tokens train; older ones are masked out
            of the loss (the staleness bound; the ``versions`` column is fetched for it).

    Returns:
        Rank 0's step metrics (global over the replicas), plus ``dispatch_replicas``, the
        bytes each transport carried to the replica leaders (``transport/experience_bytes/<kind>``)
        and, with a `token_floor`, the loss tokens it masked (``stale_tokens``) and the oldest
        version trained (``oldest_version``), over all replicas.

    Raises:
        ValueError: `n` samples cannot feed the layout (fewer samples than replicas).
        TimeoutError: not enough samples ready within `timeout_s`.
    """
    if layout is None:
        layout = await trainer[0].layout.call_one()
    if micro_batch_tokens is None:
        micro_batch_tokens = (await trainer[0].trainer_config.call_one()).micro_batch_tokens
    if len(trainer) != layout.world_size:
        raise ValueError(f"trainer group has {len(trainer)} ranks; layout {layout} needs "
                         f"{layout.world_size}")
    if n < layout.dp:
        raise ValueError(f"train_from_dock: n={n} samples cannot feed {layout.dp} data-parallel "
                         "replicas; take at least one sample per replica")
    if token_floor is not None and "versions" not in columns:
        columns = [*columns, "versions"]
    lease = await dock.take(stage, list(columns), n, whole_groups=whole_groups,
                            min_version=min_version, timeout_s=timeout_s, group_ids=group_ids)
    try:
        plan = plan_for(lease, layout, micro_batch_tokens)
        results = await trainer.train_planned.call(plan, index, lr_scale, fetch_timeout_s,
                                                   token_floor)
    except BaseException:
        await dock.release(lease)
        raise
    await dock.ack(lease)
    metrics = dict(results[0])
    for rank_metrics in results[1:]:  # what each replica leader fetched
        for k, v in rank_metrics.items():
            if k.startswith("transport/") or k == "stale_tokens":
                metrics[k] = metrics.get(k, 0.0) + v
            elif k == "oldest_version":
                metrics[k] = min(metrics.get(k, v), v)
    metrics["dispatch_replicas"] = float(layout.dp)
    return metrics


async def discard_from_dock(dock: Dock, group_ids: Sequence[str], reason: str, *,
                            stage: str = "train", timeout_s: float | None = 600.0) -> int:
    """Consume the groups `group_ids` for `stage` without training them, for `reason` (a
    sample over the staleness bound); returns the rows dropped. Their columns are never
    fetched."""
    lease = await dock.take(stage, ["versions"], 1, group_ids=group_ids, timeout_s=timeout_s)
    await dock.drop(lease, reason)
    return len(lease.samples)
