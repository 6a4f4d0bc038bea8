"""The ray launcher across two namespace hosts (tests/hosts.py) with a real two-node Ray
cluster over their addresses: groups go to the host their Ray resource names, every actor binds
and advertises its own host's address (never loopback), and a process group whose ranks span
both hosts meets at rank 0's host."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hosts import hosts, ray_cluster, unavailable

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

JOB = Path(__file__).with_name("ray_hosts_job.py")


def test_ray_places_and_binds_by_host() -> None:
    with hosts(2, "ehr") as (a, b), ray_cluster([a, b], num_cpus=2) as cluster:
        p = a.run([sys.executable, str(JOB)], env=cluster.env, timeout=240)
    assert p.returncode == 0, p.stderr[-4000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    # the driver's directory is reachable from host b: it listens on host a's address
    assert out["directory"].startswith(f"tcp:{a.address}:")
    for name, h in (("on_b", b), ("on_a", a)):
        w = out[name]
        assert w["address"].startswith(f"tcp:{h.address}:"), w
        assert w["node"] == w["env"] == h.address
    assert out["on_b"]["host_id"] != out["driver_host_id"]  # really another host
    assert out["on_a"]["host_id"] == out["driver_host_id"]
    # the 2-rank group had to span both nodes (1 CPU left on each); it met at rank 0's host, over eth0
    ranks = out["pg_where"]
    assert {r["node"] for r in ranks} == {a.address, b.address}
    assert out["rendezvous"] == ranks[0]["node"]
    assert [r["sum"] for r in out["pg"]] == [3.0, 3.0]
    assert {r["ifname"] for r in out["pg"]} == {"eth0"}
