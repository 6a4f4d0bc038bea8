"""Two trainer ranks over gloo (DDP, FSDP2, megatron-core + DDP) give the gradients of one rank
on all the data."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.stages.optim import OptimConfig
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_dist import free_dist_url
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

LOSS = {"agg": "seq-mean-token-mean", "kl_coef": 0.05, "entropy_coef": 0.01, "off_policy": "tis"}
LENGTHS = (12, 40, 7, 25, 60, 18, 33)  # uneven shards: rank 0 gets 4 samples, rank 1 gets 3


def make_batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, n in enumerate(LENGTHS):
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 - 0.7 * k),
                        "rollout_logprobs": -torch.rand(n, generator=g) * 6,
                        "ref_logprobs": -torch.rand(n, generator=g) * 6})
    return TrainBatch.from_samples(samples)


def _full_grads(t: TorchTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in t.module.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return out


def _worker(rank: int, model: str, url: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    shard = make_batch().split(2)[rank]
    # a tiny budget on rank 0 only: the ranks run different micro-batch counts (padding path)
    results: dict[str, object] = {}
    for parallel in ("ddp", "fsdp"):
        cfg = TrainerConfig(model=model, parallel=parallel, dist_url=url, optim=OptimConfig(lr=1e-3),  # type: ignore[arg-type]
                            micro_batch_tokens=40 if rank == 0 else 4096, loss=LossConfig(**LOSS))
        t = TorchTrainer(cfg, rank=rank, world_size=2)
        metrics = t.accumulate(shard)
        results[f"{parallel}_grads"] = _full_grads(t)
        results[f"{parallel}_metrics"] = metrics
        results[f"{parallel}_step"] = t.optimizer_step()
        results[f"{parallel}_logprobs"] = t.compute_logprobs(shard)
        results[f"{parallel}_weights"] = {n: w.clone() for n, w in t.named_weights()}
        t.save_checkpoint(Path(out) / f"ck_{parallel}")
        t.load_checkpoint(Path(out) / f"ck_{parallel}")
        results[f"{parallel}_reloaded"] = {n: w.clone() for n, w in t.named_weights()}
    # megatron-core backend: parallel_state over the same 2-rank gloo group, torch DDP
    from earl.stages.trainer_megatron import MegatronTrainer
    from earl.stages.trainer_megatron_convert import mcore_to_hf

    cfg = TrainerConfig(model=model, dist_url=url, micro_batch_tokens=40 if rank == 0 else 4096,
                        loss=LossConfig(**LOSS))
    mt = MegatronTrainer(cfg, rank=rank, world_size=2)
    results["megatron_metrics"] = mt.accumulate(shard)
    results["megatron_grads"] = mcore_to_hf(
        {k: p.grad.clone() for k, p in mt.module.named_parameters()}, mt.shape)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    t.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


@pytest.mark.timeout(240)
def test_two_ranks_match_one_rank(model_dir: Path, tmp_path: Path) -> None:
    url = free_dist_url()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(model_dir), url, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    # meanwhile, the single-rank reference on the whole batch
    torch.set_num_threads(1)
    batch = make_batch()
    single = TorchTrainer(TrainerConfig(model=str(model_dir), optim=OptimConfig(lr=1e-3), loss=LossConfig(**LOSS)))
    m_single = single.accumulate(batch)
    g_single = _full_grads(single)
    step_single = single.optimizer_step()
    w_single = dict(single.named_weights())
    lp_single = single.compute_logprobs(batch)
    for p in procs:
        p.join(timeout=200)
        assert p.exitcode == 0, f"trainer rank exited with {p.exitcode}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    cut = make_batch().split(2)[0].num_tokens
    for parallel in ("ddp", "fsdp", "megatron"):
        for r in range(2):
            res = ranks[r]
            for name, g in g_single.items():
                if parallel == "megatron" and name == "lm_head.weight":
                    continue  # tied to embed_tokens: megatron has one tensor
                torch.testing.assert_close(res[f"{parallel}_grads"][name], g, atol=1e-6, rtol=1e-4,
                                           msg=lambda m, n=f"{parallel} rank{r} {name}": f"{n}: {m}")
            metrics = res[f"{parallel}_metrics"]
            for k in ("loss", "pg_loss", "kl", "entropy", "tokens", "samples"):
                assert metrics[k] == pytest.approx(m_single[k], rel=1e-5), (parallel, k)
            if parallel == "megatron":
                continue
            assert res[f"{parallel}_step"]["grad_norm"] == pytest.approx(
                step_single["grad_norm"], rel=1e-4)
            for name, w in w_single.items():
                torch.testing.assert_close(res[f"{parallel}_weights"][name], w, atol=1e-5, rtol=0)
                torch.testing.assert_close(res[f"{parallel}_reloaded"][name],
                                           res[f"{parallel}_weights"][name], atol=0, rtol=0)
        if parallel == "megatron":
            continue
        lp = torch.cat([ranks[0][f"{parallel}_logprobs"], ranks[1][f"{parallel}_logprobs"]])
        assert ranks[0][f"{parallel}_logprobs"].numel() == cut
        torch.testing.assert_close(lp, lp_single, atol=1e-5, rtol=1e-5)
