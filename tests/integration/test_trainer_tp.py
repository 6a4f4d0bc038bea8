"""Tensor parallel (DTensor plans over gloo) and resharding checkpoints on two CPU ranks.

TP=2 gives the loss, gradients, grad norm and step of one rank on the whole batch; a trainer
trained 2 steps with FSDP over 2 DP ranks, saved, and loaded at TP=2 (and at 1 rank) continues
with the Adam moments and weights of a run that never changed layout.
"""

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
LENGTHS = (12, 40, 7, 25, 60, 18, 33)


def make_batch(seed: int = 0) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, n in enumerate(LENGTHS):
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 - 0.7 * k),
                        "rollout_logprobs": -torch.rand(n, generator=g) * 6,
                        "ref_logprobs": -torch.rand(n, generator=g) * 6})
    return TrainBatch.from_samples(samples)


def _cfg(model: str, **kw: object) -> TrainerConfig:
    return TrainerConfig(model=model, optim=OptimConfig(lr=1e-3), loss=LossConfig(**LOSS), **kw)  # type: ignore[arg-type]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _moments(t: TorchTrainer) -> dict[str, torch.Tensor]:
    """Adam's exp_avg and exp_avg_sq of every parameter, full tensors, by parameter name."""
    out = {}
    for name, p in t.module.named_parameters():
        st = t.optimizer.state[p]
        out[f"{name}.exp_avg"] = _full(st["exp_avg"])
        out[f"{name}.exp_avg_sq"] = _full(st["exp_avg_sq"])
    return out


def _worker(rank: int, model: str, url: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    res: dict[str, object] = {}
    # TP=2, one replica: both ranks take the whole batch
    t = TorchTrainer(_cfg(model, tp=2, dist_url=url, micro_batch_tokens=80), rank=rank,
                     world_size=2)
    res["tp_metrics"] = t.accumulate(make_batch())
    res["tp_grads"] = {n: _full(p.grad) for n, p in t.module.named_parameters()}
    res["tp_step"] = t.optimizer_step()
    res["tp_weights"] = dict(t.named_weights())
    # FSDP over 2 DP ranks, 2 steps, then save: the layout to reshard from
    f = TorchTrainer(_cfg(model, parallel="fsdp", dist_url=url), rank=rank, world_size=2)
    for s in range(2):
        f.train_step(make_batch(s).split(2)[rank])
    f.save_checkpoint(Path(out) / "ck")
    # ... load at TP=2 and take a third step on the same data as the reference
    g = TorchTrainer(_cfg(model, tp=2, dist_url=url), rank=rank, world_size=2)
    g.load_checkpoint(Path(out) / "ck")
    res["resharded_step"] = g.step
    res["resharded_moments"] = _moments(g)
    g.train_step(make_batch(2))
    res["resharded_after"] = dict(g.named_weights())
    torch.save(res, Path(out) / f"rank{rank}.pt")
    t.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


@pytest.mark.timeout(240)
def test_tp2_matches_one_rank_and_reshards_adam_state(model_dir: Path, tmp_path: Path) -> None:
    url = free_dist_url()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(r, str(model_dir), url, str(tmp_path)))
             for r in range(2)]
    for p in procs:
        p.start()
    torch.set_num_threads(1)
    single = TorchTrainer(_cfg(str(model_dir)))
    m1 = single.accumulate(make_batch())
    g1 = {n: p.grad.detach().clone() for n, p in single.module.named_parameters()}
    s1 = single.optimizer_step()
    w1 = dict(single.named_weights())
    # the unresharded reference: 2 steps on the whole batches, its moments, a third step
    ref = TorchTrainer(_cfg(str(model_dir)))
    for s in range(2):
        ref.train_step(make_batch(s))
    ref_moments = _moments(ref)
    ref.train_step(make_batch(2))
    ref_after = dict(ref.named_weights())
    for p in procs:
        p.join(timeout=200)
        assert p.exitcode == 0, f"trainer rank exited with {p.exitcode}"
    for r in range(2):
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        for k in ("loss", "pg_loss", "kl", "entropy", "tokens", "samples"):
            assert res["tp_metrics"][k] == pytest.approx(m1[k], rel=1e-5), k
        for name, g in g1.items():
            torch.testing.assert_close(res["tp_grads"][name], g, atol=1e-6, rtol=1e-4,
                                       msg=lambda m, n=f"rank{r} {name}": f"{n}: {m}")
        assert res["tp_step"]["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-4)
        for name, w in w1.items():  # Adam's first update is ~lr * sign(g): with lr=1e-3 a
            # near-zero gradient turns float rounding into up to ~lr/10 in a few elements
            torch.testing.assert_close(res["tp_weights"][name], w, atol=1e-4, rtol=0)
        assert res["resharded_step"] == 2
        assert set(res["resharded_moments"]) == set(ref_moments)
        for name, m in ref_moments.items():
            assert m.abs().sum() > 0, name  # moments exist: a reset optimizer would fail here
            torch.testing.assert_close(res["resharded_moments"][name], m, atol=1e-6, rtol=1e-4,
                                       msg=lambda msg, n=f"rank{r} {name}": f"{n}: {msg}")
        for name, w in ref_after.items():
            torch.testing.assert_close(res["resharded_after"][name], w, atol=1e-4, rtol=1e-4)


def _worker_2d(rank: int, model: str, url: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    t = TorchTrainer(_cfg(model, tp=2, parallel="fsdp", dist_url=url), rank=rank, world_size=4)
    dp = rank // 2  # TP varies fastest: ranks (0, 1) are replica 0, (2, 3) replica 1
    metrics = t.accumulate(make_batch().split(2)[dp])
    grads = {n: _full(p.grad) for n, p in t.module.named_parameters()}
    step = t.optimizer_step()
    torch.save({"metrics": metrics, "grads": grads, "step": step,
                "weights": dict(t.named_weights())}, Path(out) / f"2d_rank{rank}.pt")
    t.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fsdp_x_tp_on_four_ranks_matches_one_rank(model_dir: Path, tmp_path: Path) -> None:
    url = free_dist_url()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_2d, args=(r, str(model_dir), url, str(tmp_path)))
             for r in range(4)]
    for p in procs:
        p.start()
    torch.set_num_threads(1)
    single = TorchTrainer(_cfg(str(model_dir)))
    m1 = single.accumulate(make_batch())
    g1 = {n: p.grad.detach().clone() for n, p in single.module.named_parameters()}
    s1 = single.optimizer_step()
    w1 = dict(single.named_weights())
    for p in procs:
        p.join(timeout=250)
        assert p.exitcode == 0, f"trainer rank exited with {p.exitcode}"
    for r in range(4):
        res = torch.load(tmp_path / f"2d_rank{r}.pt", weights_only=False)
        for k in ("loss", "pg_loss", "kl", "entropy", "tokens", "samples"):
            assert res["metrics"][k] == pytest.approx(m1[k], rel=1e-5), k
        for name, g in g1.items():
            torch.testing.assert_close(res["grads"][name], g, atol=1e-6, rtol=1e-4,
                                       msg=lambda m, n=f"rank{r} {name}": f"{n}: {m}")
        assert res["step"]["grad_norm"] == pytest.approx(s1["grad_norm"], rel=1e-4)
        for name, w in w1.items():
            torch.testing.assert_close(res["weights"][name], w, atol=1e-4, rtol=0)
