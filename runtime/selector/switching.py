"""When the selector leaves a plan that still fits: prices propose, steps measured end to end
decide.

A plan is priced by composing stage rates, each from a few batches, and a layout the run has
left is not measured again; so the loop also gives the policy each training step end to end
(`SearchPolicy.observe_step`: its batch's trajectory tokens over the loop's seconds, in roofline
seconds per second at the batch's typical context where given), and once a plan has run
`probe_steps` of them at a bucket its rate there is kept (over its last 3 x `probe_steps` at
that bucket: a step's end-to-end efficiency rises with its context, ~20% a half-octave on the
gauntlet, so rates of two buckets do not compare). A plan is left on prices only once it has
such a rate, only for one `switch_gain` faster for `patience` decisions in a row,
`cooldown_steps` after the last switch, and only if the switch pays for itself over
`horizon_steps` (at the loop's measured seconds per step; a switch to a plan not measured at
the bucket costs the way back too); a plan measured `switch_gain` faster at the bucket is
switched back to; one measured there is not switched to on prices. Every `probe_every` steps
the best plan not yet measured at the bucket with another split of the devices that starts no
new engine processes (the same rollout TP) and is priced within `probe_margin` of the current
one is tried too.

Either way the new plan is on trial: it runs `probe_steps` measured steps and stays only if it
is at least as fast end to end as the plan it replaced at the same bucket; if it is slower the
policy goes back and the wait for the next probe doubles (at most 4x). A rate comes with its
standard error, from the spread of its steps taken in consecutive pairs (the loop runs a step
ahead, so a fast step and a slow one alternate): over 6 steps it is ~10% on the gauntlet, as
large as the gaps between its layouts, so one 6-step trial can call a slower plan 12% faster
and keep it for the rest of a run. A trial whose rates are within `trial_sigmas` standard
errors of the old plan's therefore runs on, to 3 x `probe_steps` measured steps; then it stays
only if it is faster beyond the noise, else the old plan wins the tie; and a plan measured
faster is switched back to only by more than that noise. Prices alone are not trusted either:
left on prices, a plan measured 15-35% slower by a later probe was held for 50-200 steps.
Where the contexts move to another bucket
before the trial is measured at either, it goes back without a verdict.

Not here: which plan is best (`policy.SearchPolicy`: search, buckets, forced changes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from earl.runtime.selector.cost import Parallel
from earl.runtime.selector.plan import Plan

if TYPE_CHECKING:
    from earl.runtime.selector.policy import SearchPolicy

Shape = tuple[tuple[str, Parallel], ...]  # a plan's layouts, whatever its devices and budgets
Choice = tuple[Plan, bool, str]  # (plan, changed, reason)


def shape(plan: Plan) -> Shape:
    return tuple((a.actor, a.parallel) for a in plan.actors)


def split_of(plan: Plan) -> tuple[int, ...]:
    """How many devices each actor holds."""
    return tuple(len(a.slots) for a in plan.actors)


@dataclass(frozen=True, slots=True)
class _End:
    """A plan's rate end to end over its last measured steps (`Switching._window`): roofline
    seconds per second where the loop gives each step's context, else tokens/s; `se`: its
    standard error (`_rate`)."""

    rate: float
    plan: Plan
    se: float = 0.0


@dataclass(frozen=True, slots=True)
class _Probe:
    """A plan on trial against the one it replaced (`before.plan`), whose rate at `bucket`,
    where the trial began, was `before`."""

    before: _End
    bucket: int


@dataclass(slots=True)
class Switching:
    """The voluntary-switch state of one `SearchPolicy` (see the module docstring)."""

    policy: SearchPolicy
    last_switch: int = -(10**9)
    better_streak: int = 0
    loop: list[tuple[float, float, int]] = field(default_factory=list)  # since the last
    # switch: (tokens, seconds, bucket) per measured step
    ends: dict[tuple[Shape, int], _End] = field(default_factory=dict)  # (layouts, bucket)
    probe: _Probe | None = None
    last_probe: int = -(10**9)
    probe_wait: int = 1  # x probe_every: doubles after a probe that lost
    fed: bool = False  # the loop gives steps end to end
    roofline: bool = False  # ...with their contexts: rates in roofline seconds per second

    def observe(self, *, tokens: float, seconds: float, context: int, plan: Plan | None,
                bucket: int) -> None:
        """One step of `plan` at `bucket` (`SearchPolicy.observe_step`); `seconds` 0: one the
        loop left unmeasured (or, at its start, none yet): steps come end to end all the same."""
        self.fed = True
        if tokens <= 0 or seconds <= 0:
            return
        if context > 0:  # the roofline's seconds for these tokens at this context
            tokens /= self.policy.cost.tokens_per_s("train", Parallel(), context,
                                                    batch_tokens=context)
        self.roofline = context > 0
        self.loop[:] = [*self.loop[-63:], (tokens, seconds, bucket)]
        got = self._rate(bucket)
        if plan is not None and got is not None:
            self.ends[(shape(plan), bucket)] = _End(got[0], plan, got[1])

    def forced(self) -> None:
        """A change the plan needs (it no longer fits, or the slots changed): a trial ends
        without a verdict."""
        self.probe = None

    def switched(self, step: int) -> None:
        """The plan changed at `step`: its steps are measured anew."""
        self.better_streak, self.last_switch = 0, step
        self.loop.clear()

    def choose(self, step: int, cand: Plan, cur: Plan, bucket: int,
               slots: Mapping[str, float], queues: Mapping[str, int] | None) -> Choice:
        """The decision when the current plan still fits: a probe's step, a plan measured
        faster end to end at this bucket, one priced faster, or a new probe."""
        p, c = self.policy, self.policy.config
        if self.probe is not None:
            return self._trial_step(step, cur, bucket, slots)
        own = self.ends.get((shape(cur), bucket))
        mine = own.rate if own is not None else None
        others = [e for (sh, b), e in self.ends.items() if b == bucket and sh != shape(cur)]
        if own is not None and others and step - self.last_switch >= c.cooldown_steps:
            best = max(others, key=lambda e: e.rate)
            back = p.reevaluate(best.plan, bucket, slots)
            noise = self._noise(best.se, own.se)
            if best.rate >= own.rate * (1 + c.switch_gain) and best.rate - own.rate > noise \
                    and back is not None:
                return back, True, (f"measured {best.rate / own.rate - 1:+.0%} faster end to end "
                                    f"at context {bucket} ({self._show(best.rate)} against "
                                    f"{self._show(own.rate)}, noise {self._show(noise)}): "
                                    f"{p.summary(back)}")
        plan, changed, reason = self._priced(step, cand, cur, bucket, queues, mine)
        if changed or self.better_streak:  # a switch, or one on its way
            return plan, changed, reason
        return self._start_probe(step, cur, bucket, slots, queues, mine) or \
            (plan, changed, reason)

    def pays_off(self, cand: Plan, cur: Plan, queues: Mapping[str, int] | None,
                 bucket: int | None = None) -> tuple[bool, str]:
        """Whether switching from `cur` to `cand` saves more than it costs over
        `horizon_steps` steps, and the ledger that says so. The prices give the share of a
        step the switch saves; a step's seconds are the loop's, measured end to end, where it
        gives them (composed stage prices can put a step at several times what it takes, and
        make a TP 2 replica's 17 s start look paid for). A plan not measured end to end at
        `bucket` may be measured slower and left: its switch costs the way back too."""
        p, c, m = self.policy, self.policy.config, self.policy.measured
        tokens = m.step_tokens() if m is not None else None
        old, new = p.score(cur, queues), p.score(cand, queues)
        step_s = self._step_seconds()
        if old <= 0 or new <= 0 or (step_s is None and not tokens):
            return True, ""
        if step_s is None:  # the priced seconds of a measured step's tokens
            step_s = (tokens or 0.0) / old
        saved = step_s * (1 - old / new) * c.horizon_steps
        cost = (m.switch_seconds() if m is not None else None) or c.switch_cost_s
        if any(a.stage == "rollout" and a.parallel.tp != cur.actor(a.actor).parallel.tp
               for a in cand.actors):  # new engine processes
            cost = max(cost, c.respawn_cost_s)
        back = self.fed and bucket is not None and self._end(cand, bucket) is None
        if back:
            cost *= 2
        return saved > cost, (f"would save {saved:.1f} s over {c.horizon_steps} steps, a "
                              f"switch costs {cost:.1f} s" + (" there and back" if back else ""))

    def _priced(self, step: int, cand: Plan, cur: Plan, bucket: int,
                queues: Mapping[str, int] | None, mine: float | None) -> Choice:
        """The switch the prices call for; not to a plan measured end to end at this bucket
        (the measurement decides: `choose`)."""
        p, c = self.policy, self.policy.config
        gain = p.score(cand, queues) / max(p.score(cur, queues), 1e-9) - 1
        if cand.layouts() == cur.layouts() or gain < c.switch_gain:
            self.better_streak = 0
            return cur, False, f"kept: best within {c.switch_gain:.0%} at context {bucket}"
        if mine is None and self.fed:  # the loop measures plans: this one first, to come back
            return cur, False, (f"kept: a plan priced {gain:+.0%}; this one is not measured end "
                                f"to end at context {bucket} yet ({self._measured(bucket)}/"
                                f"{c.probe_steps} steps)")
        theirs = self._end(cand, bucket)
        if mine is not None and theirs is not None:
            self.better_streak = 0
            return cur, False, (f"kept: a plan priced {gain:+.0%} ran {self._show(theirs)} end "
                                f"to end at context {bucket}, this one {self._show(mine)}")
        pays, ledger = self.pays_off(cand, cur, queues, bucket)
        if not pays:
            self.better_streak = 0
            return cur, False, f"kept: a plan {gain:+.0%} faster {ledger}"
        self.better_streak += 1
        if self.better_streak >= c.patience and step - self.last_switch >= c.cooldown_steps:
            if mine is not None:  # measured end to end: the new plan is on trial
                self.probe = self._trial_of(cur, bucket)
            return cand, True, (f"{gain:+.0%} faster (tokens/s) at context {bucket}"
                                f"{', on trial' if mine is not None else ''}: "
                                f"{p.summary(cand)}")
        return cur, False, (f"kept: a plan {gain:+.0%} faster seen {self.better_streak}/"
                            f"{c.patience} time(s), {step - self.last_switch} step(s) since "
                            "the last switch")

    def _trial_step(self, step: int, cur: Plan, bucket: int,
                    slots: Mapping[str, float]) -> Choice:
        """A plan on trial (a probe, or a switch on prices): held until it has `probe_steps`
        measured steps at a bucket where the plan it replaced has a rate too (where the trial
        began, else the current bucket), and its rate there differs from that plan's by more
        than the noise (`trial_sigmas`) or it has 3 x `probe_steps` steps there; then kept only
        if faster beyond the noise (the plan it replaced wins a tie), else left. After 3 x
        `probe_steps` measured steps without a rate to compare, it goes back without a
        verdict."""
        p, c, probe = self.policy, self.policy.config, self.probe
        assert probe is not None
        got, at = self._rate(probe.bucket), probe.bucket
        old: _End | None = probe.before
        if got is None and bucket != probe.bucket:
            got, old, at = (self._rate(bucket), self.ends.get((shape(probe.before.plan), bucket)),
                            bucket)
        back = p.reevaluate(probe.before.plan, bucket, slots)
        if got is None or old is None:
            if len(self.loop) < 3 * c.probe_steps or back is None:
                why = (f"{self._measured(at)}/{c.probe_steps} step(s) measured at context {at}"
                       if got is None else f"the plan it replaced has no rate at context {at}")
                return cur, False, f"on trial: {why} ({len(self.loop)}/{3 * c.probe_steps})"
            self.probe = None
            return back, True, (f"trial without a verdict: the contexts moved from "
                                f"{probe.bucket} to {bucket} before it was measured; back to "
                                f"{p.summary(back)}")
        (rate, se), before = got, old.rate
        noise, n = self._noise(se, old.se), self._measured(at)
        tied = abs(rate - before) < noise
        if tied and n < 3 * c.probe_steps and back is not None:
            return cur, False, (f"on trial: {self._show(rate)} end to end against "
                                f"{self._show(before)} at context {at}, within the noise "
                                f"({self._show(noise)}; {n}/{3 * c.probe_steps})")
        self.probe, self.last_probe = None, step
        rates = (f"{self._show(rate)} end to end against {self._show(before)} before, at "
                 f"context {at}")
        if (rate >= before and not tied) or back is None:
            self.probe_wait = 1
            return cur, False, f"trial kept: {rates}"
        self.probe_wait = min(4, 2 * self.probe_wait)
        verdict = (f"trial tied: {rates}, within the noise ({self._show(noise)}) after {n} steps"
                   if tied else f"trial lost: {rates}")
        return back, True, f"{verdict}; back to {p.summary(back)}"

    def _start_probe(self, step: int, cur: Plan, bucket: int, slots: Mapping[str, float],
                     queues: Mapping[str, int] | None, mine: float | None) -> Choice | None:
        """A probe of the best plan not measured at this bucket that starts no new engine
        processes, priced within `probe_margin`, every `probe_every` x the wait steps."""
        p, c = self.policy, self.policy.config
        if not c.probe_every or mine is None or \
                step - max(self.last_switch, self.last_probe) < c.probe_every * self.probe_wait:
            return None
        tp = next((a.parallel.tp for a in cur.actors if a.stage == "rollout"), 0)
        measured = {sh for sh, b in self.ends if b == bucket}
        alt = p.candidate(bucket, slots, queues, other_than={shape(cur), *measured},
                          rollout_tp=tp, other_split=split_of(cur))
        self.last_probe = step  # priced once per interval, tried or not
        if alt is None or p.score(alt, queues) < (1 - c.probe_margin) * p.score(cur, queues):
            return None
        self.probe = self._trial_of(cur, bucket)
        gain = p.score(alt, queues) / max(p.score(cur, queues), 1e-9) - 1
        return alt, True, (f"probe for {c.probe_steps} steps (priced {gain:+.0%}; the current "
                           f"plan {self._show(mine)} end to end): {p.summary(alt)}")

    def _trial_of(self, cur: Plan, bucket: int) -> _Probe:
        """A trial against `cur`, measured at `bucket`."""
        return _Probe(replace(self.ends[(shape(cur), bucket)], plan=cur), bucket)

    def _noise(self, se: float, other_se: float) -> float:
        """How far apart two rates must be to tell them apart: `trial_sigmas` standard errors
        of their difference."""
        return self.policy.config.trial_sigmas * math.hypot(se, other_se)

    def _window(self, bucket: int | None = None) -> list[tuple[float, float, int]] | None:
        """The steps since the last switch a rate is taken over: the last 3 x `probe_steps`
        (at `bucket`, where given; None: fewer than `probe_steps`). One step's seconds vary
        2-3x with the batch's longest game, so a plan held longer is compared by more of its
        steps."""
        n = self.policy.config.probe_steps
        steps = [x for x in self.loop if bucket is None or x[2] == bucket][-3 * n:]
        return steps if len(steps) >= n else None

    def _measured(self, bucket: int) -> int:
        """Measured steps at `bucket` since the last switch."""
        return sum(x[2] == bucket for x in self.loop)

    def _rate(self, bucket: int) -> tuple[float, float] | None:
        """The rate at `bucket` over `_window` (tokens over seconds) and its standard error,
        from the spread of its steps in consecutive pairs (0 with fewer than two pairs); None:
        too few steps there."""
        w = self._window(bucket)
        if not w:
            return None
        rate = sum(x[0] for x in w) / sum(x[1] for x in w)
        pairs = [(a[0] + b[0], a[1] + b[1]) for a, b in zip(w[-2::-2], w[::-2], strict=False)]
        m = len(pairs)
        if m < 2:
            return rate, 0.0
        mean_s = sum(s for _, s in pairs) / m
        spread = sum((t - rate * s) ** 2 for t, s in pairs) / (m * (m - 1))
        return rate, math.sqrt(spread) / mean_s

    def _step_seconds(self) -> float | None:
        """The loop's seconds per step over `_window`, whatever the bucket (None: too few)."""
        w = self._window()
        return sum(x[1] for x in w) / len(w) if w else None

    def _end(self, plan: Plan, bucket: int) -> float | None:
        """`plan`'s layouts' rate end to end at `bucket`, when measured."""
        e = self.ends.get((shape(plan), bucket))
        return e.rate if e is not None else None

    def _show(self, rate: float) -> str:
        """An end-to-end rate as the reasons show it."""
        return f"{rate:.3f}x the roofline" if self.roofline else f"{rate:,.0f} tok/s"
