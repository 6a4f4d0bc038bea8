"""`bench/selector.py --memory-bound`: the selector where memory binds, against what a user
would do (issue 50, parts 1-3).

    python bench/selector.py --memory-bound --json --save [--replicates 3] [--out DIR]
    python bench/selector.py --memory-bound --quick --json      # the same keys, a short run

1. The devices are sized by a rule (`_selector_memory.size_devices`, printed as `sizing.rule`)
   from a pilot of the step-0 pick with no memory limit (its first `pilot_steps` steps: each
   step's trained tokens and the trainer's peak, and the slots' cgroup peaks) and the cost
   model's activation bytes per token, so that the step-0 pick (2 devices, one rollout replica
   and one trainer rank, the model's whole window, a 64k-token micro-batch budget, no
   recomputation: the fastest layout at every context bucket in the saved sweeps,
   `bench/results/selector_bound-2026-11-28-7.json`) fits its start and is killed by the
   kernel once its steps pass `T_cap` tokens. `sizing.predicted_oom_*` beside the measured
   `oom_at` of the `restart_pick` arm (its first segment is the pick).
2. The arms, each from the same warm start, per replicate the same seed:
   `selector` (`--selector on`, from the pick's layout); `restart_pick` (the pick; on an OOM
   it resumes from the last checkpoint with half the micro-batch budget,
   `_selector_memory.next_budget`: the steps since that checkpoint and the restart count on
   its clock); `conservative` (the largest halving of the budget whose full micro-batch fits
   a device: it holds the longest context from step 0); `truncate` (the pick with its window
   cut to what fits, `truncate_window`); `pinned` (the selector held to its first plan,
   `_selector_memory_pinned`) and `pinned_static` (a static run of that plan, without the
   selector: `pinned_overhead` compares the two). The clairvoyant ceiling
   (`oracle_fraction_same_devices`) prices the selector's work at the fastest rate
   `restart_pick` or `conservative` measured in each context bucket on the same devices.
3. Every arm is evaluated every `eval_every` steps on one fixed set of `eval_games` gauntlets
   (`--eval_tasks`: the same seeds for every eval of every arm), on the arm's own clock, which
   runs across its restarts. Per arm (median, min, max over `--replicates`): wall seconds for
   the steps, to the quality threshold, final quality, OOMs, steps lost.

`--out DIR` keeps each arm's record; a later invocation with the same DIR, code (a clean tree)
and arguments reads it back instead of running it again.
"""

from __future__ import annotations

import json
import os
import time

import _selector_memory as rules
from _selector_memory_runs import arm_record, run_arm, spawn
from _selector_runs import Config, code_key, run_earl, sha256_16

PICK_BUDGET = 65536  # the step-0 pick's micro-batch budget (tokens)
MARGIN = 0.1  # what the conservative and truncating layouts leave free of a device
PINNED = "_selector_memory_pinned.py:pinned"


def _settings(quick: bool, steps: int, eval_every: int, threshold: float, fraction: float
              ) -> dict[str, float]:
    # 500 steps: the sweeps' contexts grow 2.4-5.2x by 400 (bench/selector.py) and the pick's
    # steps fill its 64k budget in their second half, so a long run caps it at 0.75 of the way
    # (in log tokens) from its start to its budget. Its steps pass 31-35k tokens within 20-40
    # steps of this warm start and a 12-step pilot's largest is 17-31k: a short run caps it at
    # 0.2 (at 0.3 and 60 steps one of two smoke runs was never killed)
    return {"steps": steps or (100 if quick else 500),
            "eval_every": eval_every or (25 if quick else 50),
            "threshold": threshold or (2.5 if quick else 6.0),
            "fraction": fraction or (0.2 if quick else 0.75),
            "pilot_steps": 12}


def _eval_file(root: str, n: int) -> str:
    """The fixed eval set: `n` gauntlet seeds (the recipe's "start"/"final" seeds)."""
    from earl.recipes.gauntlet import EVAL_SEED

    path = f"{root}/eval_set.jsonl"
    with open(path, "w") as f:
        f.writelines(f"{EVAL_SEED + i}\n" for i in range(n))
    return path


def _cost_kib_per_token(model_dir: str, context: int) -> float:
    """The cost model's stored activations per trained token (fp32, SDPA, as
    `bench/selector.py --profile` prices the tiny model), in KiB."""
    from earl.runtime.selector.cost import CostConfig, CostModel, ModelShape, Parallel

    with open(f"{model_dir}/config.json") as f:
        shape = ModelShape.from_hf_config(json.load(f))
    cost = CostModel(shape, CostConfig(weight_bytes=4, grad_bytes=4, act_bytes=4,
                                       attention="flash", logit_bytes=8))
    t = 16 * max(context, 64)
    return cost.activation_bytes(t, max(context, 64), Parallel()) / t / 1024


def run_memory_bound(*, quick: bool, root: str, replicates: int, steps: int = 0,
                     eval_every: int = 0, eval_games: int = 64, threshold: float = 0.0,
                     fraction: float = 0.0, kv_gb: float = 0.14,
                     arms: tuple[str, ...] = rules.ARMS) -> dict[str, object]:
    """Runs the pilot, sizes the devices, runs every arm `replicates` times; returns the
    JSON object (`_selector_memory.summarize`'s keys, `sizing`, the arms' records)."""
    from earl.recipes.gauntlet import MAX_MODEL_LEN

    t0 = time.time()
    s = _settings(quick, steps, eval_every, threshold, fraction)
    n_steps, every = int(s["steps"]), int(s["eval_every"])
    os.makedirs(root, exist_ok=True)
    warm = f"{root}/warm"
    if not os.path.isfile(f"{warm}/weights_start/config.json"):
        rc, _, err = run_earl(["--recipe=gauntlet", "--steps=1", "--eval_games=2",
                               "--eval_every=0", f"--output_dir={warm}"], 900)
        if rc:
            raise RuntimeError(f"warm start failed: {err.strip().splitlines()[-1:]}")
    model = f"{warm}/weights_start"
    # every group dumped: at a kill, the contexts being trained are read from the dump
    base = ["--recipe=gauntlet", "--time_limit_minutes=600", "--max_restarts=0", "--dump_share=1",
            f"--placement.kv_cache_gb={kv_gb}", f"--model.path={model}", "--warm_start.steps=0"]
    cores = len(os.sched_getaffinity(0))
    pick = Config(cores, 1, 1, cores - 1, MAX_MODEL_LEN, PICK_BUDGET)

    # 1. the pilot: the pick with room to spare (a quarter of MemAvailable per device)
    with open("/proc/meminfo") as f:
        avail = next(int(x.split()[1]) // 1024 for x in f if x.startswith("MemAvailable:"))
    pilot_out = f"{root}/pilot"
    pilot_path = f"{root}/pilot.json"
    if os.path.isfile(pilot_path):
        with open(pilot_path) as f:
            pilot = json.load(f)
    else:
        seg = spawn([*base, "--seed=0", f"--steps={int(s['pilot_steps'])}", "--eval_every=0",
                     "--eval_games=2", "--checkpoint_every=100000",
                     *pick.args(min(avail // 4 // cores, 4096))], pilot_out, resume=False,
                    timeout=1800, clock0=time.time())
        if seg["rc"] != 0:
            raise RuntimeError(f"the pilot failed: {seg['error']}")
        pilot = {"rows": seg["rows"], "slot_peak_mib": seg["slot_peak_mib"]}
        with open(pilot_path, "w") as f:
            json.dump(pilot, f)
    rows = pilot["rows"]
    ctx0 = max(int(float(str(r.get("ctx_max", 0)))) for r in rows)
    sizing = rules.size_devices(rows, cost_kib_per_token=_cost_kib_per_token(model, ctx0),
                                budget=PICK_BUDGET, fraction=float(s["fraction"]))
    peaks = pilot["slot_peak_mib"]
    trainer_cg = max((v for k, v in peaks.items() if k.startswith("trainer")), default=0.0)
    rollout_cg = max((v for k, v in peaks.items() if k.startswith("rollout")), default=0.0)
    # the cgroup charges more than the RSS the trainer reports (page cache, allocator): the
    # base rises to the cgroup's peak over the pilot's largest step, and no device is smaller
    # than the rollout's own cgroup peak with 15% to spare (it must not be what OOMs)
    t_max = max(float(str(r["train/tokens"])) for r in rows)
    cg_base = trainer_cg - sizing.slope_kib_per_token * t_max / 1024
    if cg_base > sizing.base_mib:
        sizing = rules.resize(sizing, base_mib=cg_base)
    if rollout_cg * 1.15 > sizing.device_mib:
        sizing = rules.resize(sizing, floor_mib=rollout_cg * 1.15)
    top = MAX_MODEL_LEN
    cons_budget = rules.conservative_budget(sizing, top, MARGIN)
    samples = max([48.0, *(float(str(r["train/tokens"])) / max(float(str(r["ctx_max"])), 1)
                           for r in rows)])
    window = rules.truncate_window(sizing, samples, MARGIN)
    dm = sizing.device_mib

    # 2-3. the arms
    evals = _eval_file(root, eval_games)
    first_ctx = max(256, -(-ctx0 // 256) * 256)
    layouts: dict[str, tuple[Config, tuple[str, ...]]] = {
        "restart_pick": (pick, ()),
        "selector": (Config(cores, 1, 1, cores - 1, top, PICK_BUDGET, selector=True,
                            first_context=first_ctx), ()),
        "conservative": (Config(cores, 1, 1, cores - 1, top, cons_budget or top), ()),
        "truncate": (Config(cores, 1, 1, cores - 1, window, PICK_BUDGET), ()),
        "pinned": (Config(cores, 1, 1, cores - 1, top, PICK_BUDGET, selector=True,
                          first_context=first_ctx),
                   (f"--selector.policy_factory={os.path.dirname(__file__)}/{PINNED}",)),
    }
    code = _code()
    weights = sha256_16(f"{model}/model.safetensors")
    reps: list[dict[str, dict[str, object]]] = []
    resumed: list[str] = []
    timeout = 60.0 * (20 + n_steps / 4)
    for r in range(replicates):
        common = [*base, f"--seed={r}", f"--steps={n_steps}", f"--eval_every={every}",
                  f"--checkpoint_every={every}", f"--eval_tasks={evals}",
                  f"--eval_games={eval_games}"]
        rep: dict[str, dict[str, object]] = {}
        for arm in [a for a in rules.ARMS if a in arms]:
            extra: tuple[str, ...]
            if arm == "pinned_static":
                plan = (rep.get("pinned") or {}).get("first_plan")
                twin = _twin(plan, cores) if isinstance(plan, dict) else None
                if twin is None:
                    rep[arm] = {"skipped": f"no static layout runs the pinned plan {plan}"}
                    continue
                cfg, extra = twin, ("--partial_rollouts=off",)  # as the selector's runs
            else:
                cfg, extra = layouts[arm]
            args = [*common, *cfg.args(dm), *extra]
            path = f"{root}/rep{r}_{arm}.json"
            key = {"code": code and f"{code}/{weights}", "args": args}
            if code and os.path.isfile(path):
                with open(path) as f:
                    done = json.load(f)
                if done.get("key") == key:
                    rep[arm] = done["record"]
                    resumed.append(f"rep{r}/{arm}")
                    continue
            rec = run_arm(cfg, [*common], dm, f"{root}/rep{r}_{arm}", timeout, extra=extra,
                          next_budget=(lambda b: rules.next_budget(b, top))
                          if arm == "restart_pick" else None)
            with open(path, "w") as f:
                json.dump({"key": key, "record": rec}, f)
            rep[arm] = rec
        reps.append(rep)
    ran = [{a: r for a, r in rep.items() if "skipped" not in r} for rep in reps]
    res = rules.summarize(ran, key="games_survived", threshold=float(s["threshold"]),
                          steps=n_steps)
    oom_at = [rep.get("restart_pick", {}).get("oom_at") for rep in reps]
    return {
        **res, "memory_bound": True, "quick": quick, "step0_pick": pick.name,
        "sizing": sizing.to_json(),
        "predicted_oom_context": sizing.predicted_oom_context,
        "predicted_oom_step_tokens": sizing.predicted_oom_tokens,
        "measured_oom": oom_at, "device_mib": dm, "devices": cores,
        "pilot": {"steps": len(rows), "slot_peak_mib": peaks, "context_max": ctx0},
        "layouts": {a: c.name + (" " + " ".join(e) if e else "") for a, (c, e) in layouts.items()},
        "conservative_budget": cons_budget, "truncate_window": window,
        # what the selector chose (micro-batch budget, window, recomputation), per replicate
        "selector_layouts": [rep.get("selector", {}).get("layouts") for rep in reps],
        "selector_changes": [rep.get("selector", {}).get("selector_changes") for rep in reps],
        "pinned_plan": [rep.get("pinned", {}).get("first_plan") for rep in reps],
        "restart_rule": "on an OOM: the same layout with half the micro-batch budget, resumed "
                        "from the last checkpoint (every eval_every steps), never below one "
                        f"longest sequence ({top} tokens)",
        "eval_every": every, "eval_games": eval_games, "kv_cache_gb": kv_gb,
        "replicate_records": reps, "resumed_arms": resumed,
        "wall_s": round(time.time() - t0, 1), "load_avg_1m": os.getloadavg()[0],
    }


def _code() -> str | None:
    """What an arm executes: `_selector_runs.code_key` (the packages, from a clean tree) and
    this mode's own modules' contents; None (nothing is read back) when the tree differs."""
    import hashlib

    key = code_key()
    if key is None:
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256(key.encode())
    for name in ("_selector_memory.py", "_selector_memory_runs.py", "_selector_memory_bench.py",
                 "_selector_memory_pinned.py"):
        with open(f"{here}/{name}", "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def _twin(plan: dict[str, int], cores: int) -> Config | None:
    """A static layout of the pinned arm's first plan; None where no static flag says it
    (recomputation, trainer TP)."""
    if plan.get("recompute") or plan.get("trainer_tp", 1) > 1:
        return None
    return Config(cores, plan["rollout_replicas"], plan["rollout_tp"], plan["trainer_dp"],
                  plan["max_model_len"], plan["micro_batch_tokens"])


__all__ = ["arm_record", "run_memory_bound"]
