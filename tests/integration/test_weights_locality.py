"""Weight pushes pick each replica's transport by locality.

A replica that declares another host (`$EARL_HOST_ID`, runtime/locality.py) gets the trainer's
buckets over the network (ucx, or zmq when asked), authenticated under the run's secret; one
on the publisher's host keeps shm, and a group spread over both mixes them. The real vLLM
replica is in the slow tier (an engine start is ~15 s here).
"""

from __future__ import annotations

import pytest
import torch
from weights_sink import Sink

from earl.engine import SamplingParams
from earl.models.tiny import default_model_dir
from earl.runtime import Runtime, RuntimeConfig
from earl.runtime.locality import ENV_HOST_ID
from earl.runtime.transport import available
from earl.stages.compute import Compute
from earl.stages.weights import WeightPublisher

NET = "ucx" if available("ucx") else "zmq"
MODEL_A = {"init_std": 0.2, "seed": 0}
MODEL_B = {"init_std": 0.2, "seed": 1}
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


@pytest.mark.timeout(120)
async def test_a_group_over_two_hosts_mixes_shm_and_the_network() -> None:
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    async with Runtime(RuntimeConfig(tcp=True)) as rt:  # over TCP: the run has a secret
        sinks = await rt.spawn("sink", Sink, 1, n=2)
        pub = WeightPublisher(sinks, bucket_bytes=40_000)  # "auto": by each replica's host
        sync = await pub.push(weights, version=3)
        assert sync.buckets > 1
        assert sync.by_transport == {"shm": sync.nbytes, NET: sync.nbytes}
        assert sync.metrics()[f"transport/weights_bytes/{NET}"] == sync.nbytes
        for got in await sinks.received.call():
            assert [n for n, _ in got] == list(weights)
            for name, t in got:
                torch.testing.assert_close(t, weights[name])
        pub.close()


@pytest.mark.timeout(120)
async def test_gloo_pairs_carry_the_weights_keyed_per_publisher() -> None:
    """placement.weights_transport=gloo: a torch.distributed pair per replica, keyed with the
    publisher's secret (sent over the control plane), re-made for a new publisher."""
    weights = {f"layer{i}.weight": torch.randn(64, 64) for i in range(6)}
    async with Runtime() as rt:
        sinks = await rt.spawn("sink", Sink, n=2)
        for version in (1, 2):  # the second publisher: a restarted trainer
            pub = WeightPublisher(sinks, transport="gloo", bucket_bytes=40_000)
            sync = await pub.push(weights, version=version)
            assert sync.buckets > 1 and sync.by_transport == {"gloo": 2 * sync.nbytes}
            for got in await sinks.received.call():
                assert [n for n, _ in got] == list(weights)
                for name, t in got:
                    torch.testing.assert_close(t, weights[name])
            pub.close()


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
async def test_remote_rollout_replica_loads_weights_over_the_network() -> None:
    from safetensors.torch import load_file

    from earl.stages.rollout import RolloutActor
    from earl.stages.vllm_engine import EngineConfig

    cfg = EngineConfig(model=str(default_model_dir(**MODEL_A)), compute=Compute(dtype="float32"),
                       max_model_len=256, kv_cache_gb=0.125)
    prompt = [1, 50, 51, 52]
    async with Runtime(RuntimeConfig(tcp=True)) as rt:
        group = await rt.spawn("rollout", RolloutActor, cfg,
                               env={"OMP_NUM_THREADS": "1", ENV_HOST_ID: "host-b"})
        a = (await group[0].generate.call_one(prompt, GREEDY)).token_ids
        for transport, model, version in (("auto", MODEL_B, 7), ("zmq", MODEL_A, 8)):
            pub = WeightPublisher(group, transport=transport,  # type: ignore[arg-type]
                                  bucket_bytes=256 << 10)
            state = load_file(default_model_dir(**model) / "model.safetensors")
            sync = await pub.push(state, version=version, mode="drain")
            want = NET if transport == "auto" else transport
            assert sync.buckets > 1 and sync.by_transport == {want: sync.nbytes}
            gen = await group[0].generate.call_one(prompt, GREEDY)
            assert gen.versions[0] == version
            assert (gen.token_ids == a) == (model is MODEL_A)
            pub.close()
