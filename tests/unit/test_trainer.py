"""TorchTrainer in-process: packing invariance, learning, checkpoints, weight export, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.stages.compute import Compute
from earl.stages.optim import OptimConfig
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


def make_batch(seed: int = 0, lengths: tuple[int, ...] = (12, 40, 7, 25, 60, 18)) -> TrainBatch:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for k, n in enumerate(lengths):
        ids = torch.randint(7, 263, (n,), generator=g)
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        adv = torch.full((n,), 1.0 if k % 2 == 0 else -0.5)
        samples.append({"input_ids": ids, "loss_mask": mask, "advantages": adv,
                        "rollout_logprobs": -torch.rand(n, generator=g) * 6,
                        "ref_logprobs": -torch.rand(n, generator=g) * 6})
    return TrainBatch.from_samples(samples)


def grads(trainer: TorchTrainer) -> list[torch.Tensor]:
    return [p.grad.clone() for p in trainer.module.parameters()]


def trainer(model_dir: Path, **kw: object) -> TorchTrainer:
    kw.setdefault("compute", Compute(threads=1))
    optim = OptimConfig(**{k: kw.pop(k) for k in ("lr", "warmup_steps", "grad_clip")  # type: ignore[arg-type]
                           if k in kw})
    return TorchTrainer(TrainerConfig(model=str(model_dir), optim=optim, **kw))  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_gradients_do_not_depend_on_micro_batching(model_dir: Path, agg: str) -> None:
    loss = LossConfig(agg=agg, kl_coef=0.1, entropy_coef=0.01, off_policy="tis")  # type: ignore[arg-type]
    batch = make_batch()
    whole = trainer(model_dir, micro_batch_tokens=10_000, loss=loss, attention="mask")
    m_whole = whole.accumulate(batch)
    small = trainer(model_dir, micro_batch_tokens=64, loss=loss)
    m_small = small.accumulate(batch)
    assert m_whole["micro_batches"] == 1 and m_small["micro_batches"] >= 3
    for a, b in zip(grads(whole), grads(small), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    for k in ("loss", "pg_loss", "kl", "entropy", "is_weight"):
        assert m_whole[k] == pytest.approx(m_small[k], rel=1e-5, abs=1e-7), k


def test_compute_logprobs_matches_plain_forward(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    batch = make_batch(lengths=(5, 30, 11))
    t = trainer(model_dir, micro_batch_tokens=32, loss=LossConfig(temperature=0.7))
    lp = t.compute_logprobs(batch)
    ref = AutoModelForCausalLM.from_pretrained(model_dir)
    cu = batch.cu_seqlens.tolist()
    for i in range(batch.num_samples):
        ids = batch.input_ids[cu[i]:cu[i + 1]]
        with torch.no_grad():
            logits = ref(input_ids=ids[None]).logits[0] / 0.7
        expect = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
        assert lp[cu[i]] == 0.0
        torch.testing.assert_close(lp[cu[i] + 1:cu[i + 1]], expect, atol=1e-5, rtol=1e-5)


def test_train_step_raises_logprob_of_positive_advantage_tokens(model_dir: Path) -> None:
    batch = make_batch()
    t = trainer(model_dir, lr=3e-3)
    before = t.compute_logprobs(batch)
    for _ in range(4):
        m = t.train_step(batch)
    after = t.compute_logprobs(batch)
    delta = (after - before) * batch.loss_mask
    pos = batch.advantages > 0
    assert delta[pos].sum() > 0.5 and delta[~pos].sum() < -0.1
    assert m["step"] == 4 and t.step == 4 and m["grad_norm"] > 0
    assert m["tokens"] == batch.num_tokens and m["samples"] == batch.num_samples


def test_lr_scale_scales_one_step_and_leaves_the_schedule(model_dir: Path) -> None:
    t = trainer(model_dir, lr=1e-3, warmup_steps=4)
    before = [p.detach().clone() for p in t.module.parameters()]
    assert t.train_step(make_batch(), lr_scale=0.5)["lr"] == pytest.approx(0.25e-3 * 0.5)
    assert any(not torch.equal(a, p) for a, p in zip(before, t.module.parameters(), strict=True))
    assert t.train_step(make_batch(1))["lr"] == pytest.approx(0.5e-3)  # warmup step 2, unscaled
    assert t.optimizer.param_groups[0]["lr"] == pytest.approx(0.75e-3)  # the schedule's next


def test_bf16_autocast_close_to_fp32(model_dir: Path) -> None:
    batch = make_batch(lengths=(20, 9))
    lp32 = trainer(model_dir).compute_logprobs(batch)
    t16 = trainer(model_dir, compute=Compute(threads=1, dtype="bfloat16"))
    lp16 = t16.compute_logprobs(batch)
    assert lp16.dtype == torch.float32
    torch.testing.assert_close(lp16, lp32, atol=0.15, rtol=0.05)
    assert t16.train_step(batch)["grad_norm"] > 0
    assert all(p.dtype == torch.float32 for p in t16.module.parameters())


def test_checkpoint_resume_reproduces_next_step(model_dir: Path, tmp_path: Path) -> None:
    batch = make_batch()
    a = trainer(model_dir, lr=1e-3, warmup_steps=3)
    a.train_step(batch)
    a.train_step(batch)
    a.save_checkpoint(tmp_path / "ck")
    torch.manual_seed(123)
    a.train_step(batch)
    expected = [p.detach().clone() for p in a.module.parameters()]
    rng_after = torch.rand(3)

    b = trainer(model_dir, lr=1e-3, warmup_steps=3)
    b.load_checkpoint(tmp_path / "ck")
    assert b.step == 2
    torch.manual_seed(123)
    b.train_step(batch)
    for x, y in zip(expected, b.module.parameters(), strict=True):
        torch.testing.assert_close(x, y.detach(), atol=0, rtol=0)
    b.load_checkpoint(tmp_path / "ck")  # RNG restored to the state at save time
    c = torch.rand(3)
    b.load_checkpoint(tmp_path / "ck")
    torch.testing.assert_close(torch.rand(3), c)
    assert not torch.equal(c, rng_after)
    with pytest.raises(ValueError, match="trainer.pt"):
        b.load_checkpoint(tmp_path / "nothing")


def test_named_weights_and_save_hf_round_trip(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    t = trainer(model_dir, lr=1e-3)
    batch = make_batch(lengths=(15, 22))
    t.train_step(batch)
    names = [n for n, _ in t.named_weights()]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied
    assert "model.layers.1.mlp.down_proj.weight" in names
    buckets = list(t.weight_buckets(bucket_bytes=30_000))
    assert len(buckets) > 1 and [n for b in buckets for n, _ in b] == names
    out = t.save_hf(tmp_path / "hf")
    assert (out / "tokenizer.json").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(out)
    sd = reloaded.state_dict()
    for name, tensor in t.named_weights():
        torch.testing.assert_close(sd[name], tensor)
    u = trainer(out)
    torch.testing.assert_close(u.compute_logprobs(batch), t.compute_logprobs(batch))


def test_trainbatch_building_and_errors() -> None:
    b = TrainBatch.from_samples([
        {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "advantages": [0.0, 1.0, 1.0]},
        {"input_ids": [5, 8], "loss_mask": [0, 1], "advantages": [0.0, -1.0]},
        {"input_ids": [9], "loss_mask": [1], "advantages": [2.0]},
    ])
    assert (b.num_samples, b.num_tokens) == (3, 6) and b.rollout_logprobs is None
    parts = b.split(2)
    assert [p.num_samples for p in parts] == [2, 1]
    assert parts[1].input_ids.tolist() == [9] and parts[0].advantages.tolist()[-1] == -1.0
    mb = b.select([2, 0])
    assert mb.packed.input_ids.tolist() == [9, 5, 6, 7] and mb.advantages.tolist() == [2, 0, 1, 1]
    with pytest.raises(ValueError, match="some samples but not all"):
        TrainBatch.from_samples([
            {"input_ids": [1], "loss_mask": [1], "advantages": [1.0], "ref_logprobs": [0.0]},
            {"input_ids": [1], "loss_mask": [1], "advantages": [1.0]},
        ])
    with pytest.raises(ValueError, match="advantages has 2 entries"):
        TrainBatch(input_ids=torch.tensor([1, 2, 3]), loss_mask=torch.ones(3),
                   advantages=torch.ones(2), lengths=torch.tensor([3]))


def test_config_bad_input(model_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="dtype: 'float16' unknown"):
        TrainerConfig(model=str(model_dir), compute=Compute(dtype="float16"))
    with pytest.raises(ValueError, match="lr"):
        TrainerConfig(model=str(model_dir), optim=OptimConfig(lr=0))
    with pytest.raises(ValueError, match="agg"):
        TrainerConfig(model=str(model_dir), loss={"agg": "mean"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not an HF model folder"):
        TorchTrainer(TrainerConfig(model=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="dist_url"):
        TorchTrainer(TrainerConfig(model=str(model_dir)), rank=0, world_size=2)


def test_recompute_gives_the_same_gradients_and_switches_between_steps(model_dir: Path) -> None:
    """Gradient checkpointing is exact: the same gradients and loss with and without it; it
    switches on and off between steps (what the selector's live change calls), and each step
    reports its peak resident memory."""
    batch = make_batch(lengths=(200, 180, 150))
    plain = trainer(model_dir, micro_batch_tokens=10_000)
    m_plain = plain.accumulate(batch)
    again = trainer(model_dir, micro_batch_tokens=10_000, recompute=True)
    assert again.module.is_gradient_checkpointing  # type: ignore[union-attr]
    m_again = again.accumulate(batch)
    for a, b in zip(grads(plain), grads(again), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)
    assert m_plain["loss"] == pytest.approx(m_again["loss"], rel=1e-6)
    again.set_recompute(False)
    assert not again.module.is_gradient_checkpointing  # type: ignore[union-attr]
    assert again.config.recompute is False
    m = again.train_step(batch)
    assert m["peak_rss_mib"] > 50  # the whole process: torch and the model at least
