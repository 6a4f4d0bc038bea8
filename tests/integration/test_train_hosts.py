"""`earl train` across two hosts made from namespaces (tests/hosts.py), with a real two-node Ray
cluster over their addresses: the rollout replica and the producer (whose warehouse holds the
experience) on host b; the trainer, the reference and the dock's index on host a. The metrics
must show weights (a -> b) and experience (b -> a) crossing the boundary over the network
transport, never over shared memory, and a SIGKILL of the remote rollout replica as training
starts must heal as on one host (restarted on b, every step reached)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hosts import Host, hosts, ray_cluster, unavailable

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _actors_on(h: Host, group: str) -> list[int]:
    """Pids of the earl actors of `group` in host `h`'s network namespace (an actor names its
    process after its group and rank: `/proc/PID/comm` reads "rollout0")."""
    netns = os.stat(f"/proc/{h.holder.pid}/ns/net").st_ino
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino != netns:
                continue
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm.startswith(group) and comm[len(group):].isdigit():
            out.append(int(pid))
    return out


def _steps(metrics: Path) -> list[dict[str, float]]:
    if not metrics.is_file():
        return []
    return [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]


def test_train_across_two_hosts_heals_a_remote_rollout(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with hosts(2, "eht", share=[tmp_path]) as (a, b), ray_cluster([a, b]) as cluster:
        argv = [sys.executable, "-m", "earl.cli", "train", "--placement.launcher=ray",
                (f"--placement.hosts=rollout={b.resource},producer={b.resource},"
                 f"trainer={a.resource},reference={a.resource},dock={a.resource}"),
                "--output-dir", str(out), "--json", f"--steps={STEPS}", "--eval_every=0",
                "--eval_games=8", "--warm_start.steps=2", "--batch_size=8", "--group_size=4",
                "--algorithm.kl_coef=0.05"]
        log = open(tmp_path / "train.log", "w")  # noqa: SIM115 - closed below
        proc = a.popen(argv, env={**cluster.env, "HF_HUB_OFFLINE": "1"}, cwd=str(REPO),
                       stdout=subprocess.PIPE, stderr=log, text=True)
        killed = 0
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            # as training starts (after the warm start and the first eval): the steps of a tiny
            # model come fast, so waiting for a logged step could land after the last one
            if not killed and "eval at start" in (tmp_path / "train.log").read_text():
                remote = _actors_on(b, "rollout")
                assert len(remote) == 1, remote  # one replica, on b
                assert _actors_on(a, "rollout") == [] and len(_actors_on(a, "trainer")) == 1
                os.kill(remote[0], signal.SIGKILL)
                killed = remote[0]
            time.sleep(0.5)
        stdout, _ = proc.communicate(timeout=60)
        log.close()
    err = (tmp_path / "train.log").read_text()[-4000:]
    assert proc.returncode == 0, err
    assert killed, "the run ended before its training started"
    res = json.loads(stdout.strip().splitlines()[-1])
    assert res["steps"] == STEPS, res
    rows = _steps(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["restarts/rollout"] >= 1  # healed: the replica on b was restarted
    net = "ucx" if any(k.endswith("/ucx") for r in rows for k in r) else "zmq"
    for r in rows:  # the trainer (a) -> rollout (b) weights: the network, never shared memory
        assert r.get(f"transport/weights_bytes/{net}", 0) > 0, r
        assert r.get("transport/weights_bytes/shm", 0) == 0, r
    # experience: the producer's warehouse (b) -> the trainer and the reference (a) over the
    # network; the reference's own shard (a: its `ref_logprobs`, 4 bytes a token against the
    # producer's 25) reaches the trainer (a) over shared memory, as on one host
    for r in rows:
        remote = r.get(f"transport/experience_bytes/{net}", 0)
        assert remote > 0 and 4 * r.get("transport/experience_bytes/shm", 0) < remote, r
    # the reference scores ahead of the trainer (a row may see none): over the network, only
    assert sum(r.get(f"transport/reference_bytes/{net}", 0) for r in rows) > 0
    assert sum(r.get("transport/reference_bytes/shm", 0) for r in rows) == 0
