"""This machine's roofs, measured: fp32 matmul GFLOP/s (training, prefill) and memcpy GB/s (a
decode step reads the weights and the KV cache). The benchmarks that compare against the
physical limit, or against a run saved on another machine, share these probes."""

from __future__ import annotations

import time


def matmul_gflops(n: int = 1024, reps: int = 10) -> float:
    """An n x n fp32 matmul with torch's threads, fastest of `reps` after a warm-up."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times) / 1e9


def memcpy_gbps(nbytes: int, reps: int) -> float:
    """Bytes copied per second (one copy of `nbytes`, one core), fastest of `reps` after a
    warm-up."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.ones(nbytes, np.uint8)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / min(times[1:]) / 1e9
