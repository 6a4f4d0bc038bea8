"""Megatron-core backend on CPU: HF <-> mcore conversion, parallel_state over gloo, GPTModel
forward/backward equal to the HF torch trainer's, export and checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from earl.models.tiny import build_tiny_model
from earl.stages.compute import Compute
from earl.stages.trainer_megatron_convert import (
    QwenShape,
    check_pp,
    check_tp,
    gather_pp,
    gather_tp,
    hf_to_mcore,
    mcore_to_hf,
)
from earl.stages.trainer_torch import TorchTrainer, TrainerConfig


def _batch():
    from test_trainer import make_batch

    return make_batch()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=64, layers=2, heads=4,
                            kv_heads=2, intermediate=128, max_positions=512)


@pytest.fixture(scope="module")
def megatron(model_dir: Path) -> Iterator[object]:
    """One MegatronTrainer for the module; tears down parallel_state and the process group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from earl.stages.trainer_megatron import MegatronTrainer

    trainer = MegatronTrainer(TrainerConfig(model=str(model_dir), compute=Compute(threads=1),
                                            micro_batch_tokens=64))
    yield trainer
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def test_conversion_round_trip_untied_gqa() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=50, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg).state_dict()
    shape = QwenShape.from_hf_config(cfg)
    assert (shape.heads, shape.kv_heads, shape.head_dim, shape.tied) == (6, 2, 8, False)
    mc = hf_to_mcore(hf, shape)
    qkv = mc["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (6 * 8 + 2 * 2 * 8, 48)
    # group 0 = q heads 0-2, then k head 0, then v head 0
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    torch.testing.assert_close(qkv[:24], q[:24])
    torch.testing.assert_close(qkv[24:32], k[:8])
    assert mc["decoder.layers.1.mlp.linear_fc1.weight"].shape == (128, 48)
    back = mcore_to_hf(mc, shape)
    assert set(back) == set(hf)
    for name, t in hf.items():
        torch.testing.assert_close(back[name], t, atol=0, rtol=0)


def _tp_round_trip(hf: dict[str, torch.Tensor], shape: QwenShape, tp: int) -> None:
    shards = [hf_to_mcore(hf, shape, tp_rank=r, tp_size=tp) for r in range(tp)]
    full = hf_to_mcore(hf, shape)
    assert gather_tp(shards).keys() == full.keys()
    for name, t in gather_tp(shards).items():
        torch.testing.assert_close(t, full[name], atol=0, rtol=0)
    back = mcore_to_hf(shards, shape)
    assert set(back) == set(hf) - ({"lm_head.weight"} if shape.tied else set())
    for name, t in back.items():
        torch.testing.assert_close(t, hf[name], atol=0, rtol=0)


def test_tp_round_trip_tiny(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    folder = build_tiny_model(tmp_path, max_positions=512)
    hf = load_file(str(folder / "model.safetensors"))
    shape = QwenShape.from_hf_config(AutoConfig.from_pretrained(folder))
    _tp_round_trip(hf, shape, 2)
    sh = hf_to_mcore(hf, shape, tp_rank=1, tp_size=2)
    # rank 1: KV group 1 = q heads 2-3, k head 1, v head 1 (head_dim 32)
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    torch.testing.assert_close(sh["decoder.layers.0.self_attention.linear_qkv.weight"],
                               torch.cat([q[64:], k[32:], v[32:]]), atol=0, rtol=0)
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    torch.testing.assert_close(sh["decoder.layers.0.mlp.linear_fc1.weight"],
                               torch.cat([gate[192:], up[192:]]), atol=0, rtol=0)
    torch.testing.assert_close(sh["decoder.layers.0.mlp.linear_fc2.weight"],
                               hf["model.layers.0.mlp.down_proj.weight"][:, 192:], atol=0, rtol=0)
    assert sh["embedding.word_embeddings.weight"].shape == (160, 128)
    assert sh["decoder.layers.0.input_layernorm.weight"].shape == (128,)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_round_trip_untied_gqa(tp: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    hf = Qwen2ForCausalLM(cfg).state_dict()
    shape = QwenShape.from_hf_config(cfg)
    _tp_round_trip(hf, shape, tp)
    sh = hf_to_mcore(hf, shape, tp_rank=0, tp_size=tp)
    assert sh["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (128 // tp,)
    assert sh["output_layer.weight"].shape == (64 // tp, 64)


def test_tp_refuses_what_does_not_divide() -> None:
    shape = QwenShape(layers=1, heads=8, kv_heads=2, head_dim=8, tied=True, vocab=64, ffn=96)
    check_tp(shape, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        check_tp(shape, 4)
    with pytest.raises(ValueError, match="vocab_size=65"):
        check_tp(QwenShape(layers=1, heads=8, kv_heads=8, head_dim=8, tied=True, vocab=65,
                           ffn=96), 2)


def test_parallel_state_over_gloo(megatron: object) -> None:
    from megatron.core import parallel_state

    assert parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    assert parallel_state.get_data_parallel_world_size() == 1
    assert type(megatron.module).__name__ == "GPTModel"  # type: ignore[attr-defined]


def test_megatron_matches_torch_trainer(megatron: object, model_dir: Path) -> None:
    m = megatron
    batch = _batch()
    t = TorchTrainer(TrainerConfig(model=str(model_dir), compute=Compute(threads=1)))
    torch.testing.assert_close(m.compute_logprobs(batch), t.compute_logprobs(batch),  # type: ignore[attr-defined]
                               atol=1e-5, rtol=1e-5)
    mm = m.accumulate(batch)  # type: ignore[attr-defined]
    tm = t.accumulate(batch)
    assert mm["loss"] == pytest.approx(tm["loss"], rel=1e-5)
    grads = mcore_to_hf({k: p.grad for k, p in m.module.named_parameters()}, m.shape)  # type: ignore[attr-defined]
    for name, p in t.module.named_parameters():
        if name == "lm_head.weight":
            continue  # tied: its gradient lands in embed_tokens on both sides
        torch.testing.assert_close(grads[name], p.grad, atol=1e-6, rtol=1e-4)
    m.optimizer_step()  # type: ignore[attr-defined]
    m.optimizer.zero_grad()  # type: ignore[attr-defined]


def test_megatron_export_and_checkpoint(megatron: object, tmp_path: Path) -> None:
    m = megatron
    batch = _batch()
    m.train_step(batch)  # type: ignore[attr-defined]
    names = [n for n, _ in m.named_weights()]  # type: ignore[attr-defined]
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names
    out = m.save_hf(tmp_path / "hf")  # type: ignore[attr-defined]
    reloaded = TorchTrainer(TrainerConfig(model=str(out), compute=Compute(threads=1)))
    torch.testing.assert_close(reloaded.compute_logprobs(batch), m.compute_logprobs(batch),  # type: ignore[attr-defined]
                               atol=1e-5, rtol=1e-5)
    m.save_checkpoint(tmp_path / "ck")  # type: ignore[attr-defined]
    before = {k: v.clone() for k, v in m.named_weights()}  # type: ignore[attr-defined]
    m.train_step(batch)  # type: ignore[attr-defined]
    m.load_checkpoint(tmp_path / "ck")  # type: ignore[attr-defined]
    for name, t in m.named_weights():  # type: ignore[attr-defined]
        torch.testing.assert_close(t, before[name], atol=0, rtol=0)


@pytest.mark.parametrize(("tied", "tp", "pp"), [(True, 1, 2), (False, 1, 4), (True, 2, 2),
                                                (False, 2, 2)])
def test_pp_round_trip(tied: bool, tp: int, pp: int) -> None:
    """HF -> per (TP, PP) rank -> gathered over TP, then over PP -> HF equals the original."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    hf = Qwen2ForCausalLM(cfg).state_dict()
    shape = QwenShape.from_hf_config(cfg)
    stages = [gather_tp([hf_to_mcore(hf, shape, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp)
                         for t in range(tp)]) for p in range(pp)]
    per = 4 // pp
    for p, st in enumerate(stages):
        layers = {int(n.split(".")[2]) for n in st if n.startswith("decoder.layers.")}
        assert layers == set(range(per))  # each stage's layers, renumbered from 0
        assert ("embedding.word_embeddings.weight" in st) == (p == 0)
        assert ("decoder.final_layernorm.weight" in st) == (p == pp - 1)
        assert ("output_layer.weight" in st) == (p == pp - 1)  # tied: the embeddings' copy
    torch.testing.assert_close(stages[-1]["decoder.layers.0.mlp.linear_fc2.weight"],
                               hf[f"model.layers.{4 - per}.mlp.down_proj.weight"], atol=0, rtol=0)
    if tied:
        torch.testing.assert_close(stages[-1]["output_layer.weight"],
                                   hf["model.embed_tokens.weight"], atol=0, rtol=0)
    full = gather_pp(stages, shape)
    assert full.keys() == hf_to_mcore(hf, shape).keys()
    back = mcore_to_hf(full, shape)
    assert set(back) == set(hf) - ({"lm_head.weight"} if tied else set())
    for name, t in back.items():
        torch.testing.assert_close(t, hf[name], atol=0, rtol=0)


def test_pp_refusals(model_dir: Path) -> None:
    shape = QwenShape(layers=3, heads=4, kv_heads=2, head_dim=8, tied=True, vocab=64, ffn=96)
    check_pp(shape, 3)
    with pytest.raises(ValueError, match=r"pp=2 does not divide .*num_hidden_layers=3"):
        check_pp(shape, 2)
    with pytest.raises(ValueError, match="num_hidden_layers=3"):
        hf_to_mcore({}, shape, pp_rank=0, pp_size=2)
    with pytest.raises(ValueError, match="TrainerConfig.pp must be >= 1"):
        TrainerConfig(model=str(model_dir), pp=0)
    with pytest.raises(ValueError, match="torch backend has no pipeline parallel"):
        TorchTrainer(TrainerConfig(model=str(model_dir), pp=2), world_size=2)
    from earl.stages.trainer_megatron import MegatronTrainer

    with pytest.raises(ValueError, match=r"tp=1 does not divide world_size=3 into pp=2 stages"):
        MegatronTrainer(TrainerConfig(model=str(model_dir), pp=2), world_size=3)
    with pytest.raises(ValueError, match="shared_prefix"):
        MegatronTrainer(TrainerConfig(model=str(model_dir), pp=2, shared_prefix=True),
                        world_size=2)
