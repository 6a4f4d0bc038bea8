"""bench/dispatch.py runs end to end on tiny sizes and prints the keys the issue names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "dispatch.py"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dispatch_bench_json_keys():
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--quick", "--size-mib", "4", "--layout-mib", "16",
         "--no-ray"],
        capture_output=True, text=True, timeout=170, check=True,
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["memcpy_GBps"] > 0
    assert set(res["transfer_GBps"]) == {"shm", "ucx", "gloo", "zmq"}
    assert res["transfer_GBps"]["shm"] > 0
    assert res["ray_handoff_GBps"] is None
    lay = res["layout"]
    assert lay["decentralized_s"] > 0 and lay["single_controller_s"] > 0
    rss = lay["driver_peak_rss_MB"]
    # the single controller holds the data; the decentralized driver only metadata
    assert rss["single_controller"] > rss["decentralized"] + 16 * 0.9
