"""Megatron-core tensor parallel over gloo: TP ranks equal one rank (TP=1) on the same data —
log-probs, loss, gradient norm (with clipping active) and the exported HF weights after one
step; for two TP ranks of one replica (tied and untied LM head) and for 2 DP x 2 TP ranks
(DDP over megatron's data-parallel groups, each replica on half the batch); and a TP checkpoint
(a shard file per TP rank) that replays the next step exactly."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.stages.compute import Compute
from earl.stages.optim import OptimConfig
from earl.stages.trainer_dist import free_dist_url
from earl.stages.trainer_torch import TrainerConfig

LOSS = {"agg": "seq-mean-token-mean", "kl_coef": 0.05, "entropy_coef": 0.01, "off_policy": "tis"}
OPTIM = {"lr": 1e-3, "grad_clip": 0.05}  # small: the clipping path runs


def _batch():  # type: ignore[no-untyped-def]
    from test_trainer_dist import make_batch

    return make_batch()


def _config(model: str, **kw: object) -> TrainerConfig:
    return TrainerConfig(model=model, micro_batch_tokens=80, loss=LossConfig(**LOSS),  # type: ignore[arg-type]
                         optim=OptimConfig(**OPTIM), compute=Compute(threads=1),
                         **kw)  # type: ignore[arg-type]


def _worker(rank: int, world: int, model: str, url: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from earl.stages.trainer_megatron import MegatronTrainer

    t = MegatronTrainer(_config(model, tp=2, dist_url=url), rank=rank, world_size=world)
    batch = _batch().split(world // 2)[rank // 2]  # TP ranks of one replica: the same shard
    res: dict[str, object] = {"logprobs": t.compute_logprobs(batch)}
    res["local_shape"] = tuple(
        t.module.state_dict()["decoder.layers.0.mlp.linear_fc1.weight"].shape)
    res["metrics"] = t.train_step(batch)
    res["weights"] = {n: w.clone() for n, w in t.named_weights()}
    res["logprobs_after"] = t.compute_logprobs(batch)
    # a TP checkpoint (one shard file per TP rank) restores model, AdamW and schedule: the
    # step after a load is the step that followed the save
    t.save_checkpoint(Path(out) / "ck")
    res["next"] = t.train_step(batch)
    t.load_checkpoint(Path(out) / "ck")
    res["replayed"] = t.train_step(batch)
    torch.save(res, Path(out) / f"rank{rank}.pt")
    t.close()


def one_rank_beside(procs: list[Any], model_dir: Path) -> tuple[Any, dict[str, float],
                                                                dict[str, torch.Tensor], Any]:
    """Start the multi-rank `procs` and, meanwhile, the same step on one rank (TP = PP = 1) in
    this process; wait for the ranks. Returns that rank's log-probs, step metrics, exported
    weights and log-probs after the step."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from earl.stages.trainer_megatron import MegatronTrainer

    for p in procs:
        p.start()
    torch.set_num_threads(1)
    batch = _batch()
    try:
        single = MegatronTrainer(_config(str(model_dir)))
        lp = single.compute_logprobs(batch)
        metrics = single.train_step(batch)
        weights = dict(single.named_weights())
        lp_after = single.compute_logprobs(batch)
    finally:
        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return lp, metrics, weights, lp_after


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "tied"), [(2, True), (2, False), (4, True)],
                         ids=["tp2-tied", "tp2-untied", "dp2xtp2"])
def test_tp_matches_one_rank(world: int, tied: bool, tmp_path: Path) -> None:


    model_dir = build_tiny_model(tmp_path / "tiny", hidden=64, layers=2, heads=4, kv_heads=2,
                                 intermediate=128, max_positions=512, tie_embeddings=tied)
    url = free_dist_url()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, str(model_dir), url, str(tmp_path)))
             for r in range(world)]
    lp, metrics, weights, lp_after = one_rank_beside(procs, model_dir)
    assert metrics["grad_norm"] > OPTIM["grad_clip"]  # clipping was active
    shards = _batch().split(world // 2)
    cut = [0, *torch.tensor([s.num_tokens for s in shards]).cumsum(0).tolist()]
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert res["local_shape"] == (128, 64)  # [gate; up] shards: 2 * 128 / 2 rows
        mine = slice(cut[r // 2], cut[r // 2 + 1])  # this replica's tokens
        torch.testing.assert_close(res["logprobs"], lp[mine], atol=1e-4, rtol=0)
        torch.testing.assert_close(res["logprobs_after"], lp_after[mine], atol=1e-4, rtol=0)
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "tokens"):
            assert res["metrics"][k] == pytest.approx(metrics[k], rel=1e-4), (r, k)
        for k in ("loss", "grad_norm", "step"):
            assert res["replayed"][k] == res["next"][k], (r, k)
        assert set(res["weights"]) == set(weights)
        for name, w in weights.items():
            diff = float((res["weights"][name] - w).abs().max())
            assert diff <= 1e-5, f"rank{r} {name}: max |TP - TP=1| = {diff:.2e}"
