"""The selector policy: which layout each actor gets for the contexts coming next.

Run before each Rollout and each Experience Preparation step. Inputs: the live context-length
statistics (`ContextStats`: p50/p95/max and trend), the dock's queue depths per stage, the
memory of each device slot and, through `measured`, the run's own profile. It plans for the
context expected `lookahead_steps` ahead, rounded up to a bucket (half-octaves: 1K, 1.5K, 2K, 3K, 4K, ...), and for every actor picks the
feasible (TP, PP, DP, recompute) with the most tokens/s (the cost model's roofline, replaced
by measured profiles where they exist, scaled by each stage's measured efficiency elsewhere;
its memory corrected by the measured peaks both ways: `memory_scale`, `memory_slack`),
with its largest micro-batch token budget. With `colocated=False` the slots are also split
between the actors so the slowest stage, weighted by the dock's backlog (train-bound or
rollout-bound), is as fast as possible: slots move from one actor to another.

Hysteresis, so a noisy context does not thrash the layout: the bucket rises at once (else OOM)
but falls only after `patience` decisions well below it; an infeasible current plan is
replaced at once. When no configuration will fit the
contexts projected within `warn_steps`, the decision carries a `Shortfall` with the minimum
resources, before it is needed.

A plan that still fits is left, or not, by `switching.Switching`: prices propose, steps
measured end to end decide (`observe_step`), with probes of plans not measured yet.

`SearchPolicy` implements the loop's `plan.Policy` protocol. Not here: applying a plan (the
loop re-creates actors), measuring (`profile`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace

from earl.runtime.selector.cost import CostModel, Parallel, Stage
from earl.runtime.selector.plan import (
    ActorPlan,
    ContextStats,
    Decision,
    Plan,
    SelectorStatistics,
    Shortfall,
)
from earl.runtime.selector.policy_config import Measured, PolicyConfig
from earl.runtime.selector.switching import Shape, Switching, shape


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


@dataclass(slots=True)
class _State:
    plan: Plan | None = None
    bucket: int = 0
    low_needs: list[int] = field(default_factory=list)
    low_seen: ContextStats | None = None  # the observation `low_needs` counted last
    stats: SelectorStatistics = field(default_factory=SelectorStatistics)


class SearchPolicy:
    """Decides plans; keeps the current one between decisions (see module docstring).

    Args:
        cost: the cost model of the trained model.
        config: policy knobs.
        measured: profiles that override the cost model's tokens/s and scale its bytes.
    """

    def __init__(self, cost: CostModel, config: PolicyConfig | None = None, *,
                 measured: Measured | None = None) -> None:
        self.cost = cost
        self.config = config or PolicyConfig()
        self.measured = measured
        self._s = _State()
        self.switching = Switching(self)

    @property
    def plan(self) -> Plan | None:
        return self._s.plan

    def statistics(self) -> SelectorStatistics:
        return self._s.stats

    # ---- evaluation of one actor in one layout ------------------------------------------
    def evaluate(self, actor: str, par: Parallel, slots: tuple[str, ...], context: int,
                 capacity: float) -> ActorPlan | None:
        """The actor's plan in layout `par` at `context`, or None if it does not fit."""
        stage = self.config.actors[actor]
        scale = self.measured.memory_scale(stage) if self.measured else 1.0
        slack = self.measured.memory_slack(stage) if self.measured else 0.0
        usable = (capacity * (1 - self.config.headroom) + slack) / scale
        mb = self.cost.max_micro_batch_tokens(stage, par, context, usable)
        if mb == 0:
            return None
        cap = self.config.max_kv_tokens if stage == "rollout" else \
            self.config.max_micro_batch_tokens
        # a micro-batch holds whole sequences; a KV budget is a pool of blocks: at its cap it
        # stays the same whatever the bucket (a 0.4% smaller budget rebuilt two engines, 4.6 s)
        mb = max(context, min(mb, cap if stage == "rollout" else cap // context * context))
        key = "kv_tokens" if stage == "rollout" else "micro_batch_tokens"
        mem = self.cost.memory(stage, par, seq_len=context, **{key: mb}).total * scale - slack
        tps = self.measured.tokens_per_s(stage, par, context) if self.measured else None
        if tps is None:  # the roofline, in measured units once the layout or its stage ran
            busy = mb
            if stage == "rollout" and self.config.rollout_seqs:  # a replica's share decodes
                busy = min(mb, -(-self.config.rollout_seqs // par.dp) * context)
            tps = self.cost.tokens_per_s(stage, par, context, batch_tokens=busy) * \
                (self.measured.efficiency(stage, par, context) if self.measured else 1.0)
        return ActorPlan(actor=actor, stage=stage, parallel=par, micro_batch_tokens=mb,
                         slots=slots, predicted_bytes=mem, tokens_per_s=tps)

    def best(self, actor: str, slots: tuple[str, ...], context: int,
             capacity: float, *, rollout_tp: int = 0) -> ActorPlan | None:
        """The fastest feasible layout of `actor` on exactly `slots`, or None (`rollout_tp`: a
        rollout's TP degree must be that one). A layout with activation recomputation only
        where the same one without does not fit: it computes one more forward, so a price
        above the plain layout's comes from noise in the measured efficiencies, not from
        recomputing (pricing it on them once kept a trainer recomputing for most of a run)."""
        found: ActorPlan | None = None
        fits: set[Parallel] = set()  # layouts that hold `context` without recomputation
        for par in self.layouts(self.config.actors[actor], len(slots)):
            if rollout_tp and self.config.actors[actor] == "rollout" and par.tp != rollout_tp:
                continue
            if par.recompute and replace(par, recompute=False) in fits:
                continue  # a memory lever: never faster (one more forward), only what fits
            p = self.evaluate(actor, par, slots, context, capacity)
            if p is not None and not par.recompute:
                fits.add(par)
            if p is not None and (found is None or p.tokens_per_s > found.tokens_per_s):
                found = p
        return found

    def layouts(self, stage: Stage, n: int) -> list[Parallel]:
        """Every layout of `stage` on `n` devices (rollout: TP x DP only; train: with and
        without activation recomputation; a stage in `PolicyConfig.dp_only`: DP only)."""
        c, out = self.config, []
        dp_only = stage in c.dp_only
        for tp in _pow2_upto(1 if dp_only else min(c.tp_max, n)):
            pp_max = 1 if stage == "rollout" or dp_only else min(c.pp_max, n // tp)
            for pp in _pow2_upto(pp_max):
                dp = n // (tp * pp)
                if n % (tp * pp) == 0 and (stage == "rollout" or not c.dp_divides
                                           or c.dp_divides % dp == 0):
                    for rc in ((False, True) if stage == "train" else (False,)):
                        out.append(Parallel(tp=tp, pp=pp, dp=dp, recompute=rc))
        return out

    def candidate(self, context: int, slots: Mapping[str, float],
                  queues: Mapping[str, int] | None = None, *,
                  other_than: Collection[Shape] = (), rollout_tp: int = 0,
                  other_split: tuple[int, ...] = ()) -> Plan | None:
        """The best plan at `context` over `slots` (name -> bytes), or None if none fits;
        `other_than`: none with these layouts; `rollout_tp`: the rollout's TP degree;
        `other_split`: not this many devices per actor (split plans only)."""
        names = tuple(sorted(slots))
        cap = min(slots.values())
        actors = list(self.config.actors)
        if self.config.colocated:
            plans = [self.best(a, names, context, cap, rollout_tp=rollout_tp) for a in actors]
            if any(p is None for p in plans):
                return None
            plan = Plan(actors=tuple(p for p in plans if p is not None), context_bucket=context)
            return None if shape(plan) in other_than else plan
        return self._split(actors, names, context, cap, queues or {}, other_than, rollout_tp,
                           other_split)

    def _split(self, actors: list[str], names: tuple[str, ...], context: int, cap: float,
               queues: Mapping[str, int], other_than: Collection[Shape] = (),
               rollout_tp: int = 0, other_split: tuple[int, ...] = ()) -> Plan | None:
        n = len(names)
        if n < len(actors):
            return None
        gran = 1
        while n // gran > 64:
            gran *= 2
        counts = list(range(gran, n + 1, gran))
        # best plan of each actor per slot count (slot names fixed later)
        table = {a: {k: self.best(a, names[:k], context, cap, rollout_tp=rollout_tp)
                     for k in counts} for a in actors}
        demand = self._demand(queues)
        best_split: tuple[float, list[int]] | None = None

        def walk(i: int, left: int, chosen: list[int], worst: float) -> None:
            nonlocal best_split
            if i == len(actors) - 1:
                p = table[actors[i]].get(left)
                if p is None:
                    return
                split = [*chosen, left]
                if tuple(split) == other_split:
                    return
                if other_than and tuple(
                        (a, q.parallel) for a, k in zip(actors, split, strict=True)
                        if (q := table[a][k]) is not None) in other_than:
                    return
                score = min(worst, p.tokens_per_s / demand[actors[i]])
                if best_split is None or score > best_split[0]:
                    best_split = (score, split)
                return
            for k in counts:
                rest = left - k
                if rest < gran * (len(actors) - i - 1):
                    break
                p = table[actors[i]][k]
                if p is not None:
                    walk(i + 1, rest, [*chosen, k],
                         min(worst, p.tokens_per_s / demand[actors[i]]))

        walk(0, n, [], float("inf"))
        if best_split is None:
            return None
        plans, start = [], 0
        for a, k in zip(actors, best_split[1], strict=True):
            p = table[a][k]
            assert p is not None
            plans.append(replace(p, slots=names[start:start + k]))
            start += k
        return Plan(actors=tuple(plans), context_bucket=context)

    def _demand(self, queues: Mapping[str, int] | None) -> dict[str, float]:
        """Per actor, how much its stage holds the pipeline back (1: balanced).

        The dock's backlog says which side is the bottleneck: samples waiting for a consumer
        stage ("train", "reference") beyond `queue_target` mean the consumers are behind
        (train-bound: the consumer's demand is 1 + the excess in units of `queue_target`);
        fewer than `queue_target` waiting for training mean the trainer waits for experience
        (rollout-bound: the rollout's demand is 1 + the shortfall, at most 2). A stage the
        queues do not mention, or `queue_target` 0, counts 1; so does every stage once the
        measured profile has timed training steps (its rates are then in real units).
        """
        qt, q = self.config.queue_target, queues or {}
        if self.measured is not None and self.measured.step_tokens():
            # the run's own rates say which stage holds it back; the backlog is their
            # consequence, and weighing it as well swung two near-balanced layouts back and
            # forth (gauntlet, 4 devices: r3-t1 <-> r2-t2 every 3 steps, 30 s a switch)
            qt = 0
        out: dict[str, float] = {}
        for a, stage in self.config.actors.items():
            d = 1.0
            if qt and stage == "rollout" and "train" in q:
                d += max(0, qt - q["train"]) / qt
            elif qt and stage in q:
                d += max(0, q[stage] - qt) / qt
            out[a] = d
        return out

    def score(self, plan: Plan, queues: Mapping[str, int] | None = None) -> float:
        """The slowest actor's tokens/s, each divided by its backlog demand."""
        d = self._demand(queues)
        return min((a.tokens_per_s / d[a.actor] for a in plan.actors), default=0.0)

    # ---- buckets ------------------------------------------------------------------------
    def bucket_of(self, tokens: int) -> int:
        """The smallest bucket >= `tokens`: base x 1, 1.5, 2, 3, 4, 6, 8, ... (half-octaves)."""
        b = self.config.bucket_base
        while True:
            for v in (b, b * 3 // 2):
                if v >= tokens:
                    return v
            b *= 2

    def _buckets_upto(self, top: int) -> list[int]:
        out, b = [], self.config.bucket_base
        while b <= top:
            out += [b, b * 3 // 2]
            b *= 2
        return out

    def _bucket(self, need: int, contexts: ContextStats) -> int:
        """The bucket for `need`: up at once, down after `patience` observations well below
        (the rollout and the prep decision of a step see the same one: it counts once)."""
        s, c = self._s, self.config
        up = self.bucket_of(need)
        if up >= s.bucket:
            s.low_needs.clear()
            return up
        below = max((v for v in self._buckets_upto(s.bucket) if v < s.bucket), default=0)
        if need >= below * (1 - c.down_margin):  # not well inside the bucket below
            s.low_needs.clear()
            return s.bucket
        if contexts is s.low_seen:  # the same observation (equal ones of two steps count)
            return s.bucket
        s.low_seen = contexts
        s.low_needs.append(need)
        if len(s.low_needs) < c.patience:
            return s.bucket
        top = max(s.low_needs)  # shrink only to what all the recent steps needed
        s.low_needs.clear()
        return self.bucket_of(top)

    # ---- the decision -------------------------------------------------------------------
    def decide(self, *, step: int, when: str, contexts: ContextStats,
               slots: Mapping[str, float], queue_depths: Mapping[str, int] | None = None
               ) -> Decision:
        """Choose the plan for the coming stage.

        Args:
            step: the RL step about to run.
            when: "rollout" or "prep" (only labels the decision).
            contexts: live context statistics (`ContextTracker.observe`).
            slots: slot name -> memory bytes available to an actor there.
            queue_depths: samples waiting per stage in the dock.

        Raises:
            ValueError: no slots.
        """
        if not slots:
            raise ValueError("SearchPolicy.decide: slots is empty; pass slot name -> memory bytes")
        s, c = self._s, self.config
        need = self._projected(contexts, c.lookahead_steps)
        bucket = self._bucket(need, contexts)
        cand = self.candidate(bucket, slots, queue_depths)
        cur = self.reevaluate(s.plan, bucket, slots)
        changed, reason = False, ""
        if cand is None:
            plan = cur if cur is not None else self._fallback(bucket, slots)
            plan = replace(plan, feasible=False)
            reason = (f"no configuration fits context {bucket} (max {contexts.max}, trend "
                      f"{contexts.trend:+.0f}/step) on {len(slots)} slot(s) of "
                      f"{min(slots.values()) / 2**30:.1f} GiB")
            changed = s.plan is None or plan.layouts() != s.plan.layouts()
            self.switching.forced()
        elif cur is None:
            plan, changed = cand, True
            if s.plan is None:
                why = "first plan"
            elif not s.plan.feasible:
                why = f"a configuration fits again at context {bucket}"
            elif any(n not in slots for a in s.plan.actors for n in a.slots):
                why = "the slots changed"
            else:
                why = (f"current layout cannot hold context {bucket} (max {contexts.max}, "
                       f"trend {contexts.trend:+.0f}/step)")
            reason = f"{why}: {self.summary(cand)}"
            self.switching.forced()
        else:
            plan, changed, reason = self.switching.choose(step, cand, cur, bucket, slots,
                                                          queue_depths)
        if changed:
            self.switching.switched(step)
        s.plan, s.bucket = plan, bucket
        shortfall = self._shortfall(step, contexts, slots)
        st = s.stats
        s.stats = SelectorStatistics(
            decisions=st.decisions + 1, switches=st.switches + int(changed),
            kept=st.kept + int(not changed), infeasible=st.infeasible + int(not plan.feasible),
            shortfalls_reported=st.shortfalls_reported + int(shortfall is not None),
            last_reason=reason,
            switch_steps=st.switch_steps + ((step,) if changed else ()))
        return Decision(step=step, when=when, plan=plan, changed=changed, reason=reason,
                        context=contexts, shortfall=shortfall)


    def observe_step(self, *, tokens: float, seconds: float, context: int = 0) -> None:
        """One training step of the current plan, end to end: its batch's trajectory tokens,
        the loop's seconds since the previous step (the loop leaves out the steps a change or a
        new actor's warm-up ran in) and, where given, its trajectories' token-weighted length
        (`context`): the rate is then in roofline seconds per second, which a growing context
        does not lower (on the tiny model a token at 1,536 tokens of context costs 27% more
        than at 1,024, so a plan measured a few steps earlier would look that much faster).
        `seconds` 0: a step the loop leaves unmeasured, or, from the loop's start, none yet:
        a plan is not left on prices before it has run measured steps. Feeds `switching`."""
        self.switching.observe(tokens=tokens, seconds=seconds, context=context,
                               plan=self._s.plan, bucket=self._s.bucket)

    def _projected(self, contexts: ContextStats, steps: int) -> int:
        """The context expected `steps` ahead, capped at `max_context` (when set)."""
        ahead = contexts.projected(steps)
        return min(ahead, self.config.max_context) if self.config.max_context else ahead

    def summary(self, plan: Plan) -> str:
        return "; ".join(a.describe() for a in plan.actors)

    def reevaluate(self, plan: Plan | None, bucket: int,
                    slots: Mapping[str, float]) -> Plan | None:
        """The current layouts at the new bucket, or None if one no longer fits / lost slots."""
        if plan is None or not plan.feasible:
            return None
        out = []
        for a in plan.actors:
            if any(n not in slots for n in a.slots):
                return None
            p = self.evaluate(a.actor, a.parallel, a.slots, bucket,
                              min(slots[n] for n in a.slots))
            if p is None:
                return None
            out.append(p)
        return Plan(actors=tuple(out), context_bucket=bucket)

    def _fallback(self, bucket: int, slots: Mapping[str, float]) -> Plan:
        """Nothing fits: the layout with the most TP on every slot (least memory per device)."""
        names = tuple(sorted(slots))
        tp = min(self.config.tp_max, len(names))
        tp = _pow2_upto(tp)[-1]
        pp = _pow2_upto(min(self.config.pp_max, len(names) // tp))[-1]
        actors = []
        for a, stage in self.config.actors.items():
            par = Parallel(tp=tp, pp=1 if stage == "rollout" else pp,
                           dp=len(names) // (tp * (1 if stage == "rollout" else pp)),
                           recompute=stage == "train")
            mem = self.cost.memory(stage, par, seq_len=bucket).total
            actors.append(ActorPlan(actor=a, stage=stage, parallel=par, micro_batch_tokens=bucket,
                                    slots=names, predicted_bytes=mem, tokens_per_s=0.0))
        return Plan(actors=tuple(actors), context_bucket=bucket, feasible=False)

    def _shortfall(self, step: int, contexts: ContextStats,
                   slots: Mapping[str, float]) -> Shortfall | None:
        c = self.config
        fits: dict[int, bool] = {}
        for k in range(c.warn_steps + 1):
            ctx = self.bucket_of(self._projected(contexts, c.lookahead_steps + k))
            if ctx not in fits:
                fits[ctx] = self.candidate(ctx, slots) is not None
            if fits[ctx]:
                continue
            cap = min(slots.values())
            n = len(slots)
            min_devices = 0
            for mult in (2, 4, 8, 16, 32, 64):
                more = {f"x{i}": cap for i in range(n * mult)}
                if self.candidate(ctx, more) is not None:
                    min_devices = n * mult
                    break
            return Shortfall(stage=self._stage_short(ctx, n, cap), context=ctx,
                             at_step=step + c.lookahead_steps + k,
                             steps_ahead=c.lookahead_steps + k, min_devices=min_devices,
                             min_device_bytes=self._min_bytes(ctx, n, cap))
        return None

    def _min_bytes(self, ctx: int, n: int, cap: float) -> float:
        """The least memory per device (within 64x of `cap`) with which `n` devices fit `ctx`
        (bisection on the log scale; inf if even 64x does not)."""
        def fits(c: float) -> bool:
            return self.candidate(ctx, {f"x{i}": c for i in range(n)}) is not None

        lo, hi = cap, cap * 64
        if not fits(hi):
            return float("inf")
        while hi / lo > 1.01:
            mid = (lo * hi) ** 0.5
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)
        return hi

    def _stage_short(self, ctx: int, n: int, cap: float) -> Stage:
        """The first stage that cannot fit `ctx` alone on all `n` devices (else "train")."""
        for a, stage in self.config.actors.items():
            if self.best(a, tuple(f"x{i}" for i in range(n)), ctx, cap) is None:
                return stage
        return "train"
