"""What the live trainer, rollout and reference run (`Setting`), and how a selector plan
becomes one (`setting_of`).

A plan names layouts, devices, a window and budgets; `setting_of` keeps what needs no change
(the window never shrinks, a KV budget within `KV_CHANGE` stays), `keep_places` leaves each
stage in the devices it holds when devices are equal, `Setting.changed` names the actors a new
setting re-creates, and `moves` counts the devices that change hands.

Not here: deciding the plan (`earl.runtime.selector`), applying it (`earl.loop.selection`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from earl.runtime.selector import Parallel, Plan

__all__ = ["KV_CHANGE", "Setting", "keep_places", "moves", "setting_of", "with_rollout_of"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """What the live trainer and rollout actors run (the part of a plan the loop can apply).

    Attributes:
        trainer_tp / trainer_dp: the trainer group's layout (dp x tp ranks).
        micro_batch_tokens: the trainer's micro-batch token budget.
        trainer_recompute: the trainer recomputes activations in the backward (gradient
            checkpointing: less memory per token, more compute); changes without a restart.
        rollout_tp / rollout_replicas: vLLM tensor-parallel degree and replica count.
        max_model_len: the longest context the rollout replicas serve.
        kv_tokens: KV-cache tokens per replica (at least `max_model_len`).
        trainer_slots / rollout_slots: slot names each actor runs in (empty: no slots).
        reference_slots: the reference's slots, one data-parallel rank each (empty: no slots,
            or the selector does not plan the reference).
    """

    trainer_tp: int = 1
    trainer_dp: int = 1
    micro_batch_tokens: int
    trainer_recompute: bool = False
    rollout_tp: int = 1
    rollout_replicas: int = 1
    max_model_len: int
    kv_tokens: int
    trainer_slots: tuple[str, ...] = ()
    rollout_slots: tuple[str, ...] = ()
    reference_slots: tuple[str, ...] = ()

    def trainer_key(self) -> tuple[object, ...]:
        return (self.trainer_tp, self.trainer_dp, self.trainer_slots)

    def rollout_key(self) -> tuple[object, ...]:
        return (self.rollout_tp, self.rollout_replicas, self.rollout_slots, self.max_model_len,
                self.kv_tokens)

    def reference_key(self) -> tuple[object, ...]:
        return (self.reference_slots,)

    def changed(self, old: Setting) -> list[str]:
        """The actors ("trainer", "rollout", "reference") whose re-creating key differs from
        `old`'s: their layout, devices or (rollout) window and KV budget."""
        return [a for a, mine, theirs in (
            ("trainer", self.trainer_key(), old.trainer_key()),
            ("rollout", self.rollout_key(), old.rollout_key()),
            ("reference", self.reference_key(), old.reference_key())) if mine != theirs]

    def trainer_parallel(self) -> Parallel:
        return Parallel(tp=self.trainer_tp, dp=self.trainer_dp, recompute=self.trainer_recompute)

    def rollout_parallel(self) -> Parallel:
        return Parallel(tp=self.rollout_tp, dp=self.rollout_replicas)


KV_CHANGE = 0.25  # a rollout KV budget this much larger or smaller is applied alone


def setting_of(plan: Plan, current: Setting, *, max_context: int,
               equal_devices: bool = False) -> Setting:
    """The setting that runs `plan`, starting from `current` (with `equal_devices`, each stage
    kept in the devices it holds: `keep_places`).

    The rollout's ``max_model_len`` grows to the plan's context bucket (capped at `max_context`,
    the model's positions) and never shrinks; its KV budget is the plan's, at least one context;
    alone (a rebuild of the engines) it changes only when it grows or shrinks by `KV_CHANGE`
    or more. The plan gives each replica the most KV its device holds (up to
    `PolicyConfig.max_kv_tokens`), so a much smaller one means the current cache no longer fits
    beside what the replica's process has grown to.
    Actors the plan does not name keep their setting.
    """
    s = current
    names = {a.actor for a in plan.actors}
    if "trainer" in names:
        t = plan.actor("trainer")
        if t.parallel.pp != 1:
            raise ValueError(f"selector plan gives the trainer {t.parallel}: the torch trainer "
                             "runs dp x tp only; set PolicyConfig.pp_max=1")
        s = replace(s, trainer_tp=t.parallel.tp, trainer_dp=t.parallel.dp,
                    micro_batch_tokens=t.micro_batch_tokens, trainer_slots=t.slots,
                    trainer_recompute=t.parallel.recompute)
    if "reference" in names:
        f = plan.actor("reference")
        if (f.parallel.tp, f.parallel.pp) != (1, 1):
            raise ValueError(f"selector plan gives the reference {f.parallel}: it scores data "
                             "parallel only (one rank per device)")
        s = replace(s, reference_slots=f.slots)
    if "rollout" in names:
        r = plan.actor("rollout")
        mml = min(max(current.max_model_len, plan.context_bucket), max_context)
        s = replace(s, rollout_tp=r.parallel.tp, rollout_replicas=r.parallel.dp,
                    rollout_slots=r.slots, max_model_len=mml,
                    kv_tokens=max(r.micro_batch_tokens, mml))
    if equal_devices:  # which devices does not matter: move as few as can be
        s = keep_places(s, current)
    same = s.rollout_key()[:4] == current.rollout_key()[:4]  # no rebuild for another reason
    if same and s.max_model_len <= current.kv_tokens \
            and current.kv_tokens * (1 - KV_CHANGE) < s.kv_tokens \
            < current.kv_tokens * (1 + KV_CHANGE):
        # vLLM allocated its cache at start: a slightly other size is not worth a rebuild
        s = replace(s, kv_tokens=current.kv_tokens)
    return s


def with_rollout_of(s: Setting, other: Setting) -> Setting:
    """`s` with `other`'s rollout: replicas, TP, devices, window and KV budget."""
    return replace(s, rollout_tp=other.rollout_tp, rollout_replicas=other.rollout_replicas,
                   rollout_slots=other.rollout_slots, max_model_len=other.max_model_len,
                   kv_tokens=other.kv_tokens)


_PLACES = ("rollout_slots", "trainer_slots", "reference_slots")


def keep_places(new: Setting, current: Setting) -> Setting:
    """`new` with each stage in the devices it holds now, as far as its count allows, and
    free devices (or those another stage gives up) for the rest: a plan names devices by
    position, but equal devices are interchangeable, so a change moves as few as it can (the
    rollout's replicas are rebuilt in place when its devices stay the same)."""
    want = {k: len(getattr(new, k)) for k in _PLACES}
    held = {n for k in _PLACES for n in getattr(current, k)}
    pool = held | {n for k in _PLACES for n in getattr(new, k)}
    kept: dict[str, list[str]] = {}
    for k in _PLACES:  # in order: the rollout keeps its devices first
        taken = {n for v in kept.values() for n in v}
        kept[k] = [n for n in getattr(current, k) if n not in taken][:want[k]]
    taken = {n for v in kept.values() for n in v}
    free = sorted(pool - taken - held)
    spare = free + sorted(pool - taken - set(free))  # then those another stage gives up
    if len(spare) < sum(want[k] - len(kept[k]) for k in _PLACES):
        return new  # more devices than the stages hold or could free: as the plan says
    for k in _PLACES:
        while len(kept[k]) < want[k]:
            kept[k].append(spare.pop(0))
    return replace(new, rollout_slots=tuple(kept["rollout_slots"]),
                   trainer_slots=tuple(kept["trainer_slots"]),
                   reference_slots=tuple(kept["reference_slots"]))


def moves(old: Setting, new: Setting) -> set[str]:
    """Slots whose holder (rollout, trainer, reference or none) differs between two settings."""
    def holders(s: Setting) -> dict[str, str]:
        return {n: k for k in _PLACES for n in getattr(s, k)}
    a, b = holders(old), holders(new)
    return {n for n in a.keys() | b.keys() if a.get(n) != b.get(n)}
