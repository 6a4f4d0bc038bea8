"""TrainerActor through the real runtime: 2 FSDP ranks train, export and push weights (through
one publisher kept for the trainer's life)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.runtime import Actor, ActorError, Runtime, endpoint
from earl.stages.compute import Compute
from earl.stages.optim import OptimConfig
from earl.stages.trainer import TrainBatch, TrainerActor, free_dist_url
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig
from earl.stages.weights import decode_bucket

pytestmark = pytest.mark.timeout(240)


class WeightSink(Actor):
    """Speaks the rollout side of the weight protocol (shm frames or RPC buckets), keeps them."""

    def __init__(self) -> None:
        self.staged: list[tuple[str, torch.Tensor]] = []
        self.receiver = None
        self.versions: list[int] = []
        self.modes: list[str] = []
        self.address_calls = 0

    @endpoint
    async def weights_address(self, peer_host: str = "", transport: str = "",
                              peer_gpu: str = "", key: bytes = b"") -> str:
        """Shared memory whatever the publisher asks (the test's pushes force shm)."""
        from earl.runtime.transport import get_transport

        self.address_calls += 1
        if self.receiver is None:
            self.receiver = get_transport("shm").listen()
        return str(self.receiver.address)

    @endpoint
    async def stage_bucket(self, names: list[str], tensors: list[torch.Tensor]) -> int:
        self.staged += [(n, t.clone()) for n, t in zip(names, tensors, strict=True)]
        return len(self.staged)

    @endpoint
    async def commit_weights(self, version: int, mode: str, frames: int) -> float:
        for _ in range(frames):
            frame = await asyncio.to_thread(self.receiver.recv, 30.0)  # type: ignore[union-attr]
            self.staged += [(n, t.clone()) for n, t in decode_bucket(frame.header, frame.buffers)]
            frame.release()
        self.versions.append(version)
        self.modes.append(mode)
        return 0.0

    @endpoint
    async def connects(self) -> int:
        """How often a publisher asked for the shm address (once per publisher)."""
        return self.address_calls

    @endpoint
    async def received(self) -> tuple[list[int], list[tuple[str, torch.Tensor]]]:
        out, self.staged = self.staged, []
        return self.versions, out

    @endpoint
    async def modes_seen(self) -> list[str]:
        return self.modes


def make_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, n in enumerate((12, 40, 7, 25)):
        mask = torch.zeros(n)
        mask[n // 2:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 if k % 2 else -1.0)})
    return TrainBatch.from_samples(samples)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


async def test_trainer_actor_fsdp_group(model_dir: Path, tmp_path: Path) -> None:
    async with Runtime() as rt:
        await _exercise(rt, model_dir, tmp_path)


async def _exercise(rt: Runtime, model_dir: Path, tmp_path: Path) -> None:
    cfg = TrainerConfig(model=str(model_dir), parallel="fsdp", dist_url=free_dist_url(),
                        compute=Compute(threads=1), optim=OptimConfig(lr=1e-3),
                        loss=LossConfig(entropy_coef=0.01))
    env = {"OMP_NUM_THREADS": "1"}
    trainers, sink = await asyncio.gather(
        rt.spawn("trainer", TrainerActor, cfg, n=2, env=env),
        rt.spawn("sink", WeightSink, env=env),
    )
    batch = make_batch()
    shards = batch.split(2)
    m0, m1 = await asyncio.gather(*(trainers[r].train_step.call_one(shards[r]) for r in range(2)))
    assert m0["loss"] == pytest.approx(m1["loss"]) and m0["samples"] == 4 and m0["step"] == 1
    assert await trainers.version.call() == [1, 1]

    assert await trainers[1].trainer_config.call_one() == cfg  # a typed record both ways
    modes = ("inflight", "inflight_keep_kv", "drain")  # passed through to every replica
    for transport, mode in zip(("shm", "shm", "rpc"), modes, strict=True):
        syncs = await trainers.push_weights.call(sink, version=7, transport=transport,
                                                 bucket_bytes=20_000, mode=mode)
        assert syncs[1] == {} and syncs[0]["version"] == 7 and syncs[0]["buckets"] > 1
        versions, got = await sink.received.call_one()
        assert versions[-1] == 7
        ours = dict((await trainers.named_weights.call())[0])  # FSDP: all ranks
        assert [n for n, _ in got] == list(ours) and "lm_head.weight" not in ours
        for name, t in got:
            torch.testing.assert_close(t, ours[name])
    assert await sink.connects.call_one() == 1  # two shm pushes, one publisher
    assert await sink.modes_seen.call_one() == list(modes)

    out, _ = await trainers.save_hf.call(str(tmp_path / "hf"))  # FSDP: every rank gathers
    lp = await asyncio.gather(*(trainers[r].compute_logprobs.call_one(shards[r]) for r in range(2)))
    local = TorchTrainer(TrainerConfig(model=out, compute=Compute(threads=1)))
    torch.testing.assert_close(torch.cat(lp), local.compute_logprobs(batch), atol=1e-5, rtol=1e-5)

    await trainers.close.call()
    with pytest.raises(ActorError, match="tp=2 does not divide world_size=1"):
        await rt.spawn("bad_trainer", TrainerActor, TrainerConfig(model=str(model_dir), tp=2))
