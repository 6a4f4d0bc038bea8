"""`earl train` end to end on CPU (vLLM rollout actor + learner actor), then `--resume`.

A few steps only: checks the JSON contract, the files a run writes, `earl inspect`, resume
after a kill (the checkpoint is what a SIGKILL leaves behind) with the recipe's critic, and the
config error path.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(400)]

SMALL = ["--warm_start.steps=5", "--batch_size=16", "--group_size=4", "--eval_games=20",
         "--checkpoint_every=2", "--optim.lr=1e-3", "--dump_share=1"]  # every group dumped


def _earl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "earl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, check=False)


def _critic_state(checkpoint: Path) -> dict:  # type: ignore[type-arg]
    """Producer 0's critic state in the checkpoint in force."""
    folder = json.loads((checkpoint / "manifest.json").read_text())["folder"]
    return json.loads((checkpoint / folder / "producers" / "0.json").read_text())


def test_train_json_files_inspect_and_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = _earl("train", "--output-dir", str(out), "--json", "--trace", "--steps=3", *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 3
    ev = res["eval"]
    assert ev["games"] == 20
    assert abs(ev["win_rate"] + ev["draw_rate"] + ev["loss_rate"] - 1.0) < 1e-9
    # an illegal move loses: illegal games are a subset of the losses
    assert ev["illegal_rate"] <= ev["loss_rate"] + 1e-9
    assert res["eval_start"]["illegal_rate"] <= res["eval_start"]["loss_rate"] + 1e-9
    for key in ("metrics", "plot", "plot_context", "trace", "trajectories"):
        assert Path(res[key]).is_file(), key
    assert (Path(res["checkpoint"]) / "manifest.json").is_file()
    critic = _critic_state(Path(res["checkpoint"]))
    assert critic["values"] and critic["q"]  # the recipe's critic, built in the producer
    assert res["recipe"] == "tictactoe" and res["eval_start"]["games"] == 20
    assert (Path(res["weights"]) / "config.json").is_file()
    assert res["wall_minutes"] > 0
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["staleness"] <= 1.0 + 1e-9 for r in rows)  # default max_policy_lag=1
    trace = json.loads(Path(res["trace"]).read_text())
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"play", "train_step", "push_weights", "eval", "checkpoint"} <= names
    # lag 1: batch 2 is played (and prepared on its producer) while batch 1 trains
    spans = {(e["name"], e["args"].get("step")): (e["ts"], e["ts"] + e["dur"])
             for e in trace["traceEvents"] if e["name"] in ("play", "train_step")}
    assert spans[("play", 2)][0] < spans[("train_step", 1)][1]
    trained = [e["args"]["step"] for e in trace["traceEvents"] if e["name"] == "train_step"]
    assert trained == [1, 2, 3]
    assert "step 3/3" in p.stderr  # progress lines go to stderr with --json

    q = _earl("inspect", str(out), "--json")
    assert q.returncode == 0, q.stderr[-2000:]
    summary = json.loads(q.stdout)
    # partial rollouts: the dump holds every trajectory put, the groups still out when the
    # run ended (dropped with the reason) included
    assert summary["trajectories"] >= 3 * 16
    sid = json.loads(Path(res["trajectories"]).read_text().splitlines()[-1])["sample_id"]
    r = _earl("inspect", str(out), "--replay", sid, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["match"], r.stdout + r.stderr[-2000:]

    # resume: continues from step 3 to 5, appends metrics
    p2 = _earl("train", "--output-dir", str(out), "--json", "--resume", "--steps=5", *SMALL)
    assert p2.returncode == 0, p2.stderr[-3000:]
    res2 = json.loads(p2.stdout.strip().splitlines()[-1])
    assert res2["steps"] == 5
    rows = [json.loads(x) for x in Path(res2["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert "resumed from step 3" in p2.stderr
    # the resumed producer restored the critic's table and went on learning into it
    assert set(critic["values"]) <= set(_critic_state(Path(res2["checkpoint"]))["values"])


@pytest.mark.slow  # ~36 s
def test_two_producers_shard_the_dock_index_and_every_step_trains_its_batch(
        tmp_path: Path) -> None:
    """With 2 producers the dock's index has a rank per producer; a step's groups hash to
    both, and the trainer's lease is merged from them: every step trains its whole batch.
    The folder holds an earlier run's trajectory dumps: a fresh run starts them empty (the
    producers append)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("trajectories.jsonl", "trajectories.1.jsonl"):
        (out / name).write_text(json.dumps({"sample_id": "b000000-earlier", "step": 1}) + "\n")
    p = _earl("train", "--output-dir", str(out), "--json", "--steps=3",
              "--placement.producers=2", *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dock: index sharded over 2 ranks" in p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/samples"] >= 16 for r in rows), rows
    dumped = [json.loads(x) for f in out.glob("trajectories*.jsonl")
              for x in f.read_text().splitlines()]
    assert len(dumped) >= 3 * 16 and all("earlier" not in d["sample_id"] for d in dumped)


@pytest.mark.slow
def test_sigkill_then_resume(tmp_path: Path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "earl.cli", "train", "--output-dir", str(out),
                             "--steps=40", *SMALL], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    state = out / "checkpoint" / "manifest.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (state.is_file() and
                                               json.loads(state.read_text())["step"] >= 2):
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole job: driver and its actor processes
    proc.wait()
    done = json.loads(state.read_text())["step"]
    assert done >= 2
    p = _earl("train", "--output-dir", str(out), "--json", "--resume", f"--steps={done + 1}",
              *SMALL)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1])["steps"] == done + 1


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    p = _earl("train", "--output-dir", str(tmp_path), "--batch_size=30", "--group_size=8")
    assert p.returncode == 2
    assert "batch_size" in p.stderr and "group_size" in p.stderr
    p = _earl("train", "--output-dir", str(tmp_path / "x"), "--resume")
    assert p.returncode == 2 and "no checkpoint" in p.stderr
