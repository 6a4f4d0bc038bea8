"""Trainer -> rollout weight push on one GPU: CUDA IPC (colocated) against the host path.

A state dict of `--mib` MiB (fp32, on the GPU, as a trainer rank holds it) is pushed with
`WeightPublisher` to a replica process on the same GPU (`GpuSink`: RolloutActor's weight
endpoints and `WeightInbox`, without vLLM) that copies every tensor into its own preallocated
GPU parameters, as vLLM's loader does, and synchronizes before it answers. Two paths:

- ``ipc``: buckets copied into two alternating GPU buffers whose CUDA IPC handles the replica
  maps (placement.weights_transport=ipc, the colocated default);
- ``shm``: the host path every push took before: GPU -> host buffer -> shared memory ->
  replica -> its GPU.

The physical limit in the same run: one device-to-device copy of the same bytes (the IPC
path does two: into the bucket buffer, then into the parameters). Needs CUDA; without it
prints {"skipped": ...}.

    python bench/weights_gpu.py --json [--mib 512 --repeats 5] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _results

from earl.runtime import Actor, endpoint
from earl.stages.weights_inbox import WeightEndpoints, WeightInbox


class GpuSink(WeightEndpoints, Actor):
    """A replica's weight endpoints that load into GPU parameters (what vLLM's loader does)."""

    def __init__(self) -> None:
        self.weights = WeightInbox("cuda")
        self.params: dict[str, Any] = {}

    @endpoint
    async def commit_weights(self, version: int, mode: str, frames: int) -> float:
        import torch

        def load() -> float:
            t0, got = time.perf_counter(), []
            try:
                for name, t in self.weights.stream(frames, got):
                    p = self.params.get(name)
                    if p is None or p.shape != t.shape or p.dtype != t.dtype:
                        p = self.params[name] = torch.empty(t.shape, dtype=t.dtype,
                                                            device="cuda")
                    p.copy_(t, non_blocking=True)
                torch.cuda.synchronize()
            finally:
                for f in got:
                    f.release()
            return time.perf_counter() - t0

        return await asyncio.to_thread(load)

    @endpoint
    async def checksum(self) -> float:
        return float(sum(p.double().sum().item() for p in self.params.values()))


def state(mib: int) -> dict[str, Any]:
    import torch

    n, per = 32, (mib << 20) // 32 // 4
    g = torch.Generator(device="cuda").manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(per, device="cuda", generator=g) for i in range(n)}


def d2d_seconds(weights: dict[str, Any], repeats: int) -> list[float]:
    import torch

    dst = {k: torch.empty_like(v) for k, v in weights.items()}
    out = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k, v in weights.items():
            dst[k].copy_(v, non_blocking=True)
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out[1:]


async def run(mib: int, repeats: int, bucket_mib: int) -> dict[str, Any]:
    import torch

    from earl.runtime import Runtime
    from earl.stages.weights import WeightPublisher

    weights = state(mib)
    nbytes = sum(v.numel() * v.element_size() for v in weights.values())
    want = float(sum(v.double().sum().item() for v in weights.values()))
    out: dict[str, Any] = {"mib": mib, "bytes": nbytes, "bucket_mib": bucket_mib,
                           "repeats": repeats, "gpu": torch.cuda.get_device_name(0)}
    async with Runtime() as rt:
        sink = await rt.spawn("sink", GpuSink)
        for kind in ("ipc", "shm"):
            pub = WeightPublisher(sink, transport=kind,  # type: ignore[arg-type]
                                  bucket_bytes=bucket_mib << 20)
            secs = []
            for version in range(repeats + 1):  # the first warms buffers and mappings
                sync = await pub.push(weights, version=version)
                secs.append(sync.seconds)
            pub.close()
            ok = abs(await sink[0].checksum.call_one() - want) <= 1e-6 * abs(want) + 1e-3
            s = secs[1:]
            out[kind] = {"seconds_median": statistics.median(s), "seconds_min": min(s),
                         "seconds_max": max(s), "gb_per_s": nbytes / statistics.median(s) / 1e9,
                         "by_transport": sync.by_transport, "checksum_ok": ok}
    d2d = d2d_seconds(weights, repeats)
    out["d2d_copy"] = {"seconds_median": statistics.median(d2d),
                       "gb_per_s": nbytes / statistics.median(d2d) / 1e9}
    out["ipc_vs_shm"] = out["shm"]["seconds_median"] / out["ipc"]["seconds_median"]
    out["ipc_vs_d2d_copy"] = out["ipc"]["seconds_median"] / out["d2d_copy"]["seconds_median"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mib", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mib", type=int, default=64)
    _results.add_flag(ap)
    args = ap.parse_args()
    begun = _results.start()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "needs CUDA (a GPU shared by trainer and rollout)"}))
        return
    result = asyncio.run(run(args.mib, args.repeats, args.bucket_mib))
    print(json.dumps(result, indent=1 if args.json else None))
    if args.save:
        print(_results.save("weights_gpu", result, quick=False, begun=begun), file=sys.stderr)


if __name__ == "__main__":
    main()
