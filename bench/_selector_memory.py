"""The pure logic of `bench/selector.py --memory-bound`: the device-sizing rule, the restart
rule, the conservative and truncating layouts, time to quality and the summary over replicates.

Nothing here starts a process (`_selector_memory_runs` runs the arms); every function is a
function of numbers and of the records the runs leave, so the rules are unit-tested
(`tests/unit/test_selector_memory_bound.py`).

The sizing rule (`size_devices`): the trainer slot's peak memory is modelled as
``base + slope x T``, where ``T`` is the tokens of the step's largest micro-batch,
``min(budget, step tokens)``: a step whose tokens are below the budget is one micro-batch, so
the step-0 pick's micro-batch grows with the contexts until it reaches its budget. ``slope`` is
the cost model's activation bytes per token (`CostModel.activation_bytes`) times the run's own
scale (the pilot's measured peak per step against its tokens, over the cost model's
slope), ``base`` the least that puts every pilot step under ``base + slope x T``. The devices get ``base + slope x T_cap``, with
``T_cap = T0 x (B0 / T0) ** fraction``: ``T0`` the largest step the pilot trained (the start),
``B0`` the step-0 pick's budget (the pilot: its first steps, no memory limit). The pick fits at the start (``T0 < T_cap``) and OOMs once a
step's tokens pass ``T_cap`` (fraction 0.5: half-way, in log tokens, between the start and its
budget). The predicted OOM context is ``T_cap`` over the pilot's tokens per token of the
longest trajectory (``T0 / ctx0``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, replace

# the layouts' knobs the rules below change: the trainer's micro-batch budget and the window
Layout = dict[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizing:
    """The devices of a memory-bound run and what they predict for the step-0 pick."""

    base_mib: float
    slope_kib_per_token: float  # used: the cost model's, times `scale`
    cost_model_kib_per_token: float
    scale: float  # the pilot's measured peak growth / the cost model's prediction of it
    start_tokens: int  # T0: the pilot's largest step (tokens)
    start_context: int  # the pilot's longest trajectory at that step
    budget: int  # B0: the step-0 pick's micro-batch budget
    fraction: float
    cap_tokens: int  # T_cap
    device_mib: int
    predicted_oom_tokens: int  # = cap_tokens: the first step past it OOMs
    predicted_oom_context: int

    def rule(self) -> str:
        return (f"device_mib = base {self.base_mib:.0f} MiB + slope {self.slope_kib_per_token:.2f} "
                f"KiB/token (cost model {self.cost_model_kib_per_token:.2f} x measured scale "
                f"{self.scale:.3f}) x T_cap; T_cap = T0 x (B0/T0)^{self.fraction} = "
                f"{self.start_tokens} x ({self.budget}/{self.start_tokens})^{self.fraction} = "
                f"{self.cap_tokens} tokens: the step-0 pick fits its start (T0) and is killed "
                f"once a step's largest micro-batch, min(B0, step tokens), passes T_cap")

    def fits(self, tokens: int, margin: float = 0.0) -> bool:
        """Whether a micro-batch of `tokens` fits a device, `margin` of it left free."""
        return self.peak_mib(tokens) <= self.device_mib * (1 - margin)

    def peak_mib(self, tokens: int) -> float:
        return self.base_mib + self.slope_kib_per_token * tokens / 1024

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "rule": self.rule()}


def measured_scale(tokens: list[float], peaks: list[float], cost_kib: float) -> float:
    """The pilot's measured peak growth per trained token over the cost model's: the
    trainer's peak RSS of each step (`train/peak_rss_mib`) against its tokens, least squares.
    1.0 when the steps' tokens do not vary enough (under 20%) to measure a slope."""
    if len(tokens) < 3 or max(tokens) < 1.2 * min(tokens):
        return 1.0
    mx, my = statistics.fmean(tokens), statistics.fmean(peaks)
    var = sum((x - mx) ** 2 for x in tokens)
    slope_mib = sum((x - mx) * (y - my) for x, y in zip(tokens, peaks, strict=True)) / var
    return max(slope_mib * 1024 / cost_kib, 0.05)  # a flat or falling fit: a floor, not 0


def size_devices(pilot: list[dict[str, float]], *, cost_kib_per_token: float, budget: int,
                 fraction: float) -> Sizing:
    """The sizing rule (module docstring) from the pilot's step rows (`train/tokens`,
    `train/peak_rss_mib`, `ctx_max`: the step-0 pick with no memory limit) and the cost model's
    activation KiB per trained token.

    Raises:
        ValueError: the pilot has no step rows, or its start is at the budget already.
    """
    rows = [r for r in pilot if r.get("train/peak_rss_mib")]
    if not rows:
        raise ValueError("the pilot trained no step with a measured peak (train/peak_rss_mib)")
    tokens = [float(r["train/tokens"]) for r in rows]
    peaks = [float(r["train/peak_rss_mib"]) for r in rows]
    scale = measured_scale(tokens, peaks, cost_kib_per_token)
    slope = cost_kib_per_token * scale
    top = max(range(len(rows)), key=tokens.__getitem__)
    t0 = int(tokens[top])
    if t0 >= budget:
        raise ValueError(f"the pilot's steps ({t0} tokens) fill the budget ({budget}) already: "
                         "the pick's micro-batch cannot grow, so no context makes it OOM")
    # the upper envelope: every pilot step fits under base + slope x its tokens
    base = max(p - slope * t / 1024 for p, t in zip(peaks, tokens, strict=True))
    cap = int(t0 * (budget / t0) ** fraction)
    per_ctx = t0 / max(float(rows[top].get("ctx_max", 1)), 1.0)
    return Sizing(base_mib=round(base, 1), slope_kib_per_token=round(slope, 4),
                  cost_model_kib_per_token=round(cost_kib_per_token, 4), scale=round(scale, 4),
                  start_tokens=t0, start_context=int(float(rows[top].get("ctx_max", 0))),
                  budget=budget, fraction=fraction, cap_tokens=cap,
                  device_mib=math.ceil(base + slope * cap / 1024), predicted_oom_tokens=cap,
                  predicted_oom_context=round(cap / per_ctx))


def resize(sizing: Sizing, *, base_mib: float | None = None, floor_mib: float = 0.0) -> Sizing:
    """`sizing` with a higher measured base (the slots' cgroup peaks charge more than the RSS
    the trainer reports) or a device no smaller than `floor_mib` (the rollout's own peak, so
    that it is never what OOMs); the cap and the predicted OOM follow the device."""
    base = sizing.base_mib if base_mib is None else base_mib
    dev = max(math.ceil(base + sizing.slope_kib_per_token * sizing.cap_tokens / 1024),
              math.ceil(floor_mib), sizing.device_mib if base_mib is None else 0)
    cap = int((dev - base) * 1024 / sizing.slope_kib_per_token)
    per_ctx = sizing.start_tokens / max(sizing.start_context, 1)
    return replace(sizing, base_mib=round(base, 1), device_mib=dev, predicted_oom_tokens=cap,
                   predicted_oom_context=round(cap / per_ctx))


def next_budget(budget: int, top: int) -> int | None:
    """The restart rule: after an OOM, the same layout with half the micro-batch budget
    (what a user does first: the budget is the knob that scales activation memory), never
    below one whole longest sequence (`top`, the model's positions); None when halving would
    go below it (the user has nothing left but recomputation or more devices)."""
    half = budget // 2
    return half if half >= top else None


def conservative_budget(sizing: Sizing, top: int, margin: float) -> int | None:
    """The conservative static layout's budget: the largest of the pick's budget halved 0, 1,
    2, ... times, at least one longest sequence (`top`), whose full micro-batch fits a device
    with `margin` left free (a step at the longest context fills any budget: it fits from
    step 0 to the end); None when not even `top` tokens fit."""
    b: int | None = sizing.budget
    while b is not None:
        if sizing.fits(b, margin):
            return b
        b = next_budget(b, top)
    return None


def truncate_window(sizing: Sizing, per_context: float, margin: float) -> int:
    """The step-0 pick's window cut to what fits: the largest multiple of 64 whose step fits
    a device with `margin` free when a step trains `per_context` tokens per token of its
    longest trajectory (a window caps that trajectory; `per_context`: the batch's trajectories
    plus its self-imitation replays, or more where the pilot measured more), at least 64."""
    room = (sizing.device_mib * (1 - margin) - sizing.base_mib) * 1024 \
        / sizing.slope_kib_per_token
    return max(64, int(room / per_context) // 64 * 64)


def time_to_quality(evals: list[dict[str, float]], key: str, threshold: float
                    ) -> float | None:
    """Wall seconds (`wall_s`, the arm's clock) of the first eval whose `key` reaches
    `threshold`; None if none does."""
    for ev in sorted(evals, key=lambda e: float(e["wall_s"])):
        if float(ev.get(key, float("-inf"))) >= threshold:
            return float(ev["wall_s"])
    return None


def median_spread(xs: list[float | None]) -> dict[str, object]:
    """Median, min and max of the values that exist, and how many did not."""
    have = [float(x) for x in xs if x is not None]
    if not have:
        return {"median": None, "min": None, "max": None, "n": 0, "missing": len(xs)}
    return {"median": round(statistics.median(have), 3), "min": round(min(have), 3),
            "max": round(max(have), 3), "n": len(have), "missing": len(xs) - len(have)}


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 3) if num is not None and den else None


def oracle_seconds(work: dict[str, list[float]], runs: list[dict[str, list[float]]]
                   ) -> float | None:
    """The seconds of `work` (bucket -> [tokens, seconds], the selector's) at, in each bucket,
    the fastest rate any of `runs` (static arms' own `by_context`) measured there: a
    clairvoyant switch between them at no cost. A bucket none measured takes the fastest rate
    measured in the longest bucket below it (favouring the oracle); None if none is below."""
    rates: dict[int, float] = {}
    for run in runs:
        for b, (tok, sec) in run.items():
            if tok > 0 and sec > 0:
                rates[int(b)] = max(rates.get(int(b), 0.0), tok / sec)
    total = 0.0
    for b, (tok, _) in work.items():
        if tok <= 0:
            continue
        below = [x for x in rates if x <= int(b)]
        if not below:
            return None
        total += tok / rates[int(b) if int(b) in rates else max(below)]
    return total


ARMS = ("restart_pick", "selector", "conservative", "truncate", "pinned", "pinned_static")
ORACLE_ARMS = ("restart_pick", "conservative", "pinned_static")


def summarize(reps: list[dict[str, dict[str, object]]], *, key: str, threshold: float,
              steps: int) -> dict[str, object]:
    """The comparison over replicates. `reps`: per replicate, arm -> its record (`wall_s`:
    wall seconds for the steps it kept, `tokens`, `steps`, `evals` (each with `wall_s` and
    `key`), `ooms`, `steps_lost`, `samples_lost`, `by_context`, `kernel_oom`,
    `restart_s`). Returns the issue's keys, with per-arm medians and spreads and, where a
    ratio falls short of its goal, which arm won and why."""
    per: dict[str, dict[str, list[float | None]]] = {}
    for rep in reps:
        for arm, r in rep.items():
            a = per.setdefault(arm, {})
            ttq = time_to_quality(r.get("evals", []), key, threshold)  # type: ignore[arg-type]
            evals = r.get("evals") or []
            final = float(evals[-1][key]) if evals else None  # type: ignore[index]
            wall = float(str(r["wall_s"])) if r.get("wall_s") else None
            tps = float(str(r["tokens"])) / wall if wall and r.get("tokens") else None
            for k, v in (("time_to_quality_s", ttq), ("wall_s", wall), ("final_quality", final),
                         ("tokens_per_s", tps), ("ooms", float(str(r.get("ooms", 0)))),
                         ("steps_lost", float(str(r.get("steps_lost", 0)))),
                         ("restart_s", float(str(r.get("restart_s", 0.0))))):
                a.setdefault(k, []).append(v)
    arms = {arm: {k: median_spread(v) for k, v in m.items()} for arm, m in per.items()}

    def med(arm: str, k: str) -> float | None:
        return arms.get(arm, {}).get(k, {}).get("median")  # type: ignore[return-value]

    censored: dict[str, list[str]] = {}

    def paired(other: str, k: str, invert: bool) -> float | None:
        """Median over replicates of the per-replicate ratio of the selector to `other`. For
        time to quality, an arm that never reached it counts its whole run's wall seconds
        (it would have needed more): the ratio is then a bound, named in `censored`."""
        xs = []
        for rep in reps:
            s, o = rep.get("selector"), rep.get(other)
            if not s or not o:
                continue
            sv, ov = per_value(s, k), per_value(o, k)
            if k == "ttq" and (sv is None) != (ov is None):
                censored.setdefault(other, []).append(
                    "lower bound" if ov is None else "upper bound")
                sv = sv if sv is not None else per_value(s, "wall")
                ov = ov if ov is not None else per_value(o, "wall")
            xs.append(ratio(ov, sv) if invert else ratio(sv, ov))
        return median_spread(xs)["median"]  # type: ignore[return-value]

    def per_value(r: dict[str, object], k: str) -> float | None:
        if k == "ttq":
            return time_to_quality(r.get("evals", []), key, threshold)  # type: ignore[arg-type]
        wall = float(str(r["wall_s"])) if r.get("wall_s") else None
        if k == "wall":
            return wall
        return float(str(r["tokens"])) / wall if wall and r.get("tokens") else None

    # oracle: the selector's work at the fastest rate any static arm on its devices that
    # holds the whole window measured (the pick before its kill and after its restarts, the
    # conservative layout, the pinned plan's static twin; not truncate, which cuts contexts)
    fractions = []
    for rep in reps:
        s = rep.get("selector")
        statics = [r["by_context"] for a, r in rep.items()
                   if a in ORACLE_ARMS and r.get("by_context")]
        if s and statics and s.get("loop_s"):
            o = oracle_seconds(s["by_context"], statics)  # type: ignore[arg-type]
            fractions.append(ratio(o, float(str(s["loop_s"]))))
    pin = [ratio(per_value(rep["pinned"], "tps"), per_value(rep["pinned_static"], "tps"))
           for rep in reps if rep.get("pinned") and rep.get("pinned_static")]
    pin_ratio = median_spread(pin)["median"]
    out: dict[str, object] = {
        "replicates": len(reps), "steps": steps, "quality_key": key,
        "quality_threshold": threshold, "arms": arms,
        "ratio_vs_restart_pick": paired("restart_pick", "ttq", invert=True),
        "ratio_vs_conservative": paired("conservative", "ttq", invert=True),
        "tokens_per_s_ratio_vs_restart_pick": paired("restart_pick", "tps", invert=False),
        "tokens_per_s_ratio_vs_conservative": paired("conservative", "tps", invert=False),
        "ratio_censored": censored,
        "pinned_overhead": None if pin_ratio is None else round(1 - float(str(pin_ratio)), 3),
        "oracle_fraction_same_devices": median_spread(fractions)["median"],
        "step0_pick_oom": bool(reps) and all(bool(rep.get("restart_pick", {}).get("kernel_oom"))
                                             for rep in reps),
        "oom_selector": any(float(str(rep.get("selector", {}).get("ooms", 0))) > 0
                            for rep in reps),
        "samples_lost": sum(int(str(rep.get("selector", {}).get("samples_lost", 0)))
                            for rep in reps),
    }
    out["goals"] = {
        "ratio_vs_restart_pick>=1.2": _ge(out["ratio_vs_restart_pick"], 1.2),
        "ratio_vs_conservative>=1.05": _ge(out["ratio_vs_conservative"], 1.05),
        "pinned_overhead<=0.03": out["pinned_overhead"] is not None
        and float(str(out["pinned_overhead"])) <= 0.03,
        "oracle_fraction_same_devices>=0.9": _ge(out["oracle_fraction_same_devices"], 0.9),
        "step0_pick_oom": out["step0_pick_oom"], "oom_selector==false": not out["oom_selector"],
        "samples_lost==0": out["samples_lost"] == 0, "replicates>=3": len(reps) >= 3,
    }
    out["winners"] = winners(arms, med)
    out["short_of_goal"] = short_of_goal(out, med)  # type: ignore[arg-type]
    return out


GOALS = {"ratio_vs_restart_pick": ("restart_pick", 1.2),
         "ratio_vs_conservative": ("conservative", 1.05)}


def short_of_goal(out: dict[str, object], med: object) -> dict[str, dict[str, object]]:
    """For each ratio below its goal: which of the two arms reached the quality first (or
    neither), and each one's medians that say why (tokens/s, final quality, OOMs, steps lost,
    restart seconds)."""
    get = med  # type: ignore[assignment]
    keys = ("time_to_quality_s", "tokens_per_s", "final_quality", "ooms", "steps_lost",
            "restart_s")
    res: dict[str, dict[str, object]] = {}
    for name, (other, goal) in GOALS.items():
        value = out[name]
        if value is not None and float(str(value)) >= goal:
            continue
        ttq = {a: get(a, "time_to_quality_s") for a in ("selector", other)}  # type: ignore[operator]
        reached = {a: t for a, t in ttq.items() if t is not None}
        res[name] = {"value": value, "goal": goal,
                     "first_to_quality": min(reached, key=reached.__getitem__) if reached
                     else None,
                     **{a: {k: get(a, k) for k in keys}  # type: ignore[operator]
                        for a in ("selector", other)}}
    return res


def _ge(x: object, goal: float) -> bool:
    return x is not None and float(str(x)) >= goal


def winners(arms: dict[str, dict[str, dict[str, object]]], med: object) -> dict[str, object]:
    """Which arm was best at each figure (median over replicates), and why the others lost
    what they lost: their OOMs, steps lost, restart seconds and final quality beside it."""
    get = med  # type: ignore[assignment]
    out: dict[str, object] = {}
    for k, best in (("time_to_quality_s", min), ("wall_s", min), ("tokens_per_s", max),
                    ("final_quality", max)):
        have = {a: get(a, k) for a in arms if get(a, k) is not None}  # type: ignore[operator]
        out[k] = best(have, key=have.__getitem__) if have else None
    out["why"] = {a: {k: get(a, k) for k in ("time_to_quality_s", "tokens_per_s",  # type: ignore[operator]
                                              "final_quality", "ooms", "steps_lost",
                                              "restart_s")} for a in arms}
    return out
