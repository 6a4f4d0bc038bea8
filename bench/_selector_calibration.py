"""Calibration of the selector's cost model against the measured 2-core runs.

Before `selector_simulate` quotes cluster figures, the same `CostModel` the runtime builds for
a run (`cost_model_of`: the tiny Qwen2 of `bench/selector.py`, fp32, a CPU core's roofs) must
reproduce what this machine measured:

- **Rates.** Each static run of `bench/selector.py` (`bench/results/selector_runs/*static*`)
  measured, per context bucket of a step's longest trajectory, trained tokens per second of
  the whole asynchronous loop (`by_context`: trained tokens over step seconds, end to end).
  The model predicts each bucket's rate as the policy scores a plan: the slower of the rollout
  (its replicas' decode roofline) and the trainer (its DP ranks' training roofline), each
  device holding `cores / devices` of a core. Attention is priced at the tokens' positions,
  not at the bucket: a step's trajectories lie below its longest, at a token-weighted length
  of `ATTENTION_SHARE` of it (derived there). The roofline's absolute level is not a
  prediction (the runtime rescales it by each stage's measured efficiency), so one factor is
  fitted per sweep (a sweep: the runs of one commit, on one machine state), on one layout's
  buckets (`FIT_LAYOUT`); every other run of that sweep is held out. One more constant is
  fitted, on the same buckets of every sweep and on nothing else: the rollout's seconds per
  decode step beyond the roofline (`CostConfig.decode_step_s`; `fit_decode_step`). It is
  needed because the roofline has no cost per token that does not grow with the context, and
  a tiny model on a CPU core has a large one: without it the rate falls with the context
  about twice as fast as measured, and no first-principles count of the engine's per-step
  Python gives it. A fit on one layout's context slope, it is then checked on layouts that
  decode 11, 16 or 32 sequences per replica, where it weighs differently. A run's error is
  its predicted whole-run rate (its own tokens per bucket at the predicted bucket rates) over
  the measured one, minus 1.
- **OOM.** The memory-bound runs (`bench/selector.py --memory-bound`: `sizing`, `measured_oom`) sized
  the trainer's device so that the step-0 pick is killed once a step's micro-batch passes a
  cap. The model's prediction: the largest micro-batch (tokens, at the step's longest context)
  whose trainer bytes fit the device (`device_mib`) over the measured per-process base
  (`base_mib`, the runtime's reserve); compared with the largest micro-batch the trainer
  survived before the kill. The killed segments' per-step series are not saved (the arm's
  `metrics.jsonl` holds its last segment), so the OOM step is compared through its tokens.

Not here: the cluster simulation (`selector_simulate`), running anything.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from earl.loop.selection_actors import cost_model_of
from earl.runtime.selector.cost import CostModel, Parallel

ROOT = Path(__file__).resolve().parent / "results"
RUNS = ROOT / "selector_runs"
MODEL_DIR = RUNS / "warm" / "weights_start"
FIT_LAYOUT = "d2/r1-t1/w4096/mb8k"
CORES = 2
ROLLOUT_SEQS = 32  # the gauntlet's batch: sequences the rollout decodes at once
# A step's token-weighted trajectory length (sum L^2 / sum L, what attention costs) over its
# longest. The gauntlet plays games until the first loss at a loss rate that changes slowly
# over the steps, so a step's lengths are about exponential (geometric in games) with some
# mean m: their token-weighted length is E[L^2] / E[L] = 2m, the longest of n is m x H(n)
# (the n-th harmonic number), so the share is 2 / H(n): 0.49 for the batch's 32 episodes.
# Not measured per step: the runs keep no per-step lengths (`by_context` holds tokens and
# seconds per bucket only).
ATTENTION_SHARE = 2 / sum(1 / k for k in range(1, ROLLOUT_SEQS + 1))
DECODE_STEP_MAX_S = 0.02  # the fit's search range for `decode_step_s`, at one core
MIN_BUCKET_S = 5.0  # buckets with fewer loop seconds are noise, not a rate
TOLERANCE = 0.10
_LAYOUT = re.compile(r"d(\d+)/r(\d+)(?:tp(\d+))?-t(\d+)/w(\d+)/mb(\d+)k")


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticLayout:
    """A static arm's layout, from its name "static/dD/rR[tpP]-tT/wW/mbMk"."""

    devices: int
    replicas: int
    rollout_tp: int
    trainer_dp: int
    window: int
    micro_batch_tokens: int

    @classmethod
    def parse(cls, name: str) -> StaticLayout:
        m = _LAYOUT.search(name)
        if m is None:
            raise ValueError(f"layout {name!r} is not 'static/dD/rR[tpP]-tT/wW/mbMk'")
        d, r, tp, t, w, mb = m.groups()
        return cls(devices=int(d), replicas=int(r), rollout_tp=int(tp or 1),
                   trainer_dp=int(t), window=int(w), micro_batch_tokens=int(mb) * 1024)


@dataclass(frozen=True, slots=True, kw_only=True)
class MeasuredRun:
    """One measured static run: its sweep, layout, device size and `by_context`."""

    sweep: str
    name: str
    layout: StaticLayout
    device_mib: float
    by_context: dict[int, tuple[float, float]]  # bucket -> (trained tokens, loop seconds)


def cpu_cost(devices: int, reserve_mib: float, *, cores: int = CORES,
             model_dir: Path = MODEL_DIR, decode_step_s: float = 0.0,
             step_in_slot: bool = True) -> CostModel:
    """The runtime's cost model of the tiny model (`cost_model_of`, cpu=True), each device
    holding `cores / devices` of a core (both roofs, and `decode_step_s`, the seconds of a
    decode step beyond the roofline on one whole core, scale alike; with `step_in_slot`
    False `decode_step_s` is time spent outside the device's CPU share, which does not
    scale: the other bound of `rate_calibration`'s `step_outside_slot`)."""
    cost = cost_model_of(str(model_dir), reserve_mib=reserve_mib, cpu=True)
    share = min(1.0, cores / devices)
    cfg = dataclasses.replace(cost.config, peak_flops=cost.config.peak_flops * share,
                              mem_bw=cost.config.mem_bw * share,
                              decode_step_s=decode_step_s / (share if step_in_slot else 1.0))
    return CostModel(cost.shape, cfg)


def predicted_rate(cost: CostModel, lay: StaticLayout, bucket: int, capacity: float,
                   *, rollout_seqs: int = ROLLOUT_SEQS,
                   attention_share: float = ATTENTION_SHARE) -> float:
    """Roofline tokens/s of the loop at `bucket`: the slower of rollout and trainer (the
    policy's `score` of a plan), the trainer at its budget or the largest micro-batch that fits
    `capacity` bytes (at the longest context), the rollout decoding its share of
    `rollout_seqs` per replica; attention at `attention_share` of the context (the tokens'
    token-weighted length)."""
    ctx = min(bucket, lay.window)
    att = attention_share * ctx
    rpar = Parallel(tp=lay.rollout_tp, dp=lay.replicas)
    # the KV a decode step reads: its sequences at their current positions, on average half
    # their token-weighted length
    seqs = -(-rollout_seqs // lay.replicas)
    roll = cost.tokens_per_s("rollout", rpar, ctx, batch_tokens=seqs * ctx, attention_len=att,
                             kv_tokens=round(seqs * att / 2))
    tpar = Parallel(dp=lay.trainer_dp)
    fit = cost.max_micro_batch_tokens("train", tpar, ctx, capacity)
    mb = max(ctx, min(lay.micro_batch_tokens, fit or ctx))
    train = cost.tokens_per_s("train", tpar, ctx, batch_tokens=mb, attention_len=att)
    return min(roll, train)


def whole_run_rate(by_context: Mapping[int, tuple[float, float]],
                   rate: Mapping[int, float]) -> tuple[float, float]:
    """(measured, predicted) tokens/s of a run over the buckets in `rate`: its tokens over its
    seconds, and the same tokens at the predicted rate of each bucket."""
    tokens = sum(by_context[b][0] for b in rate)
    measured = tokens / sum(by_context[b][1] for b in rate)
    predicted = tokens / sum(by_context[b][0] / rate[b] for b in rate)
    return measured, predicted


def fit_scale(pairs: Iterable[tuple[float, float]]) -> float:
    """The factor that maps predicted to measured rates: the geometric mean of measured over
    predicted of `pairs` (measured, predicted)."""
    ratios = [m / p for m, p in pairs]
    if not ratios:
        raise ValueError("fit_scale: no (measured, predicted) pairs to fit")
    return statistics.geometric_mean(ratios)


def error_summary(errors: Iterable[float], tolerance: float = TOLERANCE) -> dict[str, object]:
    """Max and median absolute relative error and whether every one is within `tolerance`."""
    a = [abs(e) for e in errors]
    return {"n": len(a), "max_abs_error": round(max(a), 3) if a else None,
            "median_abs_error": round(statistics.median(a), 3) if a else None,
            "within": bool(a) and max(a) <= tolerance}


def load_runs(folder: Path = RUNS) -> list[MeasuredRun]:
    """The static runs saved by `bench/selector.py` (finished or OOM-killed), by sweep."""
    out = []
    for f in sorted(glob.glob(str(folder / "*static*.result.json"))):
        r = json.loads(Path(f).read_text())["run"]
        bc = {int(b): (float(t), float(s)) for b, (t, s) in r.get("by_context", {}).items()}
        out.append(MeasuredRun(sweep=str(r.get("commit", ""))[:7], name=r["config"],
                               layout=StaticLayout.parse(r["config"]),
                               device_mib=float(r["device_mib"]), by_context=bc))
    return out


def rate_calibration(runs: list[MeasuredRun], *, reserve_mib: float = 0.0,
                     fit_layout: str = FIT_LAYOUT) -> dict[str, object]:
    """Fit `decode_step_s` and one factor per sweep on `fit_layout`'s buckets, predict the
    other runs (held out).

    Returns:
        `rule`, `attention_share`, the fitted `decode_step_s`, per sweep its fitted `scale`
        and `context_slope` (the fit layout's), per held-out run its measured and predicted
        tokens/s and `error`, `held_out` (`error_summary` of the runs), `rate_within_10pct`,
        and `bucket_error_mean` (the mean error per bucket: a trend names a term whose
        dependence on the context is off).
    """
    sweeps: dict[str, list[MeasuredRun]] = {}
    for r in runs:
        sweeps.setdefault(r.sweep, []).append(r)
    sweeps = {k: v for k, v in sweeps.items()
              if len(v) >= 2 and any(fit_layout in r.name for r in v)}
    fits = [next(r for r in v if fit_layout in r.name) for v in sweeps.values()]
    step_s = fit_decode_step(fits, reserve_mib=reserve_mib)
    rows: list[dict[str, object]] = []
    scales: dict[str, float] = {}
    slopes: dict[str, dict[str, float]] = {}
    bucket_errors: dict[int, list[float]] = {}
    outside: list[float] = []
    for (sweep, members), fit in sorted(zip(sweeps.items(), fits, strict=True)):
        pred = {r.name: _bucket_rates(r, reserve_mib, step_s) for r in members}
        scale = fit_scale(_pairs(fit, pred[fit.name]))
        scales[sweep] = round(scale, 4)
        slopes[sweep] = context_slope(fit.by_context, pred[fit.name])
        for r in members:
            if r is fit or not pred[r.name]:
                continue
            rate = {b: p * scale for b, p in pred[r.name].items()}
            measured, predicted = whole_run_rate(r.by_context, rate)
            for b, p in rate.items():
                t, s = r.by_context[b]
                bucket_errors.setdefault(b, []).append(p / (t / s) - 1)
            # the same fit (decode_step_s and scale are the fit layout's, where the share
            # is 1 and both readings agree) with the step's cost outside the device's share
            out = {b: p * scale for b, p in
                   _bucket_rates(r, reserve_mib, step_s, step_in_slot=False).items()}
            _, pred_out = whole_run_rate(r.by_context, out)
            outside.append(pred_out / measured - 1)
            rows.append({"sweep": sweep, "run": r.name, "measured_tokens_per_s": round(measured),
                         "predicted_tokens_per_s": round(predicted),
                         "error": round(predicted / measured - 1, 3),
                         "error_step_outside_slot": round(outside[-1], 3)})
    held = error_summary(float(str(r["error"])) for r in rows)
    return {
        "what": "trained tokens per loop second of each static run (end to end, async loop), "
                "per context bucket of a step's longest trajectory (`by_context`)",
        "rule": f"per sweep (commit), one factor fitted on {fit_layout}'s buckets (geometric "
                f"mean of measured / roofline), and across sweeps one decode_step_s fitted on "
                f"the same buckets (least squares of log measured / predicted); every other "
                f"run of a sweep held out; attention at {ATTENTION_SHARE:.3f} of the bucket "
                f"(2 / H({ROLLOUT_SEQS}), not fitted); buckets of < {MIN_BUCKET_S:g} s left out",
        "attention_share": round(ATTENTION_SHARE, 4), "decode_step_s": round(step_s, 6),
        "scale_per_sweep": scales, "context_slope": slopes, "held_out_runs": rows, "held_out": held,
        "rate_within_10pct": held["within"],
        "step_outside_slot": {
            "what": "the held-out errors with decode_step_s as time outside the device's CPU "
                    "share (not scaled by 1 / share; a diagnostic, no constant refitted): on a "
                    "half-core device the measured rate lies between the two readings where "
                    "the rollout binds",
            "held_out": error_summary(outside)},
        "bucket_error_mean": {str(b): round(statistics.fmean(e), 3)
                              for b, e in sorted(bucket_errors.items())},
    }


def fit_decode_step(fits: list[MeasuredRun], *, reserve_mib: float = 0.0,
                    hi: float = DECODE_STEP_MAX_S) -> float:
    """The rollout's seconds per decode step beyond the roofline (one core) that best fit
    `fits` (one run per sweep, each with its own `fit_scale`): least squares of log measured
    over predicted bucket rates, by golden-section search over [0, `hi`] (to 10 us)."""
    def loss(step_s: float) -> float:
        out = 0.0
        for r in fits:
            pairs = _pairs(r, _bucket_rates(r, reserve_mib, step_s))
            scale = fit_scale(pairs)
            out += sum(math.log(m / (p * scale)) ** 2 for m, p in pairs)
        return out

    lo, g = 0.0, (math.sqrt(5) - 1) / 2
    a, b = hi - g * (hi - lo), lo + g * (hi - lo)
    fa, fb = loss(a), loss(b)
    while hi - lo > 1e-5:
        if fa <= fb:
            hi, b, fb = b, a, fa
            a = hi - g * (hi - lo)
            fa = loss(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + g * (hi - lo)
            fb = loss(b)
    best = (lo + hi) / 2
    return 0.0 if loss(0.0) <= loss(best) else best  # the bound itself: no overhead


def context_slope(by_context: Mapping[int, tuple[float, float]],
                  predicted: Mapping[int, float]) -> dict[str, float]:
    """How much the rate falls from the shortest to the longest bucket of `predicted`: the
    measured rate there over the shortest bucket's, and the predicted one (1: flat)."""
    lo, hi = min(predicted), max(predicted)
    rate = {b: by_context[b][0] / by_context[b][1] for b in (lo, hi)}
    return {"from": lo, "to": hi, "measured": round(rate[hi] / rate[lo], 3),
            "predicted": round(predicted[hi] / predicted[lo], 3)}


def _bucket_rates(r: MeasuredRun, reserve_mib: float, decode_step_s: float,
                  step_in_slot: bool = True) -> dict[int, float]:
    cost = cpu_cost(r.layout.devices, reserve_mib, decode_step_s=decode_step_s,
                    step_in_slot=step_in_slot)
    cap = r.device_mib * 2**20
    return {b: predicted_rate(cost, r.layout, b, cap)
            for b, (t, s) in r.by_context.items() if s >= MIN_BUCKET_S and t > 0}


def _pairs(r: MeasuredRun, predicted: Mapping[int, float]) -> list[tuple[float, float]]:
    return [(r.by_context[b][0] / r.by_context[b][1], p) for b, p in predicted.items()]


def predicted_oom_tokens(cost: CostModel, context: int, device_mib: float) -> int:
    """The largest trainer micro-batch (tokens of `context`-long sequences, one DP rank) whose
    bytes fit a `device_mib` device: the step whose micro-batch passes it is the OOM step."""
    return cost.max_micro_batch_tokens("train", Parallel(), context, device_mib * 2**20)


def oom_calibration(results: Mapping[str, Mapping[str, object]], *,
                    model_dir: Path = MODEL_DIR) -> dict[str, object]:
    """Per memory-bound result (name -> its `result`) and per kill of its step-0 pick: the
    micro-batch the trainer survived last before the kill (min(budget, the largest step so
    far)) against the largest one the runtime's cost model fits on the device, with the
    measured per-process base (`sizing.base_mib`) as its reserve, at the longest context so
    far. Beside it, the sweep's own prediction (`predicted_oom_step_tokens`: the cost model's
    SDPA pricing times the pilot's measured scale) and the cost model's SDPA pricing alone
    (`attention="flash"`, 8 bytes per logit, as `bench/selector.py --profile` prices the
    model): the runtime prices the trainer's attention as eager (its scores kept)."""
    rows: list[dict[str, object]] = []
    for name, res in sorted(results.items()):
        sizing = res["sizing"]
        assert isinstance(sizing, Mapping)
        base, dev = float(sizing["base_mib"]), float(sizing["device_mib"])
        cost = cpu_cost(CORES, base, model_dir=model_dir)
        sdpa = CostModel(cost.shape, dataclasses.replace(cost.config, attention="flash",
                                                         logit_bytes=8.0))
        kills = res.get("measured_oom") or []
        assert isinstance(kills, list)
        for rep in kills:
            for k in rep:
                ctx = int(k["ctx_max_so_far"])
                survived = min(int(k["budget"]), int(k["step_tokens_max_so_far"]))
                model = predicted_oom_tokens(cost, ctx, dev)
                rows.append({
                    "result": name, "budget": int(k["budget"]), "kill_step": int(k["step"]),
                    "context": ctx, "device_mib": dev, "base_mib": base,
                    "measured_step_tokens": survived, "predicted_step_tokens": model,
                    "error": round(model / survived - 1, 3),
                    "sweep_predicted_step_tokens": int(res["predicted_oom_step_tokens"]),
                    "sweep_error": round(int(res["predicted_oom_step_tokens"]) / survived - 1,
                                         3),
                    "sdpa_pricing_step_tokens": predicted_oom_tokens(sdpa, ctx, dev),
                    "sdpa_pricing_error": round(
                        predicted_oom_tokens(sdpa, ctx, dev) / survived - 1, 3)})
    errors = [float(str(r["error"])) for r in rows]
    return {
        "what": "the OOM step's micro-batch (tokens): the largest one the trainer survived "
                "before each kill, against the largest the cost model fits the device; the "
                "killed segments' per-step series are not saved, so the step index itself is "
                "compared through its tokens",
        "kills": rows, "summary": error_summary(errors),
        "oom_step_error": max(errors, key=abs) if errors else None,
        "sdpa_pricing_summary": error_summary(float(str(r["sdpa_pricing_error"]))
                                              for r in rows),
        "sweep_summary": error_summary(float(str(r["sweep_error"])) for r in rows),
    }


def load_memory_results(folder: Path = ROOT) -> dict[str, dict[str, object]]:
    """The memory-bound results of `bench/selector.py --memory-bound` that recorded a kill."""
    out = {}
    for f in sorted(glob.glob(str(folder / "selector_memory-*.json"))):
        res = json.loads(Path(f).read_text())["result"]
        if res.get("measured_oom") and res.get("sizing"):
            out[Path(f).name] = res
    return out
