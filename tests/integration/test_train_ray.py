"""`earl train --placement.launcher=ray` on a local two-node Ray cluster (both on loopback):
the same job, every actor placed by Ray in its own placement group, spread over both nodes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 6391


def _ray(*args: str, env: dict[str, str]) -> None:
    exe = str(Path(sys.executable).with_name("ray"))
    p = subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=120,
                       check=False)
    assert p.returncode == 0, (args, p.stdout[-2000:], p.stderr[-2000:])


@pytest.fixture
def two_nodes():
    tmp = tempfile.mkdtemp(prefix="r", dir="/tmp")  # Ray's socket paths must stay short
    env = {**os.environ, "HOME": tmp, "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus=4", "--node-ip-address=127.0.0.1", "--disable-usage-stats"]
    try:
        _ray("start", "--head", f"--port={PORT}", "--include-dashboard=false",
             f"--temp-dir={tmp}/t", *common, env=env)
        _ray("start", f"--address=127.0.0.1:{PORT}", *common, env=env)
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{PORT}"}
    finally:
        _ray("stop", "--force", env=env)
        shutil.rmtree(tmp, ignore_errors=True)


def test_earl_train_on_ray(two_nodes: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-m", "earl.cli", "train", "--placement.launcher=ray",
         "--output-dir", str(out), "--json", "--steps=2", "--eval_every=0", "--eval_games=8",
         "--warm_start.steps=2", "--batch_size=8", "--group_size=4"],
        env={**two_nodes, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=500,
        check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["steps"] == 2 and res["eval"]["games"] == 8
    code = ("import json, ray; ray.init(logging_level='ERROR', log_to_driver=False); "
            "t = ray.util.placement_group_table(); print(json.dumps("
            "{p['name']: sorted(set(p['bundles_to_node_id'].values())) for p in t.values()}))")
    probe = subprocess.run(
        [sys.executable, "-c", code],
        env=two_nodes, capture_output=True, text=True, timeout=120, check=True)
    groups = json.loads(probe.stdout.strip().splitlines()[-1])
    assert {"earl-trainer", "earl-rollout", "earl-producer", "earl-reference",
            "earl-dock"} <= set(groups)
    nodes = {n for ns in groups.values() for n in ns}
    assert len(nodes) == 2  # the job's actors were spread over both Ray nodes
