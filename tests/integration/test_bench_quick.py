"""Every other benchmark's `--quick` run end to end: its JSON schema and the invariants that tie
its figures together (slow tier; dispatch and stress have their own files). No timing is asserted,
only relations a broken benchmark would violate."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _bench(name: str, *args: str, timeout: int) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([sys.executable, str(BENCH / f"{name}.py"), "--json", "--quick", *args],
                         capture_output=True, text=True, timeout=timeout, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rollout_quick() -> None:
    res = _bench("rollout", timeout=590)
    tiny = res["tiny"]
    assert "smollm2_135m" not in res  # --quick: the tiny model only
    # the same work on both paths: every turn exactly max_tokens tokens, the same prompts
    want = tiny["sessions"] * tiny["turns"] * tiny["max_tokens"]
    assert tiny["min_tokens"] == tiny["max_tokens"]
    assert tiny["agent_tokens"] == tiny["batched_ref_tokens"] == want
    assert tiny["agent_prompt_tokens"] == tiny["batched_ref_prompt_tokens"] > 0
    # the median of three alternated pairs, with its spread
    assert tiny["repeats"] == len(tiny["ratios"]) == 3
    assert tiny["ratios"] == sorted(tiny["ratios"]) and tiny["ratio"] == tiny["ratios"][1]
    assert tiny["ratio_min"] == tiny["ratios"][0] and tiny["ratio_max"] == tiny["ratios"][-1]
    for k in ("batched_ref_tok_s", "agent_loop_tok_s", "ratio", "weight_sync_s"):
        assert res[k] == tiny[k]
    assert "raw_tok_s" not in res
    # a weight sync moves the bytes at least once: it cannot beat one memcpy of them
    assert min(tiny["weight_sync_s"], tiny["weight_sync_first_s"]) >= tiny["weight_memcpy_s"]
    assert tiny["weight_bytes"] > 1e6 and tiny["weight_buckets"] >= 1


def check_async_vs_sync(res: dict, repeats: int, sync_threads: list[int]) -> None:  # type: ignore[type-arg]
    """The invariants of bench/async_vs_sync.py's JSON (also usable on a saved full run)."""
    assert res["bench"] == "async_vs_sync" and res["repeats"] == repeats
    sync, asyn = res["sync_best"], res["async"]
    lag = asyn["max_policy_lag"]
    assert sync["max_policy_lag"] == 0 and lag >= 1
    # every (threads, batches per round, replicas) sync setting was tried, including the async
    # run's concurrency: lag + 1 batches in flight (tic-tac-toe: one replica, whole batches)
    tried = {(r["threads"], r["in_flight"], r["rollout_replicas"]) for r in res["sync_sweep"]}
    batch = asyn["batch_size"]
    assert tried == {(t, batch * m, 1) for t in sync_threads for m in (1, lag + 1)}
    assert asyn["in_flight"] == batch * (lag + 1) and asyn["rollout_replicas"] == 1
    # the work per trajectory both modes trained is in the file (tic-tac-toe: one turn)
    for mode in (sync, asyn):
        assert mode["turns_per_trajectory"] >= 1 and mode["model_tokens_per_trajectory"] > 0
    # the fastest sync setting of the first round is the baseline and gets every repeat
    assert sync in res["sync_sweep"]
    for other in res["sync_sweep"]:
        assert other["trajectories_per_s_runs"][0] <= sync["trajectories_per_s_runs"][0]
        assert other["repeats"] == (repeats if other == sync else 1)
    for mode in (*res["sync_sweep"], asyn):
        runs = mode["trajectories_per_s_runs"]
        assert len(runs) == mode["repeats"] == len(mode["steps"])
        assert mode["trajectories_per_s"] == pytest.approx(statistics.fmean(runs), abs=0.01)
        assert mode["spread"] == pytest.approx((max(runs) - min(runs)) / statistics.fmean(runs),
                                               abs=2e-3)
        # CPU of the process tree per wall second: some work, never more than every core
        assert 0.05 < mode["cores_used"] <= res["cores"] * 1.05
        assert mode["final_quality"] == pytest.approx(statistics.fmean(
            mode["final_quality_runs"]), abs=1e-3)
    assert res["ratio_steady_state"] == pytest.approx(
        asyn["trajectories_per_s"] / sync["trajectories_per_s"], abs=2e-3)
    assert len(res["ratios_per_repeat"]) == repeats
    assert res["async_cores_used"] == asyn["cores_used"]
    assert res["core_limit"] == pytest.approx(res["cores"] / sync["cores_used"], abs=2e-3)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_async_vs_sync_quick() -> None:
    res = _bench("async_vs_sync", "--repeats", "1", "--sync-threads", "1", timeout=1790)
    check_async_vs_sync(res, 1, [1])
    assert res["async"]["repeats"] == res["sync_best"]["repeats"] == 1
    assert res["async"]["steps"] == [10]  # --quick: 10 steps (sync: the same trajectories)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_trainer_quick() -> None:
    res = _bench("trainer", "--threads", "1", timeout=890)
    m = res["models"]["h128_l4"]
    assert set(res["models"]) == {"h128_l4"} and res["threads"] == 1
    tok = m["fwd_bwd_tok_s"]
    assert set(tok) == {"varlen", "mask", "padded", "per_sample"}
    assert m["varlen_vs_padded"] == pytest.approx(tok["varlen"] / tok["padded"], abs=0.01)
    assert m["varlen_vs_mask"] == pytest.approx(tok["varlen"] / tok["mask"], abs=0.01)
    # MFU is relative to the matmul peak measured in the same run
    assert m["mfu"] == pytest.approx(m["train_step_gflops"] / m["peak_gflops"], abs=2e-3)
    assert res["mfu"] == m["mfu"] and res["peak_gflops"] == m["peak_gflops"]
    assert "measured" in res["mfu_basis"]
    assert 0.2e6 < m["params"] < 2e6 and m["tokens"] > 32 * 50  # 32 samples of 50-400 tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rpc_quick() -> None:
    res = _bench("rpc", timeout=290)
    assert res["bench"] == "rpc" and res["quick"] is True
    assert res["rtt_us_p99"] >= res["rtt_us_median"] > 0
    assert res["rtt_vs_unix_floor"] == pytest.approx(
        res["rtt_us_median"] / res["unix_socket_rtt_us_median"], rel=0.02)
    assert res["zmq_rtt_over_earl_rtt"] == pytest.approx(
        res["zmq_dealer_router_rtt_us_median"] / res["rtt_us_median"], rel=0.02)
    # the CPU-bound rate is what the busier side's CPU per call allows
    busier = max(res["caller_cpu_us_per_call"], res["actor_cpu_us_per_call"])
    assert res["calls_per_s_cpu_bound"] == pytest.approx(1e6 / busier, rel=0.02)
    if res["ray_rtt_us_median"] is not None:
        assert res["ray_rtt_over_earl_rtt"] == pytest.approx(
            res["ray_rtt_us_median"] / res["rtt_us_median"], rel=0.02)
        assert res["earl_calls_over_ray_calls"] == pytest.approx(
            res["calls_per_s_pipelined"] / res["ray_calls_per_s_pipelined"], rel=0.02)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sandbox_quick() -> None:
    res = _bench("sandbox", timeout=290)
    assert res["bench"] == "sandbox" and res["repeats"] == 2 and res["calls"] == 100
    modes = ["earl_rlimits", "spawn", "fork_floor"]
    if res["isolation_available"]:
        modes.insert(0, "earl")
    for m in modes:
        mode = res[m]
        runs = mode["calls_per_s_runs"]
        assert len(runs) == res["repeats"]
        assert mode["spread"] == pytest.approx((max(runs) - min(runs)) / statistics.fmean(runs),
                                               abs=2e-3)
        assert 0 < mode["wall_ms_p50"] <= mode["wall_ms_p90"]
        # every call is a process: it costs CPU
        assert mode["cpu_ms_per_call"] > 0
    for m in modes[:-1]:  # the bare fork is the floor of every sandboxed run
        assert res[m]["wall_ms_p50"] > res["fork_floor"]["wall_ms_p50"]
    best = res["earl"] if res["isolation_available"] else res["earl_rlimits"]
    assert res["cpu_ratio_spawn_vs_earl"] == pytest.approx(
        res["spawn"]["cpu_ms_per_call"] / best["cpu_ms_per_call"], rel=0.02)
    assert res["rate_ratio_earl_vs_spawn"] == pytest.approx(
        best["calls_per_s"] / res["spawn"]["calls_per_s"], rel=0.02)
