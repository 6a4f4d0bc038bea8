"""Profiler: measured tokens/s and peak memory per (stage, layout, context bucket) on this machine.

The caller passes a `StepFn` that runs one real step of a stage (a model's forward, or forward
and backward) on `micro_batch_seqs` sequences of `context` tokens and returns the tokens it
processed; the runtime imports no model, so the model arrives as that callable. Peak memory is
the growth of the process's resident set during the step (`VmHWM`, reset through
`/proc/self/clear_refs`; glibc is told to return big blocks to the OS so freed activations do
not hide the next step's) on CPU, and `torch.cuda.max_memory_allocated` on a GPU. Each point is
printed next to the cost model's prediction for the same step (`CostModel.memory` minus the
weights, which are resident before the step).

`Profiler.ensure` measures a bucket the first time the run reaches it (the loop calls it before
the stage runs); `ProfileTable` serves the points to the policy (`policy.Measured`).

`RunProfile` is the profile a run keeps as it trains, with no extra steps: the loop records
each rollout and each training step (tokens, seconds, the trainer's peak resident memory) at
the layout and context bucket it ran with. For a layout it has run, the policy gets the measured
tokens/s; for one it has not, the cost model's roofline scaled by the stage's measured
efficiency (measured / roofline where it did run), so plans compare in the same units; and the
stage's memory is scaled by the worst measured / predicted ratio where the model predicted
too little, and lowered by the least it over-predicted by where it always predicted too much
(`memory_slack`).
Not here: the decision (`policy`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from earl.runtime import heap
from earl.runtime.selector.cost import CostModel, Parallel, Stage

StepFn = Callable[[int, int], int]  # (context, micro_batch_seqs) -> tokens processed
_M_MMAP_THRESHOLD = -3


def reset_peak(device: Any = "cpu") -> None:
    """Start a new memory peak: the CUDA allocator's on a CUDA `device`, else this process's
    resident set (`VmHWM` := `VmRSS`; Linux)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)
        return
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_bytes(device: Any = "cpu") -> int:
    """The memory peak since `reset_peak` (or the start): CUDA allocator or resident set."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return heap.status_kib("VmHWM") << 10


class PeakMeter:
    """Peak bytes allocated by a callable: CPU resident-set growth, or CUDA allocator peak."""

    def __init__(self, device: str = "cpu") -> None:
        self.device = device
        lib = heap.libc()
        if device == "cpu" and lib is not None:
            # a fixed threshold (the default one grows after frees) returns blocks >= 128 KiB
            # to the OS when freed, so the resident set follows live tensors
            lib.mallopt(_M_MMAP_THRESHOLD, 128 << 10)

    def measure(self, fn: Callable[[], int]) -> tuple[int, float, int]:
        """Run `fn`; return (its result, seconds, peak bytes above the level before it).

        Raises:
            OSError: no /proc (not Linux) on CPU.
        """
        gc.collect()
        if self.device != "cpu":
            import torch

            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
        else:
            heap.trim()
            base = heap.status_kib("VmRSS") << 10
        reset_peak(self.device)
        t0 = time.perf_counter()
        out = fn()
        if self.device != "cpu":
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0, peak_bytes(self.device) - base


@dataclass(frozen=True, slots=True, kw_only=True)
class ProfilePoint:
    """One measured point and the cost model's prediction for it."""

    stage: Stage
    layout: str
    bucket: int
    micro_batch_seqs: int
    tokens_per_s: float
    measured_bytes: int
    predicted_bytes: float

    @property
    def error(self) -> float:
        """predicted / measured - 1."""
        return self.predicted_bytes / max(self.measured_bytes, 1) - 1

    def line(self) -> str:
        return (f"{self.stage:9s} {self.layout:18s} ctx {self.bucket:6d} x{self.micro_batch_seqs}: "
                f"{self.tokens_per_s:10,.0f} tok/s  memory predicted "
                f"{self.predicted_bytes / 2**20:8.1f} MiB measured "
                f"{self.measured_bytes / 2**20:8.1f} MiB ({self.error:+.0%})")


class ProfileTable:
    """Measured points by (stage, layout, bucket); what the policy reads (`policy.Measured`)."""

    def __init__(self, buckets: tuple[int, ...]) -> None:
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"ProfileTable buckets must be increasing, got {buckets}")
        self.buckets = buckets
        self.points: dict[tuple[Stage, str, int], ProfilePoint] = {}

    def bucket_of(self, context: int) -> int:
        """The smallest bucket >= context (the largest if context is beyond all)."""
        return next((b for b in self.buckets if b >= context), self.buckets[-1])

    def add(self, p: ProfilePoint) -> None:
        self.points[(p.stage, p.layout, p.bucket)] = p

    def tokens_per_s(self, stage: Stage, par: Parallel, context: int) -> float | None:
        p = self.points.get((stage, str(par), self.bucket_of(context)))
        return p.tokens_per_s if p is not None else None

    def memory_scale(self, stage: Stage) -> float:
        """How much more than predicted the worst measured point of `stage` used (>= 1: the
        policy only ever corrects towards safety)."""
        ratios = [p.measured_bytes / p.predicted_bytes for (s, _, _), p in self.points.items()
                  if s == stage and p.predicted_bytes > 0]
        return max([1.0, *ratios])

    def memory_slack(self, stage: Stage) -> float:
        """An offline point measures a step's growth, not a device's total: no slack."""
        return 0.0

    def efficiency(self, stage: Stage, par: Parallel | None = None,
                   context: int | None = None) -> float:
        """Profiled points are exact: unprofiled layouts keep the roofline (1.0)."""
        return 1.0

    def step_tokens(self) -> float | None:
        """An offline profile runs no steps: switches are left to hysteresis."""
        return None

    def switch_seconds(self) -> float | None:
        return None


class Profiler:
    """Measures points with real steps and keeps them in `table`.

    Args:
        cost: the cost model whose predictions are printed beside each point.
        buckets: context buckets (tokens).
        device: "cpu" or "cuda".
        repeats: measured runs per point after one warm-up; the best time and the largest
            peak are kept.
        log: where each point's line goes (default: print).
    """

    def __init__(self, cost: CostModel, buckets: tuple[int, ...], *, device: str = "cpu",
                 repeats: int = 2, log: Callable[[str], None] = print) -> None:
        self.cost = cost
        self.table = ProfileTable(buckets)
        self.meter = PeakMeter(device)
        self.repeats = repeats
        self.log = log

    def predicted(self, stage: Stage, par: Parallel, context: int, seqs: int) -> float:
        """Bytes the step adds on top of resident weights (activations, gradients, KV)."""
        m = self.cost.memory(stage, par, seq_len=context, micro_batch_tokens=context * seqs,
                             kv_tokens=context * seqs)
        return m.total - m.weights - m.optimizer - m.reserve

    def profile(self, stage: Stage, par: Parallel, bucket: int, fn: StepFn, *,
                micro_batch_seqs: int = 1) -> ProfilePoint:
        """Measure one point (one warm-up, then `repeats` runs) and log it."""
        fn(bucket, micro_batch_seqs)
        best_t, peak, tokens = float("inf"), 0, 0
        for _ in range(self.repeats):
            tokens, dt, used = self.meter.measure(lambda: fn(bucket, micro_batch_seqs))
            best_t, peak = min(best_t, dt), max(peak, used)
        point = ProfilePoint(stage=stage, layout=str(par), bucket=bucket,
                             micro_batch_seqs=micro_batch_seqs, tokens_per_s=tokens / best_t,
                             measured_bytes=peak,
                             predicted_bytes=self.predicted(stage, par, bucket, micro_batch_seqs))
        self.table.add(point)
        self.log(point.line())
        return point

    def ensure(self, stage: Stage, par: Parallel, context: int, fn: StepFn, *,
               micro_batch_seqs: int = 1) -> ProfilePoint | None:
        """Profile `context`'s bucket if this (stage, layout) has not measured it yet; the
        new point, or None when it was known."""
        bucket = self.table.bucket_of(context)
        if (stage, str(par), bucket) in self.table.points:
            return None
        return self.profile(stage, par, bucket, fn, micro_batch_seqs=micro_batch_seqs)


@dataclass(slots=True)
class _Rate:
    """A measured rate and its roofline at the same point: decayed sums of tokens and of
    seconds, so the rate is their ratio (a step credited with too little time, e.g. a rollout
    batch whose play overlapped the previous one's, cannot swing it)."""

    tokens: float
    seconds: float
    roofline: float
    steps: int = 1

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


@dataclass(slots=True)
class RunProfile:
    """Measured tokens/s and memory per (stage, layout, context bucket) of a live run.

    Tokens are trajectory tokens (prompt and generated) for every stage, so a rollout's rate
    and a trainer's compare as time per step. Implements `policy.Measured`.

    Args:
        cost: the cost model whose roofline and memory the measurements calibrate.
        smoothing: how much of a point's past its sums of tokens and seconds lose at each
            new step (a moving average of the rate, weighted by the steps' seconds).
        bucket_base: smallest context bucket; buckets are half-octaves from it.
    """

    cost: CostModel
    smoothing: float = 0.5
    bucket_base: int = 64
    rates: dict[tuple[Stage, str, int], _Rate] = field(default_factory=dict)
    memory: dict[Stage, float] = field(default_factory=dict)  # worst measured / predicted
    slack: dict[Stage, float] = field(default_factory=dict)  # least predicted - measured bytes
    train_tokens: list[int] = field(default_factory=list)  # per training step, the last ones
    switches: list[float] = field(default_factory=list)  # seconds of each layout change
    # per (stage, layout): the largest longest-sequence and micro-batch (or KV) tokens it ran
    high_water: dict[tuple[Stage, str], tuple[int, int]] = field(default_factory=dict)

    def bucket_of(self, context: int) -> int:
        """The smallest half-octave bucket (base x 1, 1.5, 2, 3, 4, ...) >= `context`."""
        b = self.bucket_base
        while True:
            for v in (b, b * 3 // 2):
                if v >= context:
                    return v
            b *= 2

    def record(self, stage: Stage, par: Parallel, context: int, *, tokens: int,
               seconds: float, batch_tokens: int, peak_bytes: float | None = None,
               whole_device: bool = False) -> None:
        """One step of `stage` in layout `par`: `tokens` in `seconds`, its longest sequence
        `context`, `batch_tokens` per micro-batch (train) or resident KV tokens (rollout);
        `peak_bytes`: the step's peak memory per device, if measured; `whole_device`: it is
        all the device held (a cgroup's charge), so it can also lower the prediction
        (`memory_slack`); a process's own figure (a CUDA allocator's peak) only raises it."""
        if tokens <= 0 or seconds <= 0 or context <= 0:
            return
        if stage == "train":
            self.train_tokens[:] = [*self.train_tokens[-7:], tokens]
        bucket = self.bucket_of(context)
        roof = self.cost.tokens_per_s(stage, par, bucket, batch_tokens=max(batch_tokens, 1))
        key = (stage, str(par), bucket)
        old = self.rates.get(key)
        if old is None:
            self.rates[key] = _Rate(tokens, seconds, roof)
        else:
            keep = 1 - self.smoothing
            self.rates[key] = _Rate(keep * old.tokens + tokens, keep * old.seconds + seconds,
                                    roof, old.steps + 1)
        # a peak is a process's high-water mark (its heap keeps what its largest step took):
        # it is compared with the prediction at the largest shape this layout ran, not this
        # step's (a short step after a long one read 1.34x its own prediction and shrank the
        # trainer's micro-batch by a third for the rest of a run)
        ctx0, bt0 = self.high_water.get((stage, str(par)), (0, 0))
        ctx_hw, bt_hw = max(ctx0, context), max(bt0, batch_tokens)
        self.high_water[(stage, str(par))] = (ctx_hw, bt_hw)
        if peak_bytes:
            kw = {"kv_tokens": bt_hw} if stage == "rollout" else {"micro_batch_tokens": bt_hw}
            predicted = self.cost.memory(stage, par, seq_len=ctx_hw, **kw).total
            self.memory[stage] = max(self.memory.get(stage, 0.0), peak_bytes / predicted)
            if whole_device:
                self.slack[stage] = min(self.slack.get(stage, predicted), predicted - peak_bytes)
            elif peak_bytes > predicted:  # under-predicted: no slack whatever the devices say
                self.slack[stage] = 0.0

    def efficiency(self, stage: Stage, par: Parallel | None = None,
                   context: int | None = None) -> float:
        """Measured / roofline tokens/s: the median over the points layout `par` ran at, so a
        layout measured slow at one context stays slow at the next (on CPU a TP-2 replica is
        slower than the roofline says: the gauntlet trained 8.8k tok/s with one TP-2 replica,
        17.6k with two TP-1); a layout not run yet: the median over the stage's points at
        `context`'s bucket, so it is priced against what the running layout measures there
        (the stage's median over all buckets priced a TP-2 replica 26% above the two TP-1
        replicas measured at that bucket; it ran 2.65x slower), else over all of them (1.0
        before any)."""
        def median(key: Callable[[str, int], bool]) -> float | None:
            ratios = sorted(r.tokens_per_s / r.roofline for (s, p, b), r in self.rates.items()
                            if s == stage and key(p, b) and r.roofline > 0)
            return ratios[len(ratios) // 2] if ratios else None

        own = median(lambda p, _: p == str(par)) if par is not None else None
        if own is None and context is not None:
            bucket = self.bucket_of(context)
            own = median(lambda _, b: b == bucket)
        return own if own is not None else median(lambda p, b: True) or 1.0

    def tokens_per_s(self, stage: Stage, par: Parallel, context: int) -> float | None:
        """The measured rate at this layout and bucket, or None (the policy then takes the
        roofline times `efficiency`)."""
        r = self.rates.get((stage, str(par), self.bucket_of(context)))
        return r.tokens_per_s if r is not None else None

    def memory_scale(self, stage: Stage) -> float:
        """The worst measured / predicted peak of `stage` (at least 1: only towards safety)."""
        return max(1.0, self.memory.get(stage, 1.0))

    def memory_slack(self, stage: Stage) -> float:
        """Bytes per device the cost model over-predicts `stage` by, at least: the smallest
        predicted - measured peak of its steps measured whole (`record`'s `whole_device`), 0
        once one step used more than predicted (then `memory_scale` corrects upwards) or before
        any was measured whole. The policy subtracts it from every prediction of the stage:
        the model counts what a process holds at rest (reserve, weights, optimizer) and its
        activations, and on CPU it over-counts both (the gauntlet's DP 2 trainer: 1,165 MiB
        predicted at 4,096 tokens, ~530 charged). Safe while the model does not under-count
        how memory grows with the context and the micro-batch, which the smallest slack of all
        steps (the tightest) bounds."""
        return max(0.0, self.slack.get(stage, 0.0))

    def record_switch(self, seconds: float) -> None:
        """A layout change took `seconds` (re-creations, moves; not a budget change)."""
        self.switches.append(seconds)

    def step_tokens(self) -> float | None:
        """Tokens per training step, the mean of the last 8 (None before one)."""
        return sum(self.train_tokens) / len(self.train_tokens) if self.train_tokens else None

    def switch_seconds(self) -> float | None:
        """The median layout change of this run (None before one)."""
        xs = sorted(self.switches)
        return xs[len(xs) // 2] if xs else None

    def record_row(self) -> dict[str, float]:
        """Metrics: per stage its efficiency, memory scale and slack ("selector/profile/...")."""
        out: dict[str, float] = {}
        for stage in sorted({s for s, _, _ in self.rates}):
            out[f"selector/profile/{stage}/efficiency"] = self.efficiency(stage)
            out[f"selector/profile/{stage}/memory_scale"] = self.memory_scale(stage)
            out[f"selector/profile/{stage}/memory_slack_mib"] = self.memory_slack(stage) / 2**20
        return out
