"""The trainer's data path and live resharding through the real runtime.

A TP=2 trainer group trains from the transfer dock on the dispatcher's plan (the replica leader
fetches, its TP peer gets the forwarded frames) with the numbers of one in-process trainer on
the same samples; it is then re-created at DP=2 (`reconfigure_trainer`): weights, step and
Adam state carry over, so the next step matches the in-process trainer that never changed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.runtime import Runtime
from earl.runtime.dock import Dock, IndexActor, WarehouseActor
from earl.runtime.layout import Layout
from earl.stages.compute import Compute
from earl.stages.optim import OptimConfig
from earl.stages.reconfigure import reconfigure_trainer
from earl.stages.trainer import TrainBatch, TrainerActor, free_dist_url
from earl.stages.trainer_batch import bound_staleness
from earl.stages.trainer_feed import train_from_dock
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

pytestmark = [pytest.mark.asyncio, pytest.mark.slow, pytest.mark.timeout(240)]
COLUMNS = ["input_ids", "loss_mask", "advantages"]
ENV = {"OMP_NUM_THREADS": "1"}


def samples(step: int) -> dict[str, dict[str, np.ndarray]]:
    g = np.random.default_rng(step)
    out = {}
    for k, n in enumerate((12, 40, 7, 25)):
        mask = np.zeros(n, np.int8)
        mask[n // 2:] = 1
        out[f"s{step}-{k}"] = {"input_ids": g.integers(7, 263, n).astype(np.int64),
                               "loss_mask": mask,
                               "advantages": np.full(n, 1.0 if k % 2 else -0.5, np.float32),
                               "versions": np.full(n, k, np.int32)}  # sampled by version k
    return out


def batch_of(step: int, token_floor: int | None = None) -> TrainBatch:
    data = samples(step)
    rows = [data[s] for s in sorted(data)]
    return TrainBatch.from_samples(rows if token_floor is None
                                   else bound_staleness(rows, token_floor)[0])


def config(model: Path, **kw: object) -> TrainerConfig:
    return TrainerConfig(model=str(model), compute=Compute(threads=1), optim=OptimConfig(lr=1e-3),
                         micro_batch_tokens=64, loss=LossConfig(entropy_coef=0.01),
                         **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


async def _put(warehouse, step: int) -> None:  # type: ignore[no-untyped-def]
    for sid, cols in samples(step).items():
        await warehouse[0].put.call_one(sid, cols, sid, 1)


async def test_tp_group_trains_from_the_dock_then_reshards_to_dp(model_dir: Path,
                                                                  tmp_path: Path) -> None:
    torch.set_num_threads(1)
    local = TorchTrainer(config(model_dir))
    async with Runtime() as rt:
        index, warehouse, trainer = await asyncio.gather(
            rt.spawn("dock", IndexActor, stages=["train"], capacity=64, env=ENV),
            rt.spawn("wh", WarehouseActor, "dock", env=ENV),
            rt.spawn("trainer", TrainerActor, config(model_dir, tp=2, dist_url=free_dist_url()),
                     n=2, env=ENV))
        dock = Dock(index)
        assert await trainer[0].layout.call_one() == Layout(dp=1, tp=2)
        for step in range(2):
            await _put(warehouse, step)
            got = await train_from_dock(trainer, dock, 4, COLUMNS)
            want = local.train_step(batch_of(step))
            for k in ("loss", "pg_loss", "entropy", "tokens", "samples", "grad_norm"):
                assert got[k] == pytest.approx(want[k], rel=1e-4), (step, k)
        assert (await dock.statistics()).leased == 0  # acked
        before = dict((await trainer.named_weights.call())[0])  # TP: every rank gathers

        trainer, times = await reconfigure_trainer(rt, trainer, Layout(dp=2),
                                                   checkpoint_dir=tmp_path / "ck", env=ENV,
                                                   micro_batch_tokens=48)
        assert await trainer.version.call() == [2, 2]
        assert (await trainer[1].trainer_config.call_one()).micro_batch_tokens == 48
        assert await trainer[0].layout.call_one() == Layout(dp=2, tp=1)
        after = dict(await trainer[0].named_weights.call_one())  # DDP: rank 0 alone
        for name, w in before.items():
            torch.testing.assert_close(after[name], w, atol=0, rtol=0)
        assert min(times.save_s, times.stop_s, times.spawn_s, times.load_s) > 0
        assert times.push_s == 0 and times.total_s > times.spawn_s

        await _put(warehouse, 2)  # each DP leader fetches its half of this step's samples
        # the staleness bound: samples 0 and 1 (versions 0, 1) leave the loss, 2 and 3 train
        got = await train_from_dock(trainer, dock, 4, COLUMNS, token_floor=2)
        want = local.train_step(batch_of(2, token_floor=2))
        assert got["step"] == 3 and got["samples"] == 4 and got["dispatch_replicas"] == 2
        assert got["stale_tokens"] == 6 + 20 and got["oldest_version"] == 2  # both replicas
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        final = dict(await trainer[0].named_weights.call_one())
        for name, w in local.named_weights():  # Adam moments carried over: same update
            torch.testing.assert_close(final[name], w, atol=2e-5, rtol=1e-4)
        await trainer.close.call()
