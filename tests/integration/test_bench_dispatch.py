"""bench/dispatch.py --quick end to end on small sizes: its JSON schema and the invariants that
tie its figures together (slow tier)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

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
