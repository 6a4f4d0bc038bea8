"""The selector's cost model: formulas, the EARL paper's figures, the simulator's verdicts
(the simulator is bench/selector_simulate.py)."""

from __future__ import annotations

import pytest
from bench_scripts import load

from earl.runtime.selector.cost import (
    GB,
    CostConfig,
    CostModel,
    ModelShape,
    Parallel,
    paper_points,
    token_weighted_length,
)

_sim = load("selector_simulate")
SimConfig, calibration, run = _sim.SimConfig, _sim.calibration, _sim.run

L70 = ModelShape.llama31_70b()


def test_paper_figures_for_llama_70b_within_15_percent() -> None:
    got = paper_points()
    assert got[4096] == pytest.approx(97, rel=0.15)
    assert got[8192] == pytest.approx(354, rel=0.15)
    assert all(abs(c["error"]) <= 0.15 for c in calibration().values())


def test_kv_bytes_per_token_is_layers_kvheads_headdim_two_dtype() -> None:
    m = CostModel(L70)
    assert m.kv_bytes_per_token(Parallel()) == 80 * 8 * 128 * 2 * 2
    assert m.kv_bytes_per_token(Parallel(tp=8)) == 80 * 8 * 128 * 2 * 2 / 8
    # beyond kv_heads, TP replicates KV heads: no further saving
    assert m.kv_bytes_per_token(Parallel(tp=16)) == m.kv_bytes_per_token(Parallel(tp=8))


def test_training_state_splits_over_tp_pp_and_optimizer_over_dp() -> None:
    m = CostModel(L70)
    a = m.memory("train", Parallel(tp=2, pp=2, dp=1), seq_len=1024)
    b = m.memory("train", Parallel(tp=2, pp=2, dp=4), seq_len=1024)
    assert a.weights == pytest.approx(L70.params * 2 / 4)
    assert a.grads == pytest.approx(L70.params * 4 / 4)
    assert b.optimizer == pytest.approx(a.optimizer / 4)
    assert b.weights == a.weights


def test_activations_eager_quadratic_flash_linear_recompute_smaller() -> None:
    eager = CostModel(L70, CostConfig(attention="eager"))
    flash = CostModel(L70, CostConfig(attention="flash"))
    par = Parallel(tp=8)
    assert eager.activation_bytes(8192, 8192, par) > 3 * eager.activation_bytes(4096, 4096, par)
    assert flash.activation_bytes(8192, 8192, par) == pytest.approx(
        2 * flash.activation_bytes(4096, 4096, par))
    rc = Parallel(tp=8, recompute=True)
    assert flash.activation_bytes(8192, 8192, rc) < flash.activation_bytes(8192, 8192, par) / 5


def test_rollout_memory_grows_with_resident_kv_tokens() -> None:
    m = CostModel(L70)
    par = Parallel(tp=4)
    small = m.memory("rollout", par, seq_len=4096).total
    big = m.memory("rollout", par, seq_len=4096, kv_tokens=40960).total
    assert big - small == pytest.approx(m.kv_bytes_per_token(par) * (40960 - 4096))


def test_max_micro_batch_fits_and_the_next_sequence_does_not() -> None:
    m = CostModel(L70, CostConfig(attention="flash"))
    par = Parallel(tp=8, pp=4, dp=2)
    cap = 80 * GB
    mb = m.max_micro_batch_tokens("train", par, 4096, cap)
    assert mb >= 4096 and mb % 4096 == 0
    assert m.memory("train", par, seq_len=4096, micro_batch_tokens=mb).total <= cap
    assert m.memory("train", par, seq_len=4096, micro_batch_tokens=mb + 4096).total > cap
    assert m.max_micro_batch_tokens("train", Parallel(), 4096, cap) == 0  # 70B on one GPU


def test_bad_shape_names_the_field() -> None:
    with pytest.raises(ValueError, match="ModelShape.heads"):
        ModelShape(hidden=64, layers=2, heads=0, kv_heads=1, intermediate=128, vocab=10,
                   params=1)
    with pytest.raises(ValueError, match="Parallel.tp"):
        Parallel(tp=0)


def test_simulator_static_layouts_oom_and_the_selector_does_not() -> None:
    r = run(SimConfig(gpus=64, steps=20))
    assert r["oom_static"] is True and r["oom_avoided"] > 0
    assert r["oom_selector"] is False
    assert r["throughput_ratio_vs_best_static"] >= 0.95
    assert r["reconfigurations"] >= 1


def test_shape_from_a_hugging_face_config() -> None:
    cfg = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 384, "vocab_size": 320}
    s = ModelShape.from_hf_config(cfg, params=800_000)
    assert (s.hidden, s.layers, s.kv_heads, s.head_dim) == (128, 4, 2, 32)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelShape.from_hf_config({k: v for k, v in cfg.items()
                                   if k != "num_key_value_heads"}, params=1)


def test_a_cpu_core_decodes_compute_bound_so_one_tp2_replica_is_not_priced_above_two() -> None:
    # 2 replicas x 32 sequences against one TP 2 replica of 64 on the same two devices, short
    # contexts (the weights are most of what a step reads): a GPU reads them once per step for
    # all 64 (bandwidth bound: batching twice the sequences doubles the rate), a CPU core
    # computes every sequence (compute bound: batching gains nothing)
    shape = ModelShape(hidden=1024, layers=8, heads=8, kv_heads=8, intermediate=4096,
                       vocab=32000, params=1_000_000_000)
    ctx = 128
    for roofs, tp2_over_two in (({}, 2.0), ({"peak_flops": 1.06e11, "mem_bw": 2.4e10}, 1.0)):
        m = CostModel(shape, CostConfig(tp_overhead=0.0, **roofs))
        two = m.tokens_per_s("rollout", Parallel(dp=2), ctx, batch_tokens=32 * ctx)
        tp2 = m.tokens_per_s("rollout", Parallel(tp=2), ctx, batch_tokens=64 * ctx)
        assert tp2 / two == pytest.approx(tp2_over_two, rel=0.1)
    with pytest.raises(ValueError, match="peak_flops"):
        CostConfig(peak_flops=0)


def test_attention_of_a_mixed_micro_batch_is_priced_by_its_tokens_positions() -> None:
    # one sequence of 1,024 and one of 3,072 tokens: attention costs sum over positions, the
    # model's 8 x layers x hidden FLOPs per (token, attended position) pair forward times
    # (1024^2 + 3072^2) / 2 pairs, below both at 3,072 (the bucket)
    shape = ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192, vocab=320,
                       params=127_680)
    m = CostModel(shape, CostConfig(peak_flops=1e11))
    lengths = [1024, 3072]
    att = token_weighted_length(lengths)
    assert att == pytest.approx((1024**2 + 3072**2) / 4096)
    tokens = sum(lengths)
    fwd_flops = 2 * shape.params * tokens + 8 * shape.layers * shape.hidden * sum(
        n * n for n in lengths) / 2
    for stage, mult in (("train", 3), ("reference", 1)):
        mixed = m.tokens_per_s(stage, Parallel(), 3072, batch_tokens=tokens, attention_len=att)
        longest = m.tokens_per_s(stage, Parallel(), 3072, batch_tokens=tokens)
        assert mixed == pytest.approx(1e11 * 0.4 * tokens / (mult * fwd_flops))
        assert mixed > 1.1 * longest
    with pytest.raises(ValueError, match="token_weighted_length"):
        token_weighted_length([])


def test_a_decode_step_overhead_weighs_more_on_a_replica_of_fewer_sequences() -> None:
    shape = ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192, vocab=320,
                       params=127_680)
    ctx = 1024
    plain = CostModel(shape, CostConfig(peak_flops=1.06e11, mem_bw=2.4e10, tp_overhead=0.0))
    slow = CostModel(shape, CostConfig(peak_flops=1.06e11, mem_bw=2.4e10, tp_overhead=0.0,
                                       decode_step_s=0.002))
    for seqs in (8, 32):
        p = plain.tokens_per_s("rollout", Parallel(), ctx, batch_tokens=seqs * ctx)
        s = slow.tokens_per_s("rollout", Parallel(), ctx, batch_tokens=seqs * ctx)
        assert 1 / s == pytest.approx(1 / p + 0.002 / seqs)
    assert slow.tokens_per_s("train", Parallel(), ctx, batch_tokens=ctx) == \
        plain.tokens_per_s("train", Parallel(), ctx, batch_tokens=ctx)
    with pytest.raises(ValueError, match="decode_step_s"):
        CostConfig(decode_step_s=-1.0)
