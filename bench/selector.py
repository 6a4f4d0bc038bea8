"""Parallelism selector benchmark (issue 23): contexts that grow because the agent learns.

    python bench/selector.py --json [--quick] [--save]   # the static sweep vs the selector
    python bench/selector.py --profile [--json]         # profiler: predicted vs measured memory
    python bench/selector.py --from RESULT.json --json  # a saved invocation, summarized again
    python bench/selector.py --runs OUT/A.result.json ... --json  # saved runs, one summary
    python bench/selector.py --memory-bound --json --save  # where memory binds (issue 50):
                                                         # bench/_selector_memory_bench.py

Every run trains the `gauntlet` recipe (Tic-Tac-Toe games in one context until the first loss:
a better policy survives more games, so its contexts grow) with the general loop (`earl train`,
one subprocess per run) from the same warm-started model, the same seeds, batch and step budget.
The machine is cut into device slots (`--placement.devices`): a memory cgroup (the kernel's
OOM killer enforces it) and a CPU share each, at two device sizes taken from the machine:
`cores` devices and `2 x cores` devices, the run's memory (a quarter of MemAvailable, or
`--device-mib` x devices) split evenly between them. Nothing is sized so that one run fails.

* The static sweep: every (rollout replicas x TP, trainer DP, window, micro-batch budget) below
  that fills the devices (with `--selector off` every device holds a rank). A static run ends
  only by finishing its steps or by the OOM killer in one of its devices; a trajectory longer
  than its window is cut (`cut_rate`), never counted as an OOM.
* `selector`: the larger device size, `--selector on` from one replica and one trainer rank on
  two devices (the other two free). Its first plan assumes contexts of `--window` tokens and
  places the rollout before it starts; the window is pre-sized at the model's positions (vLLM's
  `max_model_len` costs nothing until the KV budget holds it), so no context is cut. It re-plans
  before each rollout and each training step (KV budget, micro-batch budget, trainer DP,
  rollout replicas x TP, the devices each holds).
* `truncate` (one of the sweep): the window fixed at `--window` from the start, two replicas and
  two trainer ranks: the baseline of the learning comparison (it cuts the long gauntlets).

Throughput is trained tokens per second of loop time (reconfigurations included). A context cut
at the model's own positions (`MAX_MODEL_LEN`: no layout or window holds more) counts against no
run; one cut by a shorter window does. Prints one JSON object: `static_runs`,
`best_static_hindsight` (the fastest static run that neither OOMed nor cut below the model's
positions), `step0_pick` (the fastest static run over its first tenth of steps: what a user
would pick), `throughput_ratio_vs_best_static`, `throughput_ratio_vs_step0_pick`,
`best_static_same_devices` and its ratio (the fastest clean static run on the selector's
devices), the same on the same work (`matched_*`: each static run's seconds for the selector
run's tokens at its own measured rate per context bucket, over the selector's seconds;
`matched_seconds`), `context_growth` (the selector run's p95 trajectory tokens over its last
tenth of steps / first tenth),
`reconfigurations`, `trainer_layout_changes`, `rollout_layout_changes`, `device_moves`,
`reconfig_seconds_median`, `samples_lost`, `oom_selector` (the selector run killed by the OOM
killer in a device), `selector_outcome`, `selector_cut_rate` (all its cuts) and
`selector_cut_rate_below_model` (those by a window it chose), `final_eval` (selector and truncate,
`--eval` gauntlets each), `goals`. `--quick` gives the same keys on a shorter run.

Each run's record (`static_runs`, `selector_run`) has `slot_cpu`, where the cost model's rate
and the measured one part: per slot (`device<i>`; a joined slot under its own name,
`device<i>_device<j>`, its parts without its rank's time) the CPU seconds its processes used
(`cpu_s`, the whole child's life: start-up and evals too, not only `loop_s`) and, where slots
share cores (a CPU share, a CFS quota), the seconds the quota throttled it (`throttled_s`) and
in how many 100 ms periods (`nr_throttled`; both None without a share). It is sampled each
second while the child runs (`_selector_runs.SlotCpuSampler`): `{}` without writable cgroups.

With `--out DIR` an invocation can be resumed: each finished run is kept in DIR with the code
it ran (`code`: the git blobs of the packages, the bench and pyproject.toml, from a clean tree;
a static run's leaves out `SELECTOR_ONLY`, the modules only the selector runs),
the warm start's weights (their SHA-256) and the arguments, and a later invocation with the same
DIR, code, weights and arguments reads it back instead of running it again (`resumed_runs`; each
run records its commit, when it started, the load average then and `machine_speed`: matmul
GFLOP/s and copy GB/s). A run measured on a machine more than `SPEED_TOLERANCE` (10%) faster or
slower than this one is run again: a baseline is timed on the selector's machine (one of these
2-core machines ran the same static run at 1.3-1.7x the time of another). The warm start and the
device sizes (`machine.json`) are reused the same way. A commit that changes only results or
docs keeps the code, so a sweep longer than a session goes on where it stopped:
`bench/results/selector_runs/` keeps what the README's figures came from (its .gitignore keeps
the result files, the device sizes and the warm start, not the runs' logs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import _results
from _selector_runs import (
    SELECTOR_ONLY,
    Config,
    code_key,
    cut_below_model,
    device_sizes,
    machine_speed,
    matched_seconds,
    run_earl,
    run_or_read_back,
    sha256_16,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

def _profile(buckets: tuple[int, ...], quiet: bool) -> list[dict[str, object]]:
    import torch
    from transformers import AutoModelForCausalLM

    from earl.models.tiny import TinyConfig, default_model_dir
    from earl.runtime.selector.cost import CostConfig, CostModel, ModelShape, Parallel
    from earl.runtime.selector.profile import Profiler

    torch.set_num_threads(1)
    tc = TinyConfig()
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                 attn_implementation="sdpa").train()
    shape = ModelShape(hidden=tc.hidden, layers=tc.layers, heads=tc.heads, kv_heads=tc.kv_heads,
                       intermediate=tc.intermediate, vocab=tc.vocab_size,
                       params=sum(p.numel() for p in model.parameters()))
    # fp32 CPU model, SDPA (no stored score matrix), fp32 logits + log-softmax
    cost = CostModel(shape, CostConfig(weight_bytes=4, grad_bytes=4, act_bytes=4,
                                       attention="flash", logit_bytes=8))

    def _train_step(context: int, seqs: int) -> int:
        ids = torch.randint(0, tc.vocab_size, (seqs, context))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return ids.numel()

    def _ref_step(context: int, seqs: int) -> int:
        with torch.no_grad():
            ids = torch.randint(0, tc.vocab_size, (seqs, context))
            model(input_ids=ids)
        return ids.numel()

    prof = Profiler(cost, buckets, log=(lambda _: None) if quiet else print)
    for b in buckets:
        prof.profile("train", Parallel(), b, _train_step)
        prof.profile("reference", Parallel(), b, _ref_step)
    return [{"stage": p.stage, "bucket": p.bucket, "tokens_per_s": round(p.tokens_per_s),
             "predicted_mib": round(p.predicted_bytes / 2**20, 1),
             "measured_mib": round(p.measured_bytes / 2**20, 1), "error": round(p.error, 3)}
            for p in prof.table.points.values()]


def sweep(cores: int, window: int, top: int) -> tuple[list[Config], Config, Config]:
    """(static configurations at `cores` and `2 x cores` devices, the selector's, the truncating
    baseline's). `top`: the model's positions (the longest window)."""
    small, big = cores, 2 * cores
    statics = [Config(small, 1, 1, small - 1, w, b) for w in (window, top)
               for b in (8192, 65536)]
    statics += [Config(big, 2, 1, 2, top, 65536), Config(big, 2, 1, 2, top, 8192),
                Config(big, 1, 2, 2, top, 65536), Config(big, 3, 1, 1, top, 65536),
                Config(big, 2, 1, 2, window, 65536)]
    selector = Config(big, 1, 1, 1, top, 65536, selector=True, first_context=window)
    return statics, selector, statics[-1]


def compare(*, quick: bool, root: str, window: int, device_mib: int = 0, steps: int = 0,
            eval_games: int = 0, only: tuple[str, ...] = (), kv_gb: float = 0.14
            ) -> dict[str, object]:
    """Runs the sweep, the selector and the truncating baseline; returns the JSON object."""
    import time

    from earl.recipes.gauntlet import MAX_MODEL_LEN

    cores = len(os.sched_getaffinity(0))
    # 400 steps left runs of every layout at 2.4-5.2x (10 of 17 static runs at window 4,096 reached
    # 4x, 6 of 16 selector runs): the p95 still rose 200-500 tokens per 40 steps at the end
    steps = steps or (30 if quick else 500)
    eval_games = eval_games or (32 if quick else 100)
    sizes = device_sizes(root, device_mib, cores)
    statics, sel_cfg, trunc_cfg = sweep(cores, window, MAX_MODEL_LEN)
    common = ["--recipe=gauntlet", "--seed=0", f"--steps={steps}", "--time_limit_minutes=600",
              "--eval_every=0", "--checkpoint_every=100000", "--max_restarts=0",
              f"--placement.kv_cache_gb={kv_gb}"]
    t0 = time.perf_counter()
    prep = f"{root}/warm"
    if not os.path.isfile(f"{prep}/weights_start/config.json"):  # else: reuse (--out again)
        rc, _, err = run_earl(["--recipe=gauntlet", "--steps=1", "--eval_games=2", "--eval_every=0",
                            f"--output_dir={prep}"], 900)
        if rc:
            raise RuntimeError(f"warm start failed: {err.strip().splitlines()[-1:]}")
    common += [f"--model.path={prep}/weights_start", "--warm_start.steps=0"]
    weights = sha256_16(f"{prep}/weights_start/model.safetensors")
    runs: dict[str, dict[str, object]] = {}
    code, static_code = code_key(), code_key(SELECTOR_ONLY)
    speed = machine_speed()
    resumed = []
    # the selector and the baseline first: an invocation cut short (and resumed) has them
    for cfg in [sel_cfg, trunc_cfg, *(c for c in statics if c != trunc_cfg)]:
        if only and not any(o in cfg.name for o in only) and cfg not in (sel_cfg, trunc_cfg):
            continue
        full_eval = cfg in (sel_cfg, trunc_cfg)
        args = [*common, *cfg.args(sizes[cfg.devices]),
                f"--eval_games={eval_games if full_eval else 8}"]
        key = code if cfg.selector else static_code
        runs[cfg.name], again = run_or_read_back(cfg, args, root, key and f"{key}/{weights}",
                                         60.0 * (20 + steps / 4), sizes[cfg.devices], speed)
        if again:
            resumed.append(cfg.name)
    static_runs = {k: v for k, v in runs.items() if k != sel_cfg.name}
    return {
        **summarize(static_runs, runs[sel_cfg.name], trunc_cfg.name),
        "device_mib": {str(k): v for k, v in sizes.items()}, "cores": cores, "steps": steps,
        "window": window, "kv_cache_gb": kv_gb, "eval_games": eval_games, "quick": quick,
        "wall_s": round(time.perf_counter() - t0, 1), "load_avg_1m": os.getloadavg()[0],
        "resumed_runs": resumed, "machine_speed": speed,
        "resumed_speed_unchecked": [k for k in resumed if "machine_speed" not in runs[k]],
    }


def summarize(static_runs: dict[str, dict[str, object]], sel: dict[str, object],
              truncate: str) -> dict[str, object]:
    """The comparison of the selector run `sel` with the static runs (`truncate`: the
    truncating baseline's name) and its goals: a pure function of the runs' records, so a
    saved invocation can be summarized again (`--from`)."""
    from earl.recipes.gauntlet import MAX_MODEL_LEN

    trunc = static_runs.get(truncate)  # absent from a --runs set without it
    # clean: finished, no context cut by a window shorter than the model's positions (a cut at
    # the model's own positions, which no layout or window avoids, counts for no run)
    clean = {k: v for k, v in static_runs.items()
             if v["outcome"] == "finished" and not cut_below_model(v, MAX_MODEL_LEN)}
    best = max(clean, key=lambda k: float(str(clean[k]["tokens_per_s"])), default="")
    # the same hardware as the selector's: its device count and size (the other size is a
    # machine cut into fewer, larger devices, each with more CPU)
    same = max((k for k in clean if clean[k]["devices"] == sel["devices"]),
               key=lambda k: float(str(clean[k]["tokens_per_s"])), default="")
    pick = max(static_runs, key=lambda k: float(str(static_runs[k]["tokens_per_s_first_tenth"])))

    def ratio(other: str) -> float | None:
        base = float(str(static_runs[other]["tokens_per_s"])) if other else 0.0
        return round(float(str(sel["tokens_per_s"])) / base, 3) if base else None

    work = sel["by_context"]  # type: ignore[assignment]
    for run in static_runs.values():
        secs, cover = matched_seconds(run, work)  # type: ignore[arg-type]
        run["matched_seconds"] = None if secs is None else round(secs, 1)
        run["matched_coverage"] = round(cover, 3)
    timed = {k: v for k, v in clean.items() if v["matched_seconds"] is not None}
    best_matched = min(timed, key=lambda k: float(str(timed[k]["matched_seconds"])), default="")
    same_matched = min((k for k in timed if timed[k]["devices"] == sel["devices"]),
                       key=lambda k: float(str(timed[k]["matched_seconds"])), default="")

    def matched(other: str) -> float | None:
        secs = static_runs[other]["matched_seconds"] if other else None
        return round(float(str(secs)) / float(str(sel["loop_s"])), 3) \
            if secs is not None and sel["loop_s"] else None

    oom_selector = sel["outcome"] == "oom"
    sel_cut = cut_below_model(sel, MAX_MODEL_LEN)
    reconf = [float(x) for x in sel["reconfig_seconds"]]  # type: ignore[attr-defined]
    res: dict[str, object] = {
        "static_runs": static_runs, "selector_run": sel,
        "best_static_hindsight": best, "step0_pick": pick,
        "step0_pick_outcome": static_runs[pick]["outcome"],
        "throughput_ratio_vs_best_static": ratio(best),
        "throughput_ratio_vs_step0_pick": ratio(pick),
        "best_static_same_devices": same,
        "throughput_ratio_vs_best_static_same_devices": ratio(same),
        "best_static_matched": best_matched,
        "matched_ratio_vs_best_static": matched(best_matched),
        "matched_ratio_vs_step0_pick": matched(pick),
        "best_static_matched_same_devices": same_matched,
        "matched_ratio_vs_best_static_same_devices": matched(same_matched),
        "context_growth": sel["context_growth"],
        "reconfigurations": sel["reconfigurations"],
        "trainer_layout_changes": sel["trainer_layout_changes"],
        "rollout_layout_changes": sel["rollout_layout_changes"],
        "device_moves": sel["device_moves"],
        "reconfig_seconds_median": round(statistics.median(reconf), 2) if reconf else None,
        "samples_lost": sel["samples_lost"], "oom_selector": oom_selector,
        "selector_outcome": sel["outcome"], "selector_cut_rate": sel["cut_rate"],
        "selector_cut_rate_below_model": sel_cut,
        "final_eval": {"selector": sel["final_eval"],
                       "truncate": trunc["final_eval"] if trunc else None},
        "truncate": truncate if trunc else "",
        "learning": {k: {"reward_first_tenth": r["reward_first_tenth"],
                         "reward_last_tenth": r["reward_last_tenth"], "cut_rate": r["cut_rate"]}
                     for k, r in (("selector", sel), ("truncate", trunc)) if r},
    }
    r_best, r_pick = res["throughput_ratio_vs_best_static"], res["throughput_ratio_vs_step0_pick"]
    res["goals"] = {
        "throughput_ratio_vs_best_static>=1.1": r_best is not None and float(r_best) >= 1.1,
        "throughput_ratio_vs_step0_pick>=1.5_or_pick_ooms": res["step0_pick_outcome"] == "oom"
        or (r_pick is not None and float(r_pick) >= 1.5),
        "matched_ratio_vs_best_static>=1.1": (m := res["matched_ratio_vs_best_static"])
        is not None and float(m) >= 1.1,
        "matched_ratio_vs_step0_pick>=1.5_or_pick_ooms": res["step0_pick_outcome"] == "oom"
        or ((m := res["matched_ratio_vs_step0_pick"]) is not None and float(m) >= 1.5),
        "context_growth>=4": float(str(sel["context_growth"])) >= 4,
        "trainer_layout_changes>=1": int(str(sel["trainer_layout_changes"])) >= 1,
        "device_moves>=1": int(str(sel["device_moves"])) >= 1,
        "reconfig_seconds_median<=3": bool(reconf) and statistics.median(reconf) <= 3,
        "samples_lost==0": sel["samples_lost"] == 0, "oom_selector==false": not oom_selector,
        "selector_outcome==finished": sel["outcome"] == "finished",
        "selector_cut_rate_below_model==0": sel_cut == 0,
    }
    return res


def summarize_records(paths: list[str], window: int) -> dict[str, object]:
    """`--runs`: one selector run and static runs from their saved records, summarized."""
    from earl.recipes.gauntlet import MAX_MODEL_LEN

    runs = []
    for path in paths:
        with open(path) as f:
            rec = json.load(f)
        runs.append(rec.get("run", rec))
    sels = [r for r in runs if str(r["config"]).startswith("selector/")]
    if len(sels) != 1:
        raise SystemExit(f"selector --runs: needs one selector run record, got {len(sels)}")
    statics = {str(r["config"]): r for r in runs if r is not sels[0]}
    _, _, trunc_cfg = sweep(len(os.sched_getaffinity(0)), window, MAX_MODEL_LEN)
    return {**summarize(statics, sels[0], trunc_cfg.name),
            "steps": sels[0]["steps"], "cores": len(os.sched_getaffinity(0)),
            "window": window, "quick": False, "summarized_from": paths,
            "runs_started": {str(r["config"]): r.get("started") for r in runs}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only the profiler")
    ap.add_argument("--window", type=int, default=1024,
                    help="the truncating baseline's window, and the context the selector's "
                         "first plan assumes")
    ap.add_argument("--device-mib", type=int, default=0,
                    help="memory per device (0: a quarter of MemAvailable over the devices)")
    ap.add_argument("--steps", type=int, default=0, help="step budget (0: 500, --quick 30; --memory-bound --quick: 100)")
    ap.add_argument("--eval", type=int, default=0,
                    help="final eval gauntlets of the selector and truncate runs (0: 100, "
                         "--quick 32)")
    ap.add_argument("--only", default="", help="comma-separated parts of static run names to "
                    "run (the selector and the truncating baseline always run)")
    ap.add_argument("--kv-gb", type=float, default=0.14, help="KV-cache budget per replica")
    ap.add_argument("--out", default="", help="run folders (default: a temporary folder)")
    ap.add_argument("--from", dest="saved", default="",
                    help="a saved result (bench/results/selector-DATE.json): summarize its "
                         "runs again with this checkout's definitions; runs nothing")
    ap.add_argument("--runs", nargs="*", default=None, metavar="RECORD",
                    help="saved run records (OUT/NAME.result.json): one selector run and the "
                         "static runs to compare it with (say, re-run on the selector's "
                         "machine), summarized as one invocation; runs nothing")
    ap.add_argument("--memory-bound", action="store_true",
                    help="the mode where memory binds (issue 50): devices sized by a rule so "
                         "the step-0 pick OOMs, against restart, conservative, truncating and "
                         "pinned arms (bench/_selector_memory_bench.py)")
    ap.add_argument("--replicates", type=int, default=0,
                    help="--memory-bound: replicates per arm (0: 3, --quick 1)")
    ap.add_argument("--quality", type=float, default=0.0,
                    help="--memory-bound: the games_survived threshold of time to quality "
                         "(0: 6.0, --quick 2.5)")
    ap.add_argument("--oom-fraction", type=float, default=0.0,
                    help="--memory-bound: where between the pick's start and its budget (in "
                         "log tokens) the devices cap it (0: 0.75, --quick 0.2)")
    ap.add_argument("--eval-every", type=int, default=0,
                    help="--memory-bound: steps between evals and checkpoints (0: 50, --quick 25)")
    ap.add_argument("--arms", default="", help="--memory-bound: comma-separated arms to run "
                    "(default: all)")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    if args.memory_bound:
        import tempfile

        from _selector_memory import ARMS
        from _selector_memory_bench import run_memory_bound

        root = args.out or tempfile.mkdtemp(prefix="earl-bench-selector-memory-")
        res = run_memory_bound(
            quick=args.quick, root=root, replicates=args.replicates or (1 if args.quick else 3),
            steps=args.steps, eval_every=args.eval_every, eval_games=args.eval or 64,
            threshold=args.quality, fraction=args.oom_fraction, kv_gb=args.kv_gb,
            arms=tuple(a for a in args.arms.split(",") if a) or ARMS)
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        if args.save:
            _results.save("selector_memory", res, quick=args.quick, begun=begun)
        return 0
    if args.runs:
        res = summarize_records(args.runs, args.window)
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        if args.save:
            _results.save("selector", res, quick=False, begun=begun)
        return 0
    if args.saved:
        with open(args.saved) as f:
            saved = json.load(f)
        old = saved.get("result", saved)
        res = {**old, **summarize(old["static_runs"], old["selector_run"], old["truncate"]),
               "summarized_from": args.saved}
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        return 0
    if not args.profile:
        import tempfile

        root = args.out or tempfile.mkdtemp(prefix="earl-bench-selector-")
        res = compare(quick=args.quick, root=root, window=args.window,
                      device_mib=args.device_mib, steps=args.steps, eval_games=args.eval,
                      only=tuple(o for o in args.only.split(",") if o), kv_gb=args.kv_gb)
        print(json.dumps(res) if args.json else json.dumps(res, indent=1))
        if args.save:
            _results.save("selector", res, quick=args.quick, begun=begun)
        return 0
    buckets = (256, 512, 1024) if args.quick else (256, 512, 1024, 2048, 4096)
    points = _profile(buckets, quiet=args.json)
    errors = [abs(float(str(p["error"]))) for p in points]
    out = {"points": points, "max_abs_error": max(errors)}
    if args.json:
        print(json.dumps(out))
    if args.save:
        _results.save("selector_profile", out, quick=args.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
