"""bench/dispatch.py --quick end to end on small sizes: its JSON schema and the invariants that
tie its figures together (slow tier)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hosts import unavailable

BENCH = Path(__file__).resolve().parents[2] / "bench" / "dispatch.py"
MiB = 1 << 20


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dispatch_bench_quick() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick", "--size-mib", "4", "--layout-mib", "16",
         "--no-ray"],
        capture_output=True, text=True, timeout=230, check=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["size_bytes"] == 4 * MiB
    tr = res["transfer_GBps"]
    assert set(tr) == {"shm", "ucx", "gloo", "zmq"}
    assert all(isinstance(v, float) and v > 0 for v in tr.values())  # ucxx is a dependency
    best = max(tr, key=tr.__getitem__)
    assert res["best_transport"] == best
    assert res["best_vs_memcpy"] == pytest.approx(tr[best] / res["memcpy_GBps"], abs=2e-3)
    assert set(res["zero_copy_handoff_GBps"]) == {"shm"}
    assert res["zero_copy_handoff_GBps"]["shm"] > 0
    assert res["ray_put_get_GBps"] is None and "ray_handoff_GBps" not in res
    lay = res["layout"]
    assert lay["layout"] == "DP=2xTP=2" and lay["producers"] == 2 and lay["transport"] == "shm"
    # the experience is every sample's six columns: 8+1+4+4+4+4 bytes per token
    assert lay["bytes"] == lay["samples"] * lay["seq_len"] * 25 <= 16 * MiB
    for mode in ("decentralized", "single_controller"):
        reps = lay[f"{mode}_s_reps"]
        assert len(reps) == 3 and lay[f"{mode}_s"] == pytest.approx(statistics.median(reps))
    assert lay["speedup"] == pytest.approx(lay["single_controller_s"] / lay["decentralized_s"],
                                           rel=0.05, abs=0.01)
    rss = lay["driver_peak_rss_MB"]
    # the single controller holds the data; the decentralized driver only metadata
    assert rss["single_controller"] > rss["decentralized"] + lay["bytes"] / MiB * 0.9


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.timeout(300)
@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_dispatch_bench_cross_host() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick", "--cross-host-only",
         "--cross-host-mib", "8"],
        capture_output=True, text=True, timeout=290, check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])["cross_host"]
    assert res["layout"] == "DP=2xTP=2" and res["producers"] == 2
    assert res["hosts"]["producers"] != res["hosts"]["trainer"]
    # the experience is every sample's six columns: 8+1+4+4+4+4 bytes per token
    assert res["bytes"] == res["samples"] * res["seq_len"] * 25 <= 8 * MiB
    # every consumer checksummed every byte of its DP half (a mismatch fails the run)
    assert res["bytes_checked"] == {"decentralized": 2 * res["bytes"],
                                    "single_controller": 2 * res["bytes"]}
    ucx = importlib.util.find_spec("ucxx") is not None
    assert res["transport"] == ("ucx" if ucx else "zmq") and res["tp_transport"] == "shm"
    for mode in ("decentralized", "single_controller", "single_controller_own_host"):
        st = res[mode]
        assert len(st["reps"]) == 3 and st["median"] == pytest.approx(statistics.median(st["reps"]))
        assert st["min"] == min(st["reps"]) and st["max"] == max(st["reps"])
        assert res[f"{mode}_s"] == st["median"] > 0
        if mode in res["driver_peak_rss_MB"]:
            assert res["driver_peak_rss_MB"][mode]["run"] > 0
    assert res["speedup"] == pytest.approx(res["single_controller_s"] / res["decentralized_s"],
                                           rel=0.05, abs=0.01)
    assert res["speedup_own_host"] == pytest.approx(
        res["single_controller_own_host_s"] / res["decentralized_s"], rel=0.05, abs=0.01)
    assert res["tcp_bytes"] == res["bytes"] and res["tcp_GBps"] > 0 and res["mac_GBps"] > 0
