"""The README's benchmark table, built from the latest result file of each benchmark in
bench/results/ (the files a benchmark's `--save` writes: bench/_results.py).

    python bench/report.py                    # print the table
    python bench/report.py --check README.md  # exit 1 if the README's table is not this one
    python bench/report.py --write README.md  # put this table in the README

In the README the table sits between the lines `<!-- bench-table -->` and `<!-- /bench-table -->`.
A benchmark with no result file has no row (the names are listed on stderr). Not a benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parents[1]
START, END = "<!-- bench-table -->", "<!-- /bench-table -->"
Result = dict[str, Any]


def _command(command: str) -> str:
    """The command, its `--runs` records (full paths in the result) counted, not listed."""
    head, runs, tail = command.partition(" --runs ")
    if not runs:
        return command
    words = tail.split(" ")
    n = next((i for i, w in enumerate(words) if w.startswith("-")), len(words))
    return " ".join([head, f"--runs <{n} run records>", *words[n:]])


def latest(folder: Path = RESULTS) -> dict[str, tuple[Path, Result]]:
    """The newest saved record (by its start time) of each benchmark name in `folder`."""
    out: dict[str, tuple[Path, Result]] = {}
    for path in sorted(folder.glob("*.json")):
        rec = json.loads(path.read_text())
        old = out.get(rec["bench"])
        if old is None or _started(rec) > _started(old[1]):
            out[rec["bench"]] = (path, rec)
    return out


def _started(rec: Result) -> datetime.datetime:
    return datetime.datetime.fromisoformat(rec["facts"]["started"])


def _x(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _main_job(r: Result) -> str:
    left = (f"; run folder {r['run_folder_mb']:.0f} MB (trajectory dump "
            f"{r['trajectory_dump_mb']:.1f} MB), {r['terminal_lines']} terminal lines"
            if "run_folder_mb" in r else "")
    return (f"{r['metric']} **{r['eval']:.3f}** after {r['steps']} steps in "
            f"{r['wall_minutes']:.1f} min (warm start alone {r['eval_start']:.3f}){left}")


def _main_job_llm(r: Result) -> str:
    """A real LLM's run: the gain over the warm start, the training reward curve, and where
    the time went."""
    pts = r.get("reward_curve") or []
    pts = pts[::max(len(pts) // 4, 1)][:4] + pts[-1:]
    curve = ", ".join(f"{p['step']}: {p['reward']:.2f}" for p in pts)
    return (f"{r['metric']} {r['eval_start']:.3f} after the warm start -> **{r['eval']:.3f}** "
            f"(+{r['eval'] - r['eval_start']:.3f}) after {r['steps']} RL steps, "
            f"{r['wall_minutes']:.1f} min in all; training reward by step {curve}; "
            f"a step {r['step_s_median']:.1f} s (rollout "
            f"{r['rollout_s_median']:.1f} s), train {r['train_tokens_per_s_median']:.0f} tok/s")


def _rpc(r: Result) -> str:
    s = (f"round trip {r['rtt_us_median']:.0f} us median, "
         f"{r['calls_per_s_pipelined'] / 1e3:.0f}k pipelined calls/s; "
         f"ZMQ DEALER/ROUTER {r['zmq_dealer_router_rtt_us_median']:.0f} us")
    if r.get("ray_rtt_us_median"):
        s += (f"; Ray {r['ray_rtt_us_median']:.0f} us, "
              f"{r['ray_calls_per_s_pipelined'] / 1e3:.1f}k calls/s")
    return s


def _transports(r: Result) -> str:
    tr = ", ".join(f"{k} {v}" for k, v in r["transfer_GBps"].items() if v is not None)
    s = f"GB/s: {tr}; memcpy {r['memcpy_GBps']} (best {r['best_vs_memcpy']:.2f} of it)"
    if r.get("ray_put_get_GBps"):
        s += f"; Ray put + get {r['ray_put_get_GBps']}"
    return s


def _layout(r: Result) -> str:
    lay, rss = r["layout"], r["layout"]["driver_peak_rss_MB"]
    return (f"dispatcher {lay['decentralized_s']:.3f} s, driver RSS "
            f"{rss['decentralized']:.0f} MB; single controller {lay['single_controller_s']:.3f} s "
            f"(**{lay['speedup']:.2f}x** slower), driver RSS {rss['single_controller']:.0f} MB")


def _cross_host(r: Result) -> str:
    c = r["cross_host"]
    return (f"over {c['transport']} (+ {c['tp_transport']} to TP peers): {c['decentralized_s']:.2f} s; "
            f"Ray single controller {c['single_controller_s']:.2f} s with its driver beside the "
            f"trainer (**{c['speedup']:.2f}x**), {c['single_controller_own_host_s']:.2f} s with "
            f"its driver on a third host (**{c['speedup_own_host']:.2f}x**); caps: TCP "
            f"{c['tcp_GBps']:.2f} GB/s, MAC {c['mac_GBps']:.2f} GB/s")


def _rollout(r: Result) -> str:
    t = r["tiny"]
    s = (f"{t['sessions']} agent coroutines x {t['turns']} turns: {t['agent_loop_tok_s']:,.0f} "
         f"tok/s, **{t['ratio']:.2f}** of one vLLM batch per turn ({t['batched_ref_tok_s']:,.0f})")
    if "ratio_min" in t:  # results saved before the repeats had one run per path
        s += f" (median of {t['repeats']}, {t['ratio_min']:.2f}-{t['ratio_max']:.2f})"
    if "smollm2_135m" in r:
        s += f"; SmolLM2-135M {r['smollm2_135m']['ratio']:.2f}"
    return s


def _weights(r: Result) -> str:
    t = r["tiny"]
    s = (f"tiny model {t['weight_sync_s']:.3f} s in place (memcpy of its bytes "
         f"{t['weight_memcpy_s']:.4f} s)")
    if "smollm2_135m" in r:
        m = r["smollm2_135m"]
        s += f"; SmolLM2-135M {m['weight_sync_s']:.2f} s (memcpy {m['weight_memcpy_s']:.3f} s)"
    return s


def _stress(r: Result) -> str:
    s = r["scale"]
    return (f"{s['sessions']:,} sessions ({s['sessions_failed']} failed), "
            f"{s['turns_per_s'] / 1e3:.1f}k turns/s, {s['overhead_us_per_turn']:.0f} us runtime "
            f"CPU per turn (bare asyncio {r['floor_asyncio_us_per_turn']:.0f} us), "
            f"peak RSS {s['peak_rss_mb']:.0f} MB")


def _executor(r: Result) -> str:
    el, st = r["executor"]["elastic"], r["executor"]["static"]
    return (f"elastic: mean tool latency {el['act_mean_ms'] / 1e3:.2f} s, p99 "
            f"{el['act_p99_ms'] / 1e3:.1f} s, {el['workers_peak']} workers; static per-session: "
            f"{st['act_mean_ms'] / 1e3:.1f} s, p99 {st['act_p99_ms'] / 1e3:.1f} s, "
            f"{st['workers_peak']} workers")


def _sandbox(r: Result) -> str:
    e = r["earl"] if r["isolation_available"] else r["earl_rlimits"]
    sp, fl = r["spawn"], r["fork_floor"]
    return (f"{r['calls']} calls from {r['threads']} threads: {e['calls_per_s']:.0f} calls/s, "
            f"{e['cpu_ms_per_call']:.1f} ms CPU per call; a fresh interpreter per call: "
            f"{sp['calls_per_s']:.0f} calls/s, {sp['cpu_ms_per_call']:.1f} ms "
            f"(**{r['cpu_ratio_spawn_vs_earl']:.2f}x** the CPU); bare fork "
            f"{fl['cpu_ms_per_call']:.2f} ms")


def _trainer(r: Result) -> str:
    m = r["models"]["h128_l4"]
    tok = m["fwd_bwd_tok_s"]
    return (f"{m['params'] / 1e6:.1f}M params, fwd+bwd: packed (varlen) "
            f"{tok['varlen'] / 1e3:.1f}k tok/s, padded {tok['padded'] / 1e3:.1f}k, block mask "
            f"{tok['mask'] / 1e3:.1f}k; whole train step {m['train_step_tok_s'] / 1e3:.1f}k tok/s, "
            f"MFU {m['mfu']:.2f} of a matmul timed in the same run")


def _driver_memory(r: Result) -> str:
    s, g = r["small"], r["large"]
    return (f"driver peak RSS {s['driver_peak_rss_mb']:.0f} MB with "
            f"{s['experience_bytes'] / 2**20:.2f} MB of experience, "
            f"{g['driver_peak_rss_mb']:.0f} MB with {g['experience_bytes'] / 2**20:.2f} MB "
            f"({r['experience_ratio']:.1f}x the experience): {r['driver_rss_growth_mb']:+.1f} MB")


def _openai(r: Result) -> str:
    s = f"overhead **{r['overhead_ms_median']:.2f} ms** per request over `rollout.generate`"
    if "throughput_ratio" in r:
        s += (f"; {r['sessions']} sessions x {r['turns']} turns through the rollout actor: "
              f"throughput **{r['throughput_ratio']:.2f}** of `rollout.generate`'s "
              f"({r['throughput_ratio_openai_client']:.2f} with the `openai` package as client)")
    return s


def _async(r: Result) -> str:
    a = r["async"]
    if "sync_best" not in r:  # files from before the matched-concurrency sync baseline
        s = r["sync"]
        return (f"async (lag {a['max_policy_lag']}) {a['trajectories_per_s']:.1f} traj/s; sync "
                f"(lag 0) {s['trajectories_per_s']:.1f} traj/s: **{r['throughput_ratio']:.2f}x**"
                f"; final {r['quality_key']} {a['final_quality']:.2f} vs "
                f"{s['final_quality']:.2f} ({r['repeats']} repeats)")
    s, per = r["sync_best"], r["ratios_per_repeat"]
    tried = len(r.get("sync_sweep", r.get("sync_runs", [])))
    def reps(m: dict[str, Any]) -> str:
        if "rollout_replicas" not in m:
            return ""
        n = m["rollout_replicas"]
        return f", {n} replica{'s' if n != 1 else ''}"

    out = (f"steady state, async (lag {a['max_policy_lag']}, {a['in_flight']} in flight"
           f"{reps(a)}) {a['trajectories_per_s']:.1f} traj/s vs the best of {tried} sync "
           f"settings ({s['in_flight']} in flight, {s['threads']} thread"
           f"{'s' if s['threads'] != 1 else ''}{reps(s)}) "
           f"{s['trajectories_per_s']:.1f}: **{r['ratio_steady_state']:.2f}x** (per repeat "
           f"{min(per):.2f}-{max(per):.2f}, cap {r['core_limit']:.2f}x); final "
           f"{r['quality_key']} {a['final_quality']:.2f} vs {s['final_quality']:.2f}")
    if "turns_per_trajectory" in a:
        out += (f"; turns per trajectory {a['turns_per_trajectory']:.2f} vs "
                f"{s['turns_per_trajectory']:.2f}")
    if eq := r.get("quality_at_equal_updates"):
        out += f"; at equal updates {eq['async']:.2f} vs {eq['sync_best']:.2f}"
    return out


def _peers(r: Result) -> str:
    e = r["earl"]
    t = r.get("trl_best") or r["trl"]  # "trl": files from before TRL's configuration sweep
    s = (f"EARL {e['trajectories_per_s']:.1f} traj/s, TRL's best "
         f"{t['trajectories_per_s']:.1f}: **{r['ratio_trajectories_per_s']:.2f}x**")
    if "ratio_trajectories_per_cpu_s" in r:
        s += f", per CPU-second {r['ratio_trajectories_per_cpu_s']:.2f}x"
    if "config" in t:
        c = t["config"]
        knob = (f"steps_per_generation {c['steps_per_generation']}"
                if c.get("steps_per_generation") else
                f"max_staleness {c['max_staleness']}, queue {c.get('queue_maxsize') or 1024}")
        s += (f" (TRL {c.get('trainer', 'GRPOTrainer')}, {c['pace']} pace, {c['threads']} "
              f"thread(s), {knob}, best of {len(r['trl_runs'])})")
    s += (f"; eval reward {e['final_eval']['reward']:.2f} vs {t['final_eval']['reward']:.2f}")
    if "straggler_wait_share" in e:  # partial rollouts
        s += (f"; EARL with partial rollouts (lag {r['earl_max_policy_lag']}): straggler wait "
              f"{e['straggler_wait_share']:.2f} of step time, turns per trained trajectory "
              f"{e['trained_turns_mean']:.2f} vs TRL's {t['turns_mean']:.2f}")
        stale = [x["stale_token_share"] for x in e.get("runs", []) if "stale_token_share" in x]
        if stale:  # tokens over the bound stay as context, out of the loss
            s += f", {100 * sum(stale) / len(stale):.0f}% of its loss tokens over the bound"
    if any("trajectories_per_cpu_s_whole_run" in x for x in e.get("runs", [])):
        s += " (per CPU-second over the rate's window)"
    if r.get("earl_over_sampled"):
        s += f"; over-sampled EARL {r['earl_over_sampled']['ratio_turns_per_s']:.2f}x turns/s"
    return s


def _race_chain(r: Result) -> str:
    """EARL against TRL's fastest arm on `chain_smollm2`: the curves' ends, the point-by-point
    verdict, and the rates."""
    e, trl = r["earl"], r["trl"]

    def ends(c: list[dict[str, Any]]) -> str:
        return f"{c[0]['accuracy']:.3f} at {c[0]['t_s'] / 60:.0f} min -> {c[-1]['accuracy']:.3f}"

    ran = [(k, v) for k, v in trl.items() if "curve" in v]
    if not ran:  # every TRL arm failed: EARL's curve, and why TRL has none
        why = "; ".join(f"{k}: {v['error'].split(':')[0]}" for k, v in trl.items())
        return (f"{r['minutes']:.0f} min a side, {r['eval_tasks']} held-out tasks: EARL "
                f"{ends(e['curve'])}; TRL has no curve ({why})")
    arm, t = max(ran, key=lambda kv: kv[1]["curve"][-1]["accuracy"])

    def mins(v: float | None) -> str:
        return "not reached" if v is None else f"{v / 60:.0f} min"

    reach = r.get("earl_time_to_trl_final_s")
    return (f"{r['minutes']:.0f} min a side, {r['eval_tasks']} held-out tasks every "
            f"{r['points_s'][0] / 60:.0f} min: EARL {ends(e['curve'])}, TRL ({arm}) "
            f"{ends(t['curve'])}; EARL >= TRL at every point after the first: "
            f"**{'yes' if r['earl_at_least_after_first'] else 'no'}**; EARL reached TRL's final "
            f"accuracy at {mins(reach)}; time to {r['threshold']}: EARL "
            f"{mins(e['time_to_threshold_s'])}, TRL {mins(t['time_to_threshold_s'])}; traj/s "
            f"{e['trajectories_per_s']:.3f} vs {t['trajectories_per_s']:.3f}, tokens/s "
            f"{e['tokens_per_s']:.0f} vs {t['tokens_per_s']:.0f}, CPU-s per trajectory "
            f"{e['cpu_s_per_trajectory']:.1f} vs {t['cpu_s_per_trajectory']:.1f}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _selector(r: Result) -> str:
    def x(v: object) -> str:
        return f"**{v:.2f}x**" if isinstance(v, float) else "n/a"

    sel, ev = r["selector_run"], r["final_eval"]
    survived = {k: (v or {}).get("games_survived") for k, v in ev.items()}
    s = (f"{r['steps']} steps on {r['cores']} cores: selector {sel['tokens_per_s']:,.0f} tok/s, "
         f"{x(r['throughput_ratio_vs_best_static'])} the best static run in hindsight, "
         f"{x(r['throughput_ratio_vs_step0_pick'])} the step-0 pick"
         + (f", {x(r['throughput_ratio_vs_best_static_same_devices'])} the best on its devices"
            if r.get("best_static_same_devices") else "")
         + (f"; on the same work (its tokens per context length at each run's measured rate) "
            f"{x(r['matched_ratio_vs_best_static'])} the best static run, "
            f"{x(r['matched_ratio_vs_step0_pick'])} the step-0 pick"
            if "matched_ratio_vs_best_static" in r else "") + " "
         f"({len(r['static_runs'])} static runs"
         f"{', re-run on its machine' if r.get('summarized_from') else ''}); context growth "
         f"{r['context_growth']:.2f}x; {_n(r['reconfigurations'], 'reconfiguration')} (median "
         f"{r['reconfig_seconds_median'] or 0:.1f} s), "
         f"{_n(r['trainer_layout_changes'], 'trainer layout change')}, "
         f"{_n(r['device_moves'], 'device move')}, {_n(r['samples_lost'], 'sample')} lost")
    if all(isinstance(v, float) for v in survived.values()):
        s += (f"; games survived selector {survived['selector']:.2f} vs truncate "
              f"{survived['truncate']:.2f}")
    return s


def _selector_bound(r: Result) -> str:
    sm, sweeps = r["summary"], r["sweeps"].values()
    statics = {c for s in sweeps for c in s["static_commits"]}
    one = all(len({v["run"] for v in s["fastest_by_bucket"].values()}) == 1 for s in sweeps)

    def span(key: str, unit: str = "x") -> str:
        lo, hi = f"{sm[key]['min']:.2f}", f"{sm[key]['max']:.2f}"
        return f"**{lo}{unit}**" if lo == hi else f"**{lo}-{hi}{unit}**"

    return (f"{len(statics)} static sweeps, {_n(len(r['sweeps']), 'selector run')}"
            + ("; one static layout is the fastest at every context length in each" if one
               else "")
            + f": a policy switching for free to the fastest swept layout at each context "
            f"reaches {span('oracle_ratio_max_over_works')} the best static run (goal 1.1x), "
            f"{span('oracle_ratio_vs_step0_pick')} the step-0 pick (goal 1.5x); the selector "
            f"runs reached {span('selector_share_of_oracle', '')} of it")


def _simulate(r: Result) -> str:
    big = max(r["runs"], key=lambda x: x["gpus"])
    return (f"{big['gpus']} GPUs, 70B, contexts 4K -> 32K: selector "
            f"{big['selector_tokens_per_s']:,.0f} tok/s vs best static in hindsight "
            f"{big['best_static_tokens_per_s']:,.0f} "
            f"(**{big['throughput_ratio_vs_best_static']:.2f}x**), "
            f"{'OOM' if big['oom_selector'] else 'no OOM'}; "
            f"{big['static_oom']} of {big['static_layouts']} static layouts OOM"
            + (f"; vs the step-0 pick restarted on OOM **{big['throughput_ratio_vs_restart_pick']:.2f}x**"
               if "throughput_ratio_vs_restart_pick" in big else "")
            + _calibration(r.get("calibration")))


def _calibration(c: dict[str, Any] | None) -> str:
    """The cost model against the 2-core runs, as the simulation's caveat."""
    if not c:
        return ""
    if c.get("passed"):
        return "; cost model calibrated on the 2-core runs (within 10%)"
    worst = max((abs(x) for x in (c.get("rates", {}).get("held_out", {}).get("max_abs_error"),
                                  c.get("oom_step_error")) if isinstance(x, int | float)),
                default=None)
    return ("; **the cost model fails its calibration** on the 2-core runs"
            + (f" (off by up to {worst:.0%})" if worst is not None else "")
            + ": these figures are not yet earned")


def _scale(r: Result) -> str:
    sc = max(r["scenarios"], key=lambda x: x["config"]["gpus"])
    c, e = sc["config"], sc["estimate"]
    return (f"{c['gpus']} GPUs, {c['model_params'] / 1e9:.0f}B, {c['context_len'] // 1024}K "
            f"context: {e['volume_TB']:.2f} TB per step through a single controller, "
            f"{e['single_controller_s'] / 60:.1f} min; dispatcher {e['dispatcher_s'] * 1e3:.0f} ms")


def _parallel(r: Result) -> str:
    parts = [f"{r['params'] / 1e6:.1f}M params"]
    for key, what in (("rollout_tok_s", "rollout"), ("train_tok_s", "training")):
        if key in r:
            t = r[key]
            parts.append(f"{what} TP2 {t['tp2']:,.0f} vs TP1 {t['tp1']:,.0f} tok/s "
                         f"({t['tp2_vs_tp1']:.2f}x)")
    if "reconfig_trainer_s" in r:
        parts.append(f"re-layout trainer DP2 -> TP2 {r['reconfig_trainer_s']['total_s']:.1f} s, "
                     f"rollout TP1 -> TP2 {r['reconfig_rollout_s']['total_s']:.1f} s")
    return "; ".join(parts)


def _weights_gpu(r: Result) -> str:
    return (f"{r['mib']} MiB to a replica on the trainer's GPU ({r['gpu'].replace('NVIDIA ', '')}): "
            f"CUDA IPC {r['ipc']['seconds_median'] * 1e3:.1f} ms vs host path "
            f"{r['shm']['seconds_median'] * 1e3:.0f} ms (**{r['ipc_vs_shm']:.0f}x**); one "
            f"device copy {r['d2d_copy']['seconds_median'] * 1e3:.2f} ms")


def _soak(r: Result) -> str:
    s = r.get("soak", {})
    kinds = len({f["fault"] for f in r.get("faults", [])})
    growth = s.get("max_rss_growth")
    worst = max(s.get("rss", {}).items(), key=lambda kv: kv[1].get("growth") or -1,
                default=("-", {}))[0]
    rates = [w["steps_per_s"] for w in s.get("steps_per_s", [])]
    return (f"{s.get('seconds', 0) / 3600:.1f} h, {r.get('faults_injected', 0)} faults of "
            f"{kinds} kinds ({'all' if r.get('recovered') else 'not all'} recovered), "
            f"{r.get('rewinds', 0)} rewinds: **{r.get('samples_lost')}** lost, "
            f"**{r.get('samples_duplicated')}** duplicated of {r.get('samples_produced', 0):,} "
            f"samples; RSS growth after warm-up at most "
            + (f"**{growth:.1%}** ({worst})" if growth is not None else "-")
            + (f", private pages (USS) {s['max_uss_growth']:.1%}"
               if s.get("max_uss_growth") is not None else "")
            + f"; run folder {s.get('folder_mib_after_warmup', 0):.0f} -> "
            f"{s.get('folder_mib_end', 0):.0f} MB; steps/s per 10 min "
            f"{min(rates, default=0):.2f}-{max(rates, default=0):.2f}; targets "
            + ("**all met**" if r.get("ok") else "missed: " + ", ".join(
                k for k, t in r.get("targets", {}).items() if not t["ok"])))


def _chaos_sweep(r: Result) -> str:
    return (f"{r['runs']} drawn schedules of {r['draw']} faults: {r['passed']} passed, "
            f"**{r['lost']}** samples lost, **{r['duplicated']}** duplicated; each failing "
            f"schedule kept as a regression case ({r['regression_cases']})")


# (result name, what is measured, figure); the table's rows, in order
ROWS: list[tuple[str, str, Callable[[Result], str]]] = [
    ("main_job", "the main job: `earl train`, Tic-Tac-Toe, tiny model, held-out games", _main_job),
    ("main_job_calc", "calc recipe: tool use, held-out accuracy", _main_job),
    ("main_job_calc_smollm2", ("`calc_smollm2`: SmolLM2-135M-Instruct learns tool use (LoRA, 2 "
     "cores), 200 held-out tasks, greedy"), _main_job_llm),
    ("main_job_openai_calc_smollm2", ("the same task as an OpenAI-client agent "
     "(`agents/openai_calc_smollm2.yaml`)"), _main_job_llm),
    ("rpc", "actor RPC, one caller, one actor", _rpc),
    ("dispatch", "data plane, 256 MiB point to point, receiver reads every byte", _transports),
    ("dispatch", "layout-aware dispatch: 1 GiB, 2 producers -> DP2xTP2", _layout),
    ("dispatch_cross_host", ("the same across two hosts (namespaces): 256 MiB on host B -> "
     "DP2xTP2 on host A"), _cross_host),
    ("rollout", "rollout: agent coroutines through the vLLM rollout actor", _rollout),
    ("rollout", "weight sync, trainer -> vLLM", _weights),
    ("weights_gpu", "weight sync on a GPU, colocated (lent H100)", _weights_gpu),
    ("openai_endpoint", "OpenAI-compatible endpoint", _openai),
    ("stress", "stress: concurrent sessions, simulated engine", _stress),
    ("stress", "tool executor, bursty calculator load", _executor),
    ("sandbox", "sandboxed `python` tool", _sandbox),
    ("trainer", "trainer step, packed sequences", _trainer),
    ("driver_memory", "driver memory vs experience (metadata only)", _driver_memory),
    ("async_vs_sync", "async vs sync pipeline, Tic-Tac-Toe", _async),
    ("async_vs_sync_agentic", "async vs sync, agentic (tools that wait)", _async),
    ("race_chain", ("race: EARL against TRL's GRPOTrainer (the arm it raced named), "
     "SmolLM2 on `chain_smollm2`, same warm start, budget and evaluator"), _race_chain),
    ("peers", "peer: TRL at its best (GRPOTrainer or AsyncGRPOTrainer), same agentic task and budget", _peers),
    ("soak", "soak: a live run with a fault drawn every ~5 min (`earl chaos --soak`)", _soak),
    ("chaos_sweep", "fault schedules drawn from seeds (`earl chaos --draw`)", _chaos_sweep),
    ("parallel", "tensor parallelism on CPU", _parallel),
    ("selector", "parallelism selector in `earl train`, gauntlet (contexts grow as it learns), device slots", _selector),
    ("selector_bound", ("the selector's ceiling on this machine: free, clairvoyant switching "
     "among the swept layouts"), _selector_bound),
    ("selector_simulate", "parallelism selector, simulated cluster", _simulate),
    ("scale_model", "data through the driver per step, analytic model", _scale),
]


def table(records: dict[str, tuple[Path, Result]]) -> str:
    """The markdown table: one row per entry of ROWS whose benchmark has a result file."""
    lines = ["| what | figure | command | result |", "|---|---|---|---|"]
    for name, what, figure in ROWS:
        if name not in records:
            continue
        path, rec = records[name]
        rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        lines.append(f"| {what} | {figure(rec['result'])} | `{_command(rec['facts']['command'])}` | "
                     f"[{path.name}]({rel}) |")
    return "\n".join(lines)


def replace_table(text: str, new: str) -> str:
    """`text` with what lies between the START and END markers replaced by `new`."""
    head, sep, rest = text.partition(START + "\n")
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"the README needs the lines {START} and {END} around the table")
    return head + START + "\n" + new + "\n" + END + tail


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    group = ap.add_mutually_exclusive_group()
    group.add_argument("--check", metavar="README", help="exit 1 if its table differs")
    group.add_argument("--write", metavar="README", help="replace its table")
    args = ap.parse_args(argv)
    records = latest(RESULTS)
    missing = sorted({name for name, _, _ in ROWS} - set(records))
    if missing:
        print(f"no result file yet: {', '.join(missing)}", file=sys.stderr)
    new = table(records)
    if args.check or args.write:
        path = Path(args.check or args.write)
        text = path.read_text()
        updated = replace_table(text, new)
        if args.check:
            if updated != text:
                print(f"{path}: the benchmark table is not the latest results; run "
                      f"`python bench/report.py --write {path}`", file=sys.stderr)
                return 1
            return 0
        path.write_text(updated)
        return 0
    print(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
