"""Megatron-core pipeline parallel over gloo: PP stages equal one rank (TP=1, PP=1) on the same
data — log-probs, loss, gradient norm (with clipping active) and the exported HF weights after
one step — for two stages (tied and untied LM head: a tied model's last stage keeps an
embedding copy in step), 2 TP x 2 PP ranks, and 2 DP x 2 PP ranks (gradients summed over
megatron's data-parallel groups, each replica on half the batch); and a PP checkpoint (a shard
file per TP x PP rank) that replays the next step exactly."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch
from test_megatron_tp import OPTIM, _batch, _config, one_rank_beside

from earl.models.tiny import build_tiny_model
from earl.stages.trainer_dist import free_dist_url


def _worker(rank: int, world: int, tp: int, model: str, url: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from earl.stages.trainer_megatron import MegatronTrainer

    dp = world // (tp * 2)
    t = MegatronTrainer(_config(model, tp=tp, pp=2, dist_url=url), rank=rank, world_size=world)
    batch = _batch().split(dp)[(rank // tp) % dp]  # every rank of a replica: the same shard
    res: dict[str, object] = {"logprobs": t.compute_logprobs(batch)}
    res["layers"] = len(t.module.decoder.layers)  # type: ignore[union-attr,arg-type]
    res["metrics"] = t.train_step(batch)
    res["weights"] = {n: w.clone() for n, w in t.named_weights()}
    res["logprobs_after"] = t.compute_logprobs(batch)
    t.save_checkpoint(Path(out) / "ck")
    res["next"] = t.train_step(batch)
    t.load_checkpoint(Path(out) / "ck")
    res["replayed"] = t.train_step(batch)
    torch.save(res, Path(out) / f"rank{rank}.pt")
    t.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("world", "tp", "tied"),
                         [(2, 1, True), (2, 1, False), (4, 2, True), (4, 1, False)],
                         ids=["pp2-tied", "pp2-untied", "tp2xpp2", "dp2xpp2"])
def test_pp_matches_one_rank(world: int, tp: int, tied: bool, tmp_path: Path) -> None:


    model_dir = build_tiny_model(tmp_path / "tiny", hidden=64, layers=4, heads=4, kv_heads=2,
                                 intermediate=128, max_positions=512, tie_embeddings=tied)
    url = free_dist_url()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, world, tp, str(model_dir), url, str(tmp_path)))
             for r in range(world)]
    lp, metrics, weights, lp_after = one_rank_beside(procs, model_dir)
    assert metrics["grad_norm"] > OPTIM["grad_clip"]  # clipping was active
    dp = world // (tp * 2)
    shards = _batch().split(dp)
    cut = [0, *torch.tensor([s.num_tokens for s in shards]).cumsum(0).tolist()]
    worst: dict[str, float] = {}
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert res["layers"] == 2  # 4 layers over 2 stages
        assert res["metrics"]["micro_batches"] >= 2  # several micro-batches in the pipeline
        replica = (r // tp) % dp
        mine = slice(cut[replica], cut[replica + 1])  # this replica's tokens
        torch.testing.assert_close(res["logprobs"], lp[mine], atol=1e-4, rtol=0)
        torch.testing.assert_close(res["logprobs_after"], lp_after[mine], atol=1e-4, rtol=0)
        worst["logprobs"] = max(worst.get("logprobs", 0.0),
                                float((res["logprobs_after"] - lp_after[mine]).abs().max()))
        for k in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "tokens"):
            assert res["metrics"][k] == pytest.approx(metrics[k], rel=1e-4), (r, k)
            worst[k] = max(worst.get(k, 0.0), abs(res["metrics"][k] / metrics[k] - 1))
        for k in ("loss", "grad_norm", "step"):
            assert res["replayed"][k] == res["next"][k], (r, k)
        assert set(res["weights"]) == set(weights)
        for name, w in weights.items():
            diff = float((res["weights"][name] - w).abs().max())
            worst["weights"] = max(worst.get("weights", 0.0), diff)
            assert diff <= 1e-5, f"rank{r} {name}: max |PP - one rank| = {diff:.2e}"
    print(f"max differences vs one rank ({world} ranks, tp={tp}, pp=2): {worst}")
