"""Cluster-scale simulation of the selector: `python bench/selector_simulate.py --json`.

Runs the same `SearchPolicy` and `CostModel` the runtime uses on a synthetic agentic-RL run whose
longest context grows from 4K to 32K tokens over the steps (geometric growth, 5% noise), for a
Llama-3.1-70B on 64 to 1,024 80 GB GPUs, colocated (every stage uses every GPU in turn, as in
EARL's and verl's hybrid engine). Against it: every static layout of every stage (the layout
fixed at step 0; its micro-batch budget re-derived each step, the static baseline's best case).
A static layout "OOMs" at the first step whose longest sequence does not fit it; the selector
pays for every switch (a fixed restart cost plus moving each device's training state at
`reshard_gbps`). Throughput is tokens per second of the whole step (rollout + reference +
train, each at the cost model's roofline tokens/s). It also prints the calibration against the
EARL paper's 97 GB @ 4K and 354 GB @ 8K (see `cost.paper_points`).

Not a measurement: a model of the policy's decisions at a scale this machine cannot run (the
measured comparison on this machine is `bench/selector.py`). Also `earl bench selector_simulate`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import _results
import numpy as np

from earl.runtime.selector.cost import GB, CostConfig, CostModel, ModelShape, Parallel, Stage
from earl.runtime.selector.plan import ContextTracker
from earl.runtime.selector.policy import PolicyConfig, SearchPolicy

PAPER_GB = {4096: 97.0, 8192: 354.0}


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One simulated run (see the module docstring for the model)."""

    gpus: int = 64
    gpu_memory_gb: float = 80.0
    reserve_gb: float = 4.0
    steps: int = 40
    ctx_start: int = 4096
    ctx_end: int = 32768
    seqs_per_gpu: int = 4
    noise: float = 0.05
    restart_s: float = 20.0
    reshard_gbps: float = 10.0
    seed: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StaticResult:
    stage: Stage
    layout: str
    oom_step: int | None
    seconds: float  # until the OOM step, if any
    tokens_per_s: float  # of this stage over the steps it ran


def workload(cfg: SimConfig) -> list[np.ndarray]:
    """Trajectory lengths per step: the max grows geometrically ctx_start -> ctx_end."""
    rng = np.random.default_rng(cfg.seed)
    n = cfg.seqs_per_gpu * cfg.gpus
    out = []
    for step in range(cfg.steps):
        frac = step / max(1, cfg.steps - 1)
        top = cfg.ctx_start * (cfg.ctx_end / cfg.ctx_start) ** frac
        top = int(min(cfg.ctx_end, top * (1 + cfg.noise * rng.uniform(-1, 1))))
        lengths = (top * rng.uniform(0.3, 1.0, size=n)).astype(np.int64)
        lengths[0] = top
        out.append(lengths)
    return out


def _cost(cfg: SimConfig) -> CostModel:
    return CostModel(ModelShape.llama31_70b(), CostConfig(
        attention="flash", sequence_parallel=True, reserve_bytes=cfg.reserve_gb * GB))


def _seconds(policy: SearchPolicy, actor: str, par: Parallel, ctx: int, tokens: int,
             cap: float) -> float | None:
    """Seconds for `actor` in `par` to process `tokens` whose longest sequence is `ctx`;
    None if one sequence does not fit (OOM)."""
    slots = tuple(f"g{i}" for i in range(par.devices))
    p = policy.evaluate(actor, par, slots, ctx, cap)
    if p is None:
        return None
    tps = policy.cost.tokens_per_s(p.stage, par, ctx, batch_tokens=p.micro_batch_tokens,
                                   step_tokens=tokens)
    return tokens / tps


def _first_step_seconds(policy: SearchPolicy, actors: dict[str, Stage], r: StaticResult, top: int,
                        tokens: int, cap: float) -> float | None:
    actor = next(a for a, s in actors.items() if s == r.stage)
    par = next(p for p in policy.layouts(r.stage, _devices(r.layout)) if str(p) == r.layout)
    return _seconds(policy, actor, par, top, tokens, cap)


def _devices(layout: str) -> int:
    """Devices of a layout string "tpA/ppB/dpC[/recompute]"."""
    n = 1
    for part in layout.split("/")[:3]:
        n *= int(part[2:])
    return n


def run(cfg: SimConfig) -> dict[str, object]:
    """Simulate one cluster size; returns the JSON row."""
    cost = _cost(cfg)
    cap = cfg.gpu_memory_gb * GB
    pcfg = PolicyConfig(colocated=True, lookahead_steps=2)
    policy = SearchPolicy(cost, pcfg)
    steps = workload(cfg)
    tokens = [int(x.sum()) for x in steps]
    tops = [int(x.max()) for x in steps]
    # every static layout of every stage
    statics: list[StaticResult] = []
    for actor, stage in pcfg.actors.items():
        for par in policy.layouts(stage, cfg.gpus):
            secs, oom, done = 0.0, None, 0
            for i, (top, tok) in enumerate(zip(tops, tokens, strict=True)):
                t = _seconds(policy, actor, par, top, tok, cap)
                if t is None:
                    oom = i
                    break
                secs, done = secs + t, done + tok
            statics.append(StaticResult(stage=stage, layout=str(par), oom_step=oom,
                                        seconds=secs, tokens_per_s=done / secs if secs else 0.0))
    start: dict[str, StaticResult] = {}  # what one would pick at step 0: fastest there
    first: dict[str, float] = {}
    for r in statics:
        t0 = _first_step_seconds(policy, pcfg.actors, r, tops[0], tokens[0], cap)
        if t0 is not None and t0 < first.get(r.stage, float("inf")):
            start[r.stage], first[r.stage] = r, t0
    best: dict[str, StaticResult] = {}
    for r in statics:
        if r.oom_step is None and (r.stage not in best or r.seconds < best[r.stage].seconds):
            best[r.stage] = r
    # the selector
    slots = {f"g{i}": cap for i in range(cfg.gpus)}
    tracker = ContextTracker()
    secs = reconfig = 0.0
    switches, selector_oom, prev = [], None, None
    stage_secs: dict[str, float] = dict.fromkeys(pcfg.actors.values(), 0.0)
    for i, lengths in enumerate(steps):
        stats = tracker.observe(lengths if i == 0 else steps[i - 1])  # decide on what is known
        d = policy.decide(step=i, when="rollout", contexts=stats, slots=slots)
        for a in d.plan.actors:
            t = _seconds(policy, a.actor, a.parallel, tops[i], tokens[i], cap)
            if t is None or not d.plan.feasible:
                selector_oom = i if selector_oom is None else selector_oom
                t = 0.0
            secs += t
            stage_secs[a.stage] += t
        if d.changed and prev is not None:
            switches.append(i)
            for a in d.plan.actors:
                if a.parallel != prev.actor(a.actor).parallel:
                    m = cost.memory(a.stage, a.parallel, seq_len=tops[i])
                    moved = m.weights + m.grads + m.optimizer
                    reconfig += cfg.restart_s + moved / (cfg.reshard_gbps * GB)
        prev = d.plan
    total_tokens = sum(tokens)
    sel_tps = total_tokens / (secs + reconfig)
    best_secs = sum(r.seconds for r in best.values())
    best_ok = len(best) == len(set(pcfg.actors.values()))
    return {
        "gpus": cfg.gpus, "steps": cfg.steps, "context": [cfg.ctx_start, cfg.ctx_end],
        "static_layouts": len(statics), "static_oom": sum(r.oom_step is not None for r in statics),
        "oom_static": any(r.oom_step is not None for r in statics),
        "oom_selector": selector_oom is not None, "selector_oom_step": selector_oom,
        "oom_avoided": sum(bool(r.oom_step) for r in statics),  # fit at step 0, OOM later
        "fastest_at_start": {s: {"layout": r.layout, "oom_step": r.oom_step}
                             for s, r in start.items()},
        "best_static": {s: r.layout for s, r in best.items()},
        "best_static_tokens_per_s": total_tokens / best_secs if best_ok else 0.0,
        "selector_tokens_per_s": sel_tps,
        "throughput_ratio_vs_best_static": sel_tps * best_secs / total_tokens if best_ok else 0.0,
        "reconfigurations": len(switches), "switch_steps": switches,
        "reconfig_seconds": reconfig, "run_seconds": secs + reconfig,
        "final_plan": [a.describe() for a in prev.actors] if prev else [],
        # per static layout: the selector's tokens/s for that stage (reconfiguration time not
        # included) over the static layout's, for the layouts that ran the whole run
        "static": [{**asdict(r), "selector_ratio": (r.seconds / stage_secs[r.stage]
                                                    if r.oom_step is None else None)}
                   for r in statics],
    }


def calibration() -> dict[str, dict[str, float]]:
    """The cost model at the paper's two points (training activations of one sequence per GPU
    in an 8-way TP group, eager attention, bf16, no SP, no recompute)."""
    model = CostModel(ModelShape.llama31_70b(), CostConfig(attention="eager"))
    out = {}
    for n, paper in PAPER_GB.items():
        got = model.activation_bytes(n, n, Parallel(tp=8)) / GB
        out[str(n)] = {"model_gb": round(got, 1), "paper_gb": paper,
                       "error": round(got / paper - 1, 3)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=40)
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    runs = [run(SimConfig(gpus=g, steps=args.steps)) for g in args.gpus]
    cal = calibration()
    if args.save:
        _results.save("selector_simulate", {"calibration": cal, "runs": runs}, quick=False,
                      begun=begun)
    if args.json:
        print(json.dumps({"calibration": cal, "runs": runs}))
        return 0
    for n, c in cal.items():
        print(f"paper @ {n}: model {c['model_gb']} GB vs {c['paper_gb']} GB ({c['error']:+.1%})")
    print("| GPUs | static layouts: OOM at once / later | fastest train layout at 4K | "
          "selector OOM | best static (hindsight) | selector | ratio | switches (s) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in runs:
        fast = r["fastest_at_start"]["train"]  # type: ignore[index]
        at_once = r["static_oom"] - r["oom_avoided"]  # type: ignore[operator]
        print(f"| {r['gpus']} | {r['static_layouts']}: {at_once} / {r['oom_avoided']} | "
              f"{fast['layout']}, OOM at step {fast['oom_step']} | "
              f"{'yes' if r['oom_selector'] else 'no'} | "
              f"{r['best_static_tokens_per_s']:,.0f} tok/s | {r['selector_tokens_per_s']:,.0f} "
              f"tok/s | {r['throughput_ratio_vs_best_static']:.2f} | {r['reconfigurations']} "
              f"({r['reconfig_seconds']:.0f}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
