"""Shared-prefix packing: a group's prompt run once gives the plain forward's log-probs and
gradients, on fewer tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from earl.algorithms import LossConfig
from earl.models.tiny import build_tiny_model
from earl.packing import pack, scored_positions
from earl.packing_prefix import share_prefixes
from earl.stages.compute import Compute
from earl.stages.lora import LoraConfig
from earl.stages.trainer_batch import TrainBatch
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, intermediate=128,
                            max_positions=512)


def group_batch() -> TrainBatch:
    """Two groups of four samples (each group one prompt, own multi-turn replies: a trained
    turn, an untrained tool result, a trained answer) and one sample alone."""
    g = torch.Generator().manual_seed(0)
    samples = []
    for group in range(2):
        prompt = torch.randint(7, 263, (30 + 7 * group,), generator=g)
        for k in range(4):
            call, result, answer = (torch.randint(7, 263, (n,), generator=g)
                                    for n in (6 + k, 4, 3 + k))
            ids = torch.cat([prompt, call, result, answer])
            mask = torch.cat([torch.zeros(len(prompt)), torch.ones(len(call)),
                              torch.zeros(len(result)), torch.ones(len(answer))])
            samples.append({"input_ids": ids, "loss_mask": mask,
                            "advantages": torch.full((len(ids),), 1.0 - 0.6 * k),
                            "rollout_logprobs": -torch.rand(len(ids), generator=g) * 5})
    lone = torch.randint(7, 263, (25,), generator=g)
    samples.append({"input_ids": lone, "loss_mask": (torch.arange(25) >= 10).float(),
                    "advantages": torch.full((25,), 0.3),
                    "rollout_logprobs": -torch.rand(25, generator=g) * 5})
    return TrainBatch.from_samples(samples)


def test_layout_stores_each_prompt_once() -> None:
    batch = group_batch()
    sub = batch.select(range(batch.num_samples))
    sp = share_prefixes(sub.packed, sub.loss_mask)
    assert sp.input_ids.numel() == batch.num_tokens - 3 * 30 - 3 * 37
    assert len(sp.segments) == 2 * (1 + 4) + 1  # per group its prompt and 4 own parts
    torch.testing.assert_close(sp.input_ids[sp.rows], sub.packed.input_ids)  # a true relabel
    torch.testing.assert_close(sp.position_ids[sp.rows], sub.packed.position_ids)


@pytest.mark.parametrize("lora", [0, 4])
def test_shared_prefix_gives_the_same_gradients(model_dir: Path, lora: int) -> None:
    loss = LossConfig(kl_coef=0.1 if lora else 0.0, entropy_coef=0.01)
    batch = group_batch()

    def build(shared: bool) -> TorchTrainer:
        t = TorchTrainer(TrainerConfig(model=str(model_dir), compute=Compute(threads=1), loss=loss,
                                       shared_prefix=shared, lora=LoraConfig(rank=lora)))
        with torch.no_grad():  # adapters that compute something (B = 0 would hide errors)
            for name, p in t.module.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        return t

    plain, shared = build(False), build(True)
    m_plain, m_shared = plain.accumulate(batch), shared.accumulate(batch)
    for k in ("loss", "pg_loss", "entropy") + (("kl",) if lora else ()):
        assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-6), k
    params = [(p.grad, q.grad) for p, q in zip(plain.module.parameters(),
                                               shared.module.parameters(), strict=True)
              if p.requires_grad]
    assert params
    for a, b in params:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-3)


def test_samples_share_what_they_agree_on_before_their_first_trained_token() -> None:
    packed = pack([torch.arange(7, 20), torch.arange(7, 15)])
    mask = torch.zeros(packed.input_ids.numel())
    mask[3:13] = 1  # the first sample is trained from its 4th token, the second not at all
    sp = share_prefixes(packed, mask)
    assert [(g.start, g.end, g.ancestors) for g in sp.segments] == \
        [(0, 3, ()), (3, 13, (0,)), (13, 18, (0,))]
    torch.testing.assert_close(sp.input_ids[sp.rows], packed.input_ids)


def test_a_system_prompt_common_to_all_groups_is_stored_once() -> None:
    system = torch.arange(7, 47)
    seqs = [torch.cat([system, torch.tensor([100 + g] * 5), torch.tensor([200 + k] * 3)])
            for g in range(2) for k in range(3)]
    packed = pack(seqs)
    mask = torch.cat([(torch.arange(48) >= 45).float() for _ in seqs])
    sp = share_prefixes(packed, mask)
    assert sp.input_ids.numel() == 40 + 2 * 5 + 6 * 3
    assert [len(g.ancestors) for g in sp.segments] == [0, 1, 2, 2, 2, 1, 2, 2, 2]
    assert scored_positions(packed, mask).numel() == 6 * 3
