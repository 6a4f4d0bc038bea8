"""LoRA in the torch trainer: merged weights, the adapter-off reference, what a step changes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from earl.algorithms import LossConfig
from earl.config import load_config
from earl.models.tiny import build_tiny_model
from earl.packing import pack, packed_forward
from earl.stages.compute import Compute
from earl.stages.lora import LoraConfig, adapter_disabled
from earl.stages.optim import OptimConfig
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


def make_batch(lengths: tuple[int, ...] = (12, 40, 7, 25)) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    samples = []
    for k, n in enumerate(lengths):
        mask = torch.zeros(n)
        mask[n // 3:] = 1
        samples.append({"input_ids": torch.randint(7, 263, (n,), generator=g), "loss_mask": mask,
                        "advantages": torch.full((n,), 1.0 if k % 2 == 0 else -0.5),
                        "rollout_logprobs": -torch.rand(n, generator=g) * 6})
    return TrainBatch.from_samples(samples)


def lora_trainer(model_dir: Path, kl_coef: float = 0.0) -> TorchTrainer:
    return TorchTrainer(TrainerConfig(model=str(model_dir), compute=Compute(threads=1),
                                      optim=OptimConfig(lr=5e-2),
                                      loss=LossConfig(kl_coef=kl_coef),
                                      lora=LoraConfig(rank=4, alpha=8.0)))


def run(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one sequence through the trainer's packed forward."""
    with torch.no_grad():
        return packed_forward(model, pack([ids]))


def plain(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Logits of one sequence through an HF model as loaded (no packing)."""
    with torch.no_grad():
        return model(input_ids=ids[None]).logits[0]


def _randomize_b(t: TorchTrainer) -> None:
    """Fresh adapters compute nothing (B = 0); give B values so the merge has work to do."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in t.module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_merged_weights_are_base_plus_scaled_ba(model_dir: Path) -> None:
    from safetensors.torch import load_file

    t = lora_trainer(model_dir)
    _randomize_b(t)
    base = load_file(str(model_dir / "model.safetensors"))
    merged = dict(t.named_weights())
    assert set(merged) == set(base) - t._tied  # HF names, no lora_/base_layer leftovers
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    params = dict(t.module.named_parameters())
    a, b = params[f"{prefix}.lora_A.default.weight"], params[f"{prefix}.lora_B.default.weight"]
    name = "model.layers.0.self_attn.q_proj.weight"
    torch.testing.assert_close(merged[name], base[name] + (8.0 / 4) * b.detach() @ a.detach())
    # an HF model loaded with the merged weights computes what the adapted model computes
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    hf.load_state_dict(merged, strict=False)
    hf.tie_weights()
    ids = torch.randint(7, 263, (20,))
    torch.testing.assert_close(plain(hf, ids), run(t.module, ids), atol=1e-5, rtol=1e-4)


def test_reference_is_the_base_model_with_the_adapter_off(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    t = lora_trainer(model_dir)
    _randomize_b(t)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ids = torch.randint(7, 263, (20,))
    adapted = run(t.module, ids)
    with adapter_disabled(t.module):
        off = run(t.module, ids)
    want = plain(base, ids)
    torch.testing.assert_close(off, want, atol=1e-5, rtol=1e-4)
    assert (adapted - want).abs().max() > 1e-3  # the adapter does change the policy


def test_in_trainer_kl_is_zero_before_training_and_grows(model_dir: Path) -> None:
    t = lora_trainer(model_dir, kl_coef=0.1)
    batch = make_batch()
    first = t.train_step(batch)
    assert first["kl"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the policy is the base
    for _ in range(3):
        last = t.train_step(batch)
    assert last["kl"] > 1e-4


def test_a_step_changes_only_the_adapters(model_dir: Path) -> None:
    t = lora_trainer(model_dir)
    before = {n: p.detach().clone() for n, p in t.module.named_parameters()}
    trainable = {n for n, p in t.module.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert {id(p) for g in t.optimizer.param_groups for p in g["params"]} == \
        {id(p) for n, p in t.module.named_parameters() if n in trainable}
    t.train_step(make_batch())
    t.train_step(make_batch())
    for n, p in t.module.named_parameters():
        changed = not torch.equal(before[n], p.detach())
        assert changed == ("lora_B" in n or "lora_A" in n), n


def test_save_hf_writes_the_merged_model(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    t = lora_trainer(model_dir)
    _randomize_b(t)
    out = t.save_hf(tmp_path / "merged")
    loaded = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(7, 263, (16,))
    torch.testing.assert_close(plain(loaded, ids), run(t.module, ids), atol=1e-5, rtol=1e-4)


def test_bad_lora_settings_name_the_field(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="'lora.rank'"):
        load_config(overrides=["--recipe=calc", "--lora.rank=-1"])
    with pytest.raises(ValueError, match="lora.targets.*q_proj"):
        TorchTrainer(TrainerConfig(model=str(model_dir), lora=LoraConfig(rank=2,
                                                                          targets="qkv_proj")))
