"""Weight pushes on GPUs through `WeightPublisher` and a replica's `WeightInbox` (the `Sink`
actor: RolloutActor's weight endpoints without vLLM): to a replica on the publisher's own GPU
the buckets go by CUDA IPC (chosen by GPU UUID under "auto"), two GPU buffers alternating with
each bucket acknowledged once loaded; to a replica on another GPU over NCCL (needs 2 GPUs)."""

from __future__ import annotations

import pytest
import torch
from weights_sink import Sink

from earl.runtime import Runtime
from earl.stages.weights import WeightPublisher

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = {f"layers.{i}.weight": torch.randn(256, 256, device="cuda", generator=g)
           for i in range(8)}
    out["embed.weight"] = torch.randn(1000, 64, device="cuda", generator=g)
    return out


async def test_a_replica_on_the_publishers_gpu_gets_buckets_by_cuda_ipc() -> None:
    async with Runtime() as rt:
        sink = await rt.spawn("sink", Sink, -1, "cuda")
        pub = WeightPublisher(sink, bucket_bytes=300_000)  # "auto": the replica chooses
        for version, dtype in ((1, None), (2, torch.bfloat16)):
            pub.dtype = dtype
            w = weights(version)
            sync = await pub.push(w, version=version)
            assert await sink[0].kind.call_one() == "ipc"
            assert sync.buckets > 2 and sync.by_transport == {"ipc": sync.nbytes}
            got = dict((await sink.received.call())[0])
            assert list(got) == list(w)
            for name, t in w.items():
                want = t.to(dtype) if dtype is not None else t
                assert got[name].dtype == want.dtype
                torch.testing.assert_close(got[name], want.cpu(), rtol=0, atol=0)
        pub.close()


async def test_a_replica_on_another_gpu_gets_buckets_over_nccl() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    async with Runtime() as rt:
        sink = await rt.spawn("sink", Sink, -1, "cuda", env={"CUDA_VISIBLE_DEVICES": "1"})
        pub = WeightPublisher(sink, bucket_bytes=300_000)
        w = weights(0)
        sync = await pub.push(w, version=1)
        assert sync.by_transport == {"nccl": sync.nbytes}
        got = dict((await sink.received.call())[0])
        for name, t in w.items():
            torch.testing.assert_close(got[name], t.cpu(), rtol=0, atol=0)
        pub.close()
