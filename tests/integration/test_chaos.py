"""`earl chaos` end to end: a live tiny run (vLLM rollout, producer, reference, dock, trainer
processes) with faults injected, and the invariants of its JSON line: every fault recovered
from, no sample lost or trained twice, policy versions monotone, every step reached, nothing
left behind. Each run takes minutes on 2 shared cores, so they are in the slow tier.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from earl.stages.id_runs import unpack

pytestmark = [pytest.mark.timeout(900)]


def _chaos(*args: str, timeout: float = 850) -> tuple[int, dict[str, object], str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "earl.cli", "chaos", "--json", *args],
                       capture_output=True,
                       text=True, timeout=timeout, env=env, check=False)
    lines = p.stdout.strip().splitlines()
    return p.returncode, (json.loads(lines[-1]) if lines else {}), p.stderr[-4000:]


def _assert_invariants(rep: dict[str, object], faults: int) -> None:
    assert rep["faults_injected"] == faults, rep["faults"]
    assert all(f["recovered"] for f in rep["faults"]), rep["faults"]  # type: ignore[attr-defined]
    assert rep["recovered"] is True and rep["error"] == ""
    assert rep["steps_reached"] == rep["steps"]
    assert rep["samples_lost"] == 0 and rep["samples_duplicated"] == 0, rep
    assert rep["policy_versions_monotone"] is True
    assert rep["orphans"] == {"processes": [], "shm_segments": [], "folders": []}
    assert rep["ok"] is True


def test_unknown_fault_is_refused() -> None:
    code, rep, err = _chaos("--faults", "kill:nobody", timeout=60)
    assert code == 2 and "unknown fault 'kill:nobody'" in err and rep == {}


@pytest.mark.slow
@pytest.mark.vllm
def test_quick_faults_heal_in_place(tmp_path: Path) -> None:
    code, rep, err = _chaos("--quick", "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 6)
    restarts = rep["restarts"]
    assert isinstance(restarts, dict)
    for actor in ("producer", "rollout", "reference"):
        assert restarts.get(actor, 0) >= 1, restarts
    assert rep["rewinds"] == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["restarts/producer"] >= 1  # restarts are in the metrics


@pytest.mark.slow
@pytest.mark.vllm
def test_a_rollout_death_while_sessions_span_a_push(tmp_path: Path) -> None:
    """Partial rollouts carry groups over: the rollout dies right after a weight push while
    their sessions have generations in flight; nothing is lost or trained twice."""
    code, rep, err = _chaos("--faults", "kill:rollout_span", "--steps", "5",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 1)
    (span,) = rep["faults"]  # type: ignore[misc]
    assert span["requests_in_flight"] > 0  # sessions spanned the push and the death


@pytest.mark.slow
@pytest.mark.vllm
def test_trainer_and_dock_deaths_rewind_to_the_checkpoint(tmp_path: Path) -> None:
    code, rep, err = _chaos("--faults", "kill:dock,kill:trainer", "--steps", "8",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 2)
    assert rep["rewinds"] == 2


@pytest.mark.slow
@pytest.mark.vllm
def test_a_dropped_connection_restarts_the_live_actor(tmp_path: Path) -> None:
    """Calls in flight to a live producer and to the reference lose their messages (the driver's
    connection is cut): each process is treated as dead, restarted and rebuilt."""
    code, rep, err = _chaos("--faults", "drop:producer,drop:reference", "--steps", "6",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 2)
    for f in rep["faults"]:  # type: ignore[attr-defined]
        assert f["calls_in_flight"] >= 1 and f["new_pid"] != f["pid"], f
    assert rep["restarts"] == {"producer": 1, "reference": 1} and rep["rewinds"] == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_a_stalled_tool_times_out_and_the_run_goes_on(tmp_path: Path) -> None:
    """Every session's sync tool hangs (a blocked read) until the stall is lifted: each call
    comes back as a timeout error after tool_timeout_s, the producer's other sessions go on
    meanwhile, and nothing is restarted."""
    code, rep, err = _chaos("--faults", "stall:tool", "--steps", "4", "--tool-timeout-s", "1.5",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 1)
    (f,) = rep["faults"]  # type: ignore[misc]
    assert f["stalled_calls"] >= 1 and f["tool_timeout_s"] == 1.5
    # each stalled call waited out its timeout, and came back as a timeout while the tool still
    # hung (the injector lifts the stall only after it saw them; `recovered` checks "timeout")
    assert f["longest_wait_s"] >= f["tool_timeout_s"], f
    assert rep["restarts"] == {} and rep["rewinds"] == 0


@pytest.mark.slow
@pytest.mark.vllm
def test_another_users_attacks_and_a_kill_while_resaving(tmp_path: Path) -> None:
    """Another local user pre-creates the run's next shm names and holds more half-sent requests
    to the producer's OpenAI endpoint than the producer may open files; then the trainer is
    killed while the checkpoint in force is saved again. Nothing may fail but the trainer, and
    the rewind must find that checkpoint whole."""
    code, rep, err = _chaos("--faults", "squat:shm,slowloris,kill:resave", "--steps", "8",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 3)
    squat, loris, resave = rep["faults"]  # type: ignore[misc]
    assert squat["planted"] > 0
    assert loris["connections"] > 0 and loris["closed_by_server"] > 0
    assert all(status == 401 for status in loris["answered"])
    assert resave["rewound_to"] == resave["step_in_force"]
    assert rep["restarts"] == {"trainer": 1} and rep["rewinds"] == 1


@pytest.mark.slow  # ~33 s; the default tier keeps the quick fault list
@pytest.mark.vllm
def test_the_oracle_reports_a_sample_lost_on_purpose(tmp_path: Path) -> None:
    """lose:sample leaves one sample out of a step's plan and acks the lease whole: the
    trainers' records lack it, so the run reports it lost and fails, though every step was
    acked (the old oracle, which read acks, called this run clean)."""
    code, rep, err = _chaos("--faults", "lose:sample", "--steps", "4",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 1, (rep, err)
    (fault,) = rep["faults"]  # type: ignore[misc]
    lost = fault["lost_on_purpose"]
    assert rep["samples_lost"] == 1 and rep["lost_ids"] == lost, rep
    assert rep["samples_acked_untrained"] == 1 and rep["samples_duplicated"] == 0
    assert rep["steps_reached"] == 4 and rep["ok"] is False
    records = [json.loads(x) for f in (tmp_path / "run" / "trained").glob("trained.*.jsonl")
               for x in f.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert not any(lost[0] in unpack(r["sample_ids"]) for r in records)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("seed", [0, pytest.param(3, marks=pytest.mark.soak)])  # CI: seed 0
def test_three_kills_recover_with_nothing_lost(tmp_path: Path, seed: int) -> None:
    """Issue 49's schedules: a producer's, the reference's and a rollout's deaths in one run.
    Seed 0 trained a step from a frame a failed fetch had left in the trainer's receiver
    (samples with only their ref_logprobs); seed 3 ended on the reference's death."""
    code, rep, err = _chaos("--faults", "kill:producer,kill:reference,kill:rollout",
                            "--steps", "6", "--seed", str(seed),
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 3)
    assert rep["rewinds"] == 0 and rep["stalls"] == [], rep  # healed in place, never stuck


@pytest.mark.slow
@pytest.mark.vllm
def test_a_frozen_reference_is_a_stall_the_run_heals(tmp_path: Path) -> None:
    """SIGSTOP, not SIGKILL: no death is seen. The watchdog ends the attempt after
    stall_s (40 s here, `earl chaos --stall-s`), naming the stage the run waited in, and the
    rewind stops the frozen process and goes on from the checkpoint: nothing lost, every step
    reached."""
    code, rep, err = _chaos("--faults", "hang:reference", "--steps", "5", "--stall-s", "40",
                            "--output-dir", str(tmp_path / "run"))
    assert code == 0, (rep, err)
    _assert_invariants(rep, 1)
    (stall,) = rep["stalls"]  # type: ignore[misc]
    assert stall["stage"].startswith("step "), stall
    assert rep["rewinds"] == 1


REGRESSIONS = json.loads((Path(__file__).parent / "chaos_regressions.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
# CI replays the first kept schedule; the rest are soak (~75 s each: docs/testing.md)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.soak] if i else [],
                                               id=f"seed{c['seed']}-draw{c['draw']}")
                                  for i, c in enumerate(REGRESSIONS)])
def test_kept_failing_schedules_recover(tmp_path: Path, case: dict[str, object]) -> None:
    """Each drawn schedule a sweep saw fail (`bench/chaos_sweep.py`), replayed by its seed."""
    code, rep, err = _chaos("--draw", str(case["draw"]), "--seed", str(case["seed"]),
                            "--steps", str(case["steps"]),
                            "--output-dir", str(tmp_path / "run"))
    assert rep.get("drawn", {}).get("faults") == case["faults"], "the draw changed"
    assert code == 0, (rep, err)
    _assert_invariants(rep, len(case["faults"]))  # type: ignore[arg-type]
