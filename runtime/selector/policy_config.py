"""The selector policy's knobs (`PolicyConfig`) and what it asks of measured profiles
(`Measured`); the policy itself is `earl.runtime.selector.policy.SearchPolicy`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from earl.runtime.errors import need
from earl.runtime.selector.cost import Parallel, Stage

__all__ = ["Measured", "PolicyConfig"]


class Measured(Protocol):
    """What the policy asks of profiles (`profile.ProfileTable` implements it)."""

    def tokens_per_s(self, stage: Stage, par: Parallel, context: int) -> float | None: ...

    def memory_scale(self, stage: Stage) -> float:
        """How much more than predicted `stage` used, at worst (>= 1)."""
        ...

    def memory_slack(self, stage: Stage) -> float:
        """Bytes per device the model over-predicts `stage` by, at least (>= 0)."""
        ...

    def efficiency(self, stage: Stage, par: Parallel | None = None,
                   context: int | None = None) -> float:
        """Measured / roofline tokens/s: of layout `par` where it ran, else of the stage (at
        `context`, where it ran there)."""
        ...

    def step_tokens(self) -> float | None:
        """Tokens one training step takes (None: none measured yet)."""
        ...

    def switch_seconds(self) -> float | None:
        """What a layout change has cost in this run (None: none made yet)."""
        ...


@dataclass(kw_only=True, slots=True)
class PolicyConfig:
    """Knobs of the selector policy.

    Args:
        actors: actor name -> stage it runs ("rollout", "reference", "train").
        colocated: every actor uses every slot in turn (verl/EARL hybrid engine); False: the
            slots are split between the actors.
        tp_max: largest TP degree (devices per node). pp_max: largest PP degree.
        headroom: fraction of each slot's memory left free.
        bucket_base: smallest context bucket (tokens); buckets double from there.
        lookahead_steps: plan for the context projected this many steps ahead.
        warn_steps: look this many steps further for contexts nothing can fit.
        switch_gain: a feasible plan is replaced only by one at least this much faster...
        patience: ...for this many decisions in a row (also: bucket shrink confirmations,
            one per context observation).
        down_margin: the bucket shrinks only when the need is this far below the next lower
            bucket.
        cooldown_steps: steps between two voluntary switches.
        horizon_steps: a voluntary switch must pay for itself within this many steps: the
            time it is predicted to save on each (a measured step's tokens at the current and
            at the new plan's rate) times this, against what a switch costs (the run's measured
            ones, else `switch_cost_s`). Before any step is measured, hysteresis alone decides.
        switch_cost_s: a switch's cost before one is measured (seconds).
        respawn_cost_s: the least a switch that changes a rollout's TP degree costs: its
            replicas start as new engine processes (warm hosts hold one-process replicas):
            17.9 s on the tiny model on half-core CPU devices, against ~1 s for the device
            moves whose median `switch_cost_s` is replaced by.
        probe_every: steps between two probes: the best plan not measured end to end at
            the bucket, with another split of the devices, that starts no new engine processes
            and is priced within `probe_margin`, runs
            `probe_steps` steps; the faster end to end stays (a lost probe doubles the wait, at
            most 4x). Steps come end to end from the loop (`SearchPolicy.observe_step`);
            without them, no probe and no measured switch. 0: no probes. Stage rates from a few
            batches each made one of three gauntlet runs leave the faster layout at step 17
            and never measure it again (0.68x the best static run on its devices, against
            0.91-0.95x).
        probe_steps: steps measured end to end that give a plan its rate at a bucket (and
            a trial, a probe's or a switch's on prices, its length); a plan is left on prices
            only once it has that rate.
        trial_sigmas: a trial (a probe's, or a switch's on prices) is decided once its rate
            end to end and the old plan's differ by this many standard errors (from their
            steps' spread), or after 3 x `probe_steps` measured steps, when it stays only if
            faster by this much (a tie goes back to the old plan); a plan measured faster is
            switched back to only by this much too. Over 6 steps a gauntlet rate's standard
            error is ~10% on 2 cores, the size of the gaps between its layouts at a bucket.
            0: the rates alone decide, at `probe_steps`.
        probe_margin: a plan priced this much below the current one is not probed. Wide: the
            prices are what a probe checks, and on the gauntlet they put two replicas and a DP
            2 trainer below 0.7x three replicas and one rank, where the static runs measure
            them 1.3-1.6x as fast (a margin of 0.3 never probed them).
        max_micro_batch_tokens: cap on the train/reference micro-batch budget.
        max_kv_tokens: cap on a rollout replica's KV-cache budget.
        dp_divides: a train or reference layout's DP degree must divide this (a run's GRPO
            groups per step: data-parallel replicas split whole groups); 0: any.
        max_context: the longest context any trajectory can reach (a run: the model's
            positions); the projected context is capped there (a trend does not outgrow the
            window). 0: no cap.
        rollout_seqs: sequences the rollout has to decode at once, over all its replicas (a
            run: its batch size); a replica's decode batch is its share of them, however much
            KV it could hold (the roofline is not credited for cache that stays empty). 0:
            as many as the KV budget holds.
        dp_only: stages that run data parallel only, one rank per device (no TP or PP; a
            run whose reference is planned: EARL's reference scores that way).
        queue_target: the dock backlog (samples) of a balanced pipeline, and the unit of
            extra demand: more waiting weighs the consumer stages, fewer the rollout (see
            `SearchPolicy._demand`; 0: ignore queue depths).
    """

    actors: dict[str, Stage] = field(default_factory=lambda: {
        "rollout": "rollout", "reference": "reference", "trainer": "train"})
    colocated: bool = False
    tp_max: int = 8
    pp_max: int = 8
    headroom: float = 0.1
    bucket_base: int = 1024
    lookahead_steps: int = 2
    warn_steps: int = 8
    switch_gain: float = 0.1
    patience: int = 2
    down_margin: float = 0.15
    cooldown_steps: int = 3
    horizon_steps: int = 20
    switch_cost_s: float = 5.0
    respawn_cost_s: float = 15.0
    probe_every: int = 50
    probe_steps: int = 6
    trial_sigmas: float = 2.0
    probe_margin: float = 0.75
    max_micro_batch_tokens: int = 65536
    max_kv_tokens: int = 1 << 20
    queue_target: int = 0
    dp_divides: int = 0
    rollout_seqs: int = 0
    max_context: int = 0
    dp_only: tuple[Stage, ...] = ()

    def __post_init__(self) -> None:
        need(bool(self.actors), "actors", "must name at least one actor")
        for stage in self.dp_only:
            need(stage in ("rollout", "reference", "train"), "dp_only",
                 f"{stage!r} unknown: use 'rollout', 'reference' or 'train'")
        for name, stage in self.actors.items():
            need(stage in ("rollout", "reference", "train"), f"actors.{name}",
                 f"{stage!r} unknown: use 'rollout', 'reference' or 'train'")
        need(0 <= self.headroom < 1, "headroom", f"must be in [0, 1), got {self.headroom}")
        for k in ("tp_max", "pp_max", "bucket_base", "patience"):
            need(getattr(self, k) >= 1, k, f"must be >= 1, got {getattr(self, k)}")
        need(self.respawn_cost_s >= 0, "respawn_cost_s",
             f"must be >= 0 seconds, got {self.respawn_cost_s}")
        need(self.probe_every >= 0, "probe_every",
             f"must be >= 0 steps (0 = no probes), got {self.probe_every}")
        need(self.probe_steps >= 1, "probe_steps", f"must be >= 1, got {self.probe_steps}")
        need(self.trial_sigmas >= 0, "trial_sigmas",
             f"must be >= 0 standard errors (0 = the rates alone decide), got "
             f"{self.trial_sigmas}")
        need(0 <= self.probe_margin < 1, "probe_margin",
             f"must be in [0, 1), got {self.probe_margin}")
        need(self.max_context >= 0, "max_context",
             f"must be >= 0 tokens (0 = no cap), got {self.max_context}")
        need(self.rollout_seqs >= 0, "rollout_seqs",
             f"must be >= 0 sequences (0 = as many as the KV budget holds), got "
             f"{self.rollout_seqs}")
