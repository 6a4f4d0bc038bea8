"""Parallelism selector benchmark (issue 15): static configurations vs the selector, one run.

    python bench/selector.py --json [--quick]      # the growing-context comparison
    python bench/selector.py --profile [--json]    # profiler: predicted vs measured memory

The comparison trains the `connect4` recipe (the whole game in context) with the general loop
(`earl train`, one subprocess per configuration, the same seeds, steps and warm-started model)
with the trainer and the rollout each in a device slot of `--slot-mib` MiB (a cgroup v1 memory
limit: the kernel's OOM killer enforces it) and vLLM's own context limit (`max_model_len`) and KV
budget (`--kv-gb` in every run: the one the selector's plan picks for itself here, so no static
run is held back by a smaller KV cache). Configurations:

* `static_small`: sized for the first contexts (rollout window `--window`, micro-batch budget
  65,536 tokens): longer games no longer fit the window and are cut (it must truncate). This is
  also the "truncates to fit the initial configuration" run of the learning comparison.
* `static_fast`: window 2,048, budget 65,536 tokens: the whole batch in one micro-batch; the
  trainer's slot runs out of memory once the batch's tokens grow (the kernel kills it).
* `static_safe`: window 2,048, budget 2,048 tokens: always fits, more micro-batches.
* `selector`: configured as `static_small`, `--selector on`: its first plan, made before the
  rollout replica is spawned, is for the model's longest context (nothing is measured yet;
  growing later costs a vLLM start), so the replica starts with that window; before each
  training step it sets the trainer's budget to what the slot holds for the measured contexts.
* `selector_lean`: the same, but its first plan assumes contexts of `--window` tokens
  (`--selector.initial_context`): the replica starts small and is re-created, live, once the
  games outgrow it (the reconfiguration this run reports, by phase).
* `truncate`: `static_small`'s window at `static_safe`'s budget: it fits the memory by cutting
  contexts; its reward and final eval against the selector's are the learning comparison.

Prints one JSON object: `oom_static` (some static configuration OOMs or must truncate),
`oom_selector`, `throughput_ratio_vs_best_static` (trained tokens per second of loop time,
reconfigurations included, against the best static configuration that neither OOMs nor
truncates, chosen in hindsight), `reconfigurations`, `reconfig_seconds` (by phase),
`samples_lost` (played but never trained, plus the dock's losses), all of the `selector` run;
`lean`, the same keys of `selector_lean`; and per run its quality
(final greedy eval, train reward per step) and context statistics. Timings on a shared 2-core
machine are noisy; every number comes from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import _results

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


CONFIGS: dict[str, list[str]] = {
    "static_small": ["--placement.micro_batch_tokens=65536"],
    "static_fast": ["--placement.context_window=2048", "--placement.micro_batch_tokens=65536"],
    "static_safe": ["--placement.context_window=2048", "--placement.micro_batch_tokens=2048"],
    "selector": ["--placement.micro_batch_tokens=65536", "--selector.mode=on"],
    "selector_lean": ["--placement.micro_batch_tokens=65536", "--selector.mode=on",
                      "--selector.initial_context=WINDOW"],
    # the learning comparison: cuts contexts to the initial window, at a budget that fits
    "truncate": ["--placement.micro_batch_tokens=2048"],
}


# `earl train` as a child process, but printing the whole exception chain on failure (the CLI
# prints one line; an actor's "out of memory in slot ..." is the cause of the error it shows).
_CHILD = """
import asyncio, json, sys, traceback
from earl.config import load_config
from earl.run import run
cfg = load_config(None, sys.argv[1:])
try:
    res = asyncio.run(run(cfg, log=lambda line: print(line, file=sys.stderr, flush=True)))
except BaseException as exc:
    traceback.print_exception(exc)
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    sys.exit(1)
print(json.dumps(res.to_json()))
"""


def _earl(args: list[str], timeout: float) -> tuple[int, str, str]:
    import subprocess

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        p = subprocess.run([sys.executable, "-c", _CHILD,
                            *args],
                           text=True, capture_output=True, timeout=timeout, env=env,
                           check=False)
    except subprocess.TimeoutExpired:
        return 124, "", "timeout"
    return p.returncode, p.stdout, p.stderr


def _rows(out: str) -> tuple[list[dict[str, object]], list[dict[str, object]]]:
    from pathlib import Path

    path = Path(out) / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in rows if "reward" in r], [r for r in rows if "selector/when" in r]


def _context_cut(out: str, window: int, played: dict[int, int]) -> float:
    """Share of trajectories cut by the rollout window they were played with (`played`: batch
    -> window, from the selector's rollout decisions; else `window`): truncated within a turn
    and a board, 96 tokens, of it (a per-turn cap also sets `truncated`)."""
    from pathlib import Path

    from earl.stages.batch_types import batch_of

    path = Path(out) / "trajectories.jsonl"
    if not path.is_file():
        return 0.0
    ts = [json.loads(line) for line in path.read_text().splitlines()]
    cut = [t for t in ts if t["truncated"] and len(t["token_ids"])
           >= played.get(batch_of(str(t["sample_id"])), window) - 96]
    return len(cut) / max(len(ts), 1)


def _one(name: str, common: list[str], root: str, window: int, timeout: float
         ) -> dict[str, object]:
    out = f"{root}/{name}"
    extra = [a.replace("WINDOW", str(window)) for a in CONFIGS[name]]
    if not any(a.startswith("--placement.context_window") for a in extra):
        extra.append(f"--placement.context_window={window}")
    rc, stdout, stderr = _earl([*common, *extra, f"--output_dir={out}"], timeout)
    with open(f"{out}.log", "w") as f:  # the run's progress lines and errors, to look at
        f.write(stderr)
    last = stdout.strip().splitlines()[-1] if stdout.strip() else "{}"
    res = json.loads(last) if last.startswith("{") else {}
    steps, sel = _rows(out)
    error = str(res.get("error", "")).splitlines()[0] if rc and res.get("error") else ""
    step_s = sum(float(str(r["step_s"])) for r in steps)
    tokens = sum(float(str(r.get("train/tokens", 0))) for r in steps)
    played = sum(int(str(r["episodes"])) for r in steps)
    trained = sum(float(str(r.get("train/samples", 0))) for r in steps)
    final_window = int(str(sel[-1]["selector/applied_max_model_len"])) if sel else \
        (2048 if "--placement.context_window=2048" in extra else window)
    reconf_s = sum(float(str(r.get("selector/reconfig_s", 0.0))) for r in sel)
    reconf = {k.removeprefix("selector/reconfig/"): 0.0 for r in sel for k in r
              if k.startswith("selector/reconfig/")}
    for r in sel:
        for k in reconf:
            reconf[k] += float(str(r.get(f"selector/reconfig/{k}", 0.0)))
    peak = max((float(str(v)) for r in sel for k, v in r.items()
                if k.startswith("selector/slot/trainer") and k.endswith("peak_mib")), default=0.0)
    return {
        "exit_code": rc, "error": error, "oom": rc != 0 and "out of memory in slot" in stderr,
        "steps_done": len(steps), "context_cut_rate": round(_context_cut(out, final_window, {
            int(str(r["selector/step"])): int(str(r["selector/applied_max_model_len"]))
            for r in sel if r["selector/when"] == "rollout"}), 3),
        "ctx_max": max((int(str(r["ctx_max"])) for r in steps), default=0),
        "ctx_mean": [round(float(str(r["ctx_mean"]))) for r in steps],
        "reward": [round(float(str(r["reward"])), 3) for r in steps],
        "micro_batches": [int(float(str(r.get("train/micro_batches", 0)))) for r in steps],
        "loop_s": round(step_s, 2), "trained_tokens": int(tokens),
        "tokens_per_s": round(tokens / step_s, 1) if step_s else 0.0,
        "tokens_per_s_excluding_reconfig": round(tokens / (step_s - reconf_s), 1)
        if step_s > reconf_s else 0.0,
        "samples_lost": int(played - trained) + max(
            (int(str(r.get("selector/queue/lost", 0))) for r in sel), default=0),
        "final_eval": res.get("eval", {}), "reconfigurations": max(
            (int(str(r["selector/reconfigurations"])) for r in sel), default=0),
        "reconfig_seconds": {k: round(v, 2) for k, v in reconf.items()},
        "selector_decisions": len(sel), "trainer_slot_peak_mib": round(peak, 1),
        "final_window": final_window,
    }


def _versus(run: dict[str, object], best: dict[str, object] | None) -> dict[str, object]:
    """A selector run against the best static one: its ratios, reconfigurations, losses."""
    def ratio(key: str) -> float:
        return round(float(str(run[key])) / float(str(best["tokens_per_s"])), 3) \
            if best else float("nan")

    return {"throughput_ratio_vs_best_static": ratio("tokens_per_s"),
            "throughput_ratio_excluding_reconfig": ratio("tokens_per_s_excluding_reconfig"),
            "oom": bool(run["oom"]) or float(str(run["context_cut_rate"])) > 0,
            "reconfigurations": run["reconfigurations"],
            "reconfig_seconds": run["reconfig_seconds"], "samples_lost": run["samples_lost"]}


def compare(*, quick: bool, slot_mib: int, rollout_mib: int, window: int, root: str,
            kv_gb: float = 0.14) -> dict[str, object]:
    """Runs every configuration on the same warm-started model; returns the JSON object."""
    import time

    steps, batch = (3, 96) if quick else (8, 128)
    common = ["--recipe=connect4", "--seed=0", f"--steps={steps}", f"--batch_size={batch}",
              "--group_size=8", "--eval_games=16", "--eval_every=0", "--checkpoint_every=1000",
              "--placement.reference=0", f"--placement.slot_memory_mib={slot_mib}",
              f"--placement.rollout_slot_memory_mib={rollout_mib}", "--max_restarts=0",
              f"--placement.kv_cache_gb={kv_gb}", "--max_policy_lag=1"]
    t0 = time.perf_counter()
    prep = f"{root}/warm"
    rc, err = 0, ""
    if not os.path.isfile(f"{prep}/weights_start/config.json"):  # else: reuse (--out again)
        rc, _, err = _earl(["--recipe=connect4", "--steps=1", "--batch_size=8",
                            "--group_size=8", "--eval_games=2", "--eval_every=0",
                            "--placement.reference=0",
                            f"--warm_start.steps={20 if quick else 100}",
                            f"--output_dir={prep}"], 600)
    if rc:
        raise RuntimeError(f"warm start failed: {err.strip().splitlines()[-1:]}")
    common += [f"--model.path={prep}/weights_start", "--warm_start.steps=0"]
    runs = {name: _one(name, common, root, window, 900) for name in CONFIGS}
    statics = {k: v for k, v in runs.items() if k.startswith("static_")}
    clean = {k: v for k, v in statics.items()
             if not v["oom"] and v["exit_code"] == 0 and not v["context_cut_rate"]}
    best = max(clean, key=lambda k: float(str(clean[k]["tokens_per_s"])), default="")
    sel = runs["selector"]
    ratio = float(str(sel["tokens_per_s"])) / float(str(clean[best]["tokens_per_s"])) \
        if best else float("nan")
    return {
        "oom_static": any(bool(v["oom"]) or float(str(v["context_cut_rate"])) > 0
                          for v in statics.values()),
        "oom_selector": bool(sel["oom"]) or float(str(sel["context_cut_rate"])) > 0,
        "throughput_ratio_vs_best_static": round(ratio, 3), "best_static": best,
        "throughput_ratio_excluding_reconfig": round(
            float(str(sel["tokens_per_s_excluding_reconfig"]))
            / float(str(clean[best]["tokens_per_s"])), 3) if best else float("nan"),
        "reconfigurations": sel["reconfigurations"], "reconfig_seconds": sel["reconfig_seconds"],
        "samples_lost": sel["samples_lost"],
        "lean": _versus(runs["selector_lean"], clean[best] if best else None),
        "learning": {k: {"reward": runs[k]["reward"], "context_cut_rate":
                         runs[k]["context_cut_rate"]} for k in ("selector", "truncate")},
        "final_quality": {k: dict(v["final_eval"]).get("win_draw_rate") if isinstance(
            v["final_eval"], dict) else None for k, v in runs.items()},
        "runs": runs, "slot_mib": slot_mib, "rollout_slot_mib": rollout_mib, "window": window,
        "kv_cache_gb": kv_gb,
        "steps": steps,
        "batch_size": batch, "quick": quick, "wall_s": round(time.perf_counter() - t0, 1),
        "load_avg_1m": os.getloadavg()[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="only the profiler")
    ap.add_argument("--slot-mib", type=int, default=640, help="the trainer's slot (MiB)")
    ap.add_argument("--rollout-slot-mib", type=int, default=1200, help="the rollout's slot")
    ap.add_argument("--window", type=int, default=256, help="static_small's rollout window")
    ap.add_argument("--kv-gb", type=float, default=0.14,
                    help="each run's KV-cache budget per replica (the selector's plan sets its "
                         "own: 0.14 GB, 131,072 tokens of the tiny model, in a 1,200 MiB slot)")
    ap.add_argument("--out", default="", help="run folders (default: a temporary folder)")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    if not args.profile:
        import tempfile

        root = args.out or tempfile.mkdtemp(prefix="earl-bench-selector-")
        res = compare(quick=args.quick, slot_mib=args.slot_mib, rollout_mib=args.rollout_slot_mib,
                      window=args.window, root=root, kv_gb=args.kv_gb)
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
