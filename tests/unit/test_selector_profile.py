"""The profiler against a real forward/backward of a tiny Qwen2 (CPU)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from earl.runtime.selector.cost import CostConfig, CostModel, ModelShape, Parallel
from earl.runtime.selector.policy import PolicyConfig, SearchPolicy
from earl.runtime.selector.profile import Profiler


def _check() -> None:
    """Build a tiny fp32 Qwen2 and check the profiler's points against the cost model."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=384, vocab_size=320,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      attn_implementation="eager")
    model = Qwen2ForCausalLM(cfg).float().train()
    shape = ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384, vocab=320,
                       params=sum(p.numel() for p in model.parameters()))

    def train_step(context: int, seqs: int) -> int:
        ids = torch.randint(0, 320, (seqs, context))
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return ids.numel()

    # fp32 model, HF eager attention: fp32 softmax kept (4 B/score), fp32 logits + log-softmax
    cost = CostModel(shape, CostConfig(weight_bytes=4, grad_bytes=4, act_bytes=4,
                                       attention="eager", score_bytes=4, logit_bytes=8))
    lines: list[str] = []
    prof = Profiler(cost, (512, 1024), repeats=1, log=lines.append)
    points = [prof.profile("train", Parallel(), b, train_step) for b in (512, 1024)]
    for p in points:  # predicted within 30% of what the OS saw
        assert abs(p.predicted_bytes - p.measured_bytes) < 0.3 * p.measured_bytes, p.line()
        assert p.tokens_per_s > 0
    assert points[1].measured_bytes > 2 * points[0].measured_bytes  # quadratic attention seen
    assert len(lines) == 2 and "predicted" in lines[0] and "measured" in lines[0]
    # refreshed only when a bucket is first reached
    assert prof.ensure("train", Parallel(), 700, train_step) is None
    # the policy reads measured throughput for profiled points
    policy = SearchPolicy(cost, PolicyConfig(actors={"t": "train"}), measured=prof.table)
    plan = policy.evaluate("t", Parallel(), ("s0",), 1024, 8 * 2**30)
    assert plan is not None and plan.tokens_per_s == points[1].tokens_per_s
    assert prof.table.memory_scale("train") >= 1.0


def test_cost_model_predicts_measured_training_memory() -> None:
    """Measured in a fresh process, as an actor measures: the resident set is process-wide,
    and a long test session is not quiet (CI stop 45: an in-process vLLM engine from an earlier
    test had replaced `torch.set_num_threads` with a no-op, and the 512-token point measured
    74.9 MiB against 44 MiB alone)."""
    with mp.get_context("spawn").Pool(1) as pool:
        pool.apply(_check)


def test_the_run_profile_calibrates_the_roofline_and_scales_memory() -> None:
    """What a run measures reaches the policy: a layout it ran gets its measured tokens/s;
    one it has not gets the roofline times the stage's measured efficiency (so the two
    compare in the same units); a peak above the prediction shrinks the micro-batch."""
    from earl.runtime.selector import RunProfile, SearchPolicy

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=512, params=120_000),
                     CostConfig(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, act_bytes=4,
                                reserve_bytes=400 * 2**20))
    one, two = Parallel(), Parallel(dp=2)
    profile = RunProfile(cost)
    assert profile.efficiency("train") == 1.0 and profile.tokens_per_s("train", one, 900) is None
    roof = cost.tokens_per_s("train", one, profile.bucket_of(900), batch_tokens=2048)
    profile.record("train", one, 900, tokens=20_000, seconds=10.0, batch_tokens=2048)
    profile.record("train", one, 900, tokens=30_000, seconds=10.0, batch_tokens=2048)
    rate = (0.5 * 20_000 + 30_000) / (0.5 * 10 + 10)  # decayed sums: tokens / seconds
    assert profile.tokens_per_s("train", one, 900) == pytest.approx(rate)
    assert profile.efficiency("train") == pytest.approx(rate / roof)
    policy = SearchPolicy(cost, PolicyConfig(actors={"t": "train"}), measured=profile)
    cap = 2**30
    ran = policy.evaluate("t", one, ("a",), 900, cap)
    new = policy.evaluate("t", two, ("a", "b"), 900, cap)
    assert ran is not None and new is not None and ran.tokens_per_s == pytest.approx(rate)
    assert new.tokens_per_s == pytest.approx(
        cost.tokens_per_s("train", two, 900, batch_tokens=new.micro_batch_tokens)
        * profile.efficiency("train"))
    before = ran.micro_batch_tokens
    predicted = cost.memory("train", one, seq_len=900, micro_batch_tokens=2048).total
    profile.record("train", one, 900, tokens=1, seconds=1.0, batch_tokens=2048,
                   peak_bytes=1.5 * predicted)
    assert profile.memory_scale("train") == pytest.approx(1.5)
    shrunk = policy.evaluate("t", one, ("a",), 900, cap)
    assert shrunk is not None and shrunk.micro_batch_tokens < before
    rows = profile.record_row()
    assert rows["selector/profile/train/memory_scale"] == pytest.approx(1.5)


def test_a_peak_is_read_against_the_largest_shape_its_layout_ran() -> None:
    """A process's peak is its high-water mark: after a long step, a short one that reads the
    same peak has not used more than predicted (its own prediction is far smaller), so the
    scale stays where the long step put it; a larger shape raises the bar for later steps."""
    from earl.runtime.selector import RunProfile

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=512, params=120_000),
                     CostConfig(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, act_bytes=4,
                                reserve_bytes=260 * 2**20))
    one = Parallel()

    def predicted(ctx: int, mb: int) -> float:
        return cost.memory("train", one, seq_len=ctx, micro_batch_tokens=mb).total

    profile = RunProfile(cost)
    peak = 1.1 * predicted(2048, 18_432)
    profile.record("train", one, 2048, tokens=20_000, seconds=1.0, batch_tokens=18_432,
                   peak_bytes=peak, whole_device=True)
    assert profile.memory_scale("train") == pytest.approx(1.1)
    assert peak / predicted(1536, 6144) > 1.3  # what the short step alone would read
    profile.record("train", one, 1536, tokens=6_000, seconds=1.0, batch_tokens=6144,
                   peak_bytes=peak, whole_device=True)
    assert profile.memory_scale("train") == pytest.approx(1.1)
    assert profile.high_water[("train", str(one))] == (2048, 18_432)
    # another layout keeps its own high-water mark
    profile.record("train", Parallel(dp=2), 1024, tokens=1, seconds=1.0, batch_tokens=4096)
    assert profile.high_water[("train", str(Parallel(dp=2)))] == (1024, 4096)


def test_devices_that_held_less_than_predicted_lower_the_prediction_by_the_least_slack() -> None:
    """A step whose devices were charged less than the model predicted lowers every
    prediction of its stage by the smallest such slack, so a layout the model alone rejects
    fits (here: no recomputation at 4,096 tokens); a process's own peak (a CUDA allocator's
    leaves out the context) never does, and one step above the prediction removes the slack."""
    from earl.runtime.selector import RunProfile

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=320, params=40_000),
                     CostConfig(attention="eager", score_bytes=8, logit_bytes=32,
                                reserve_bytes=400 * 2**20))
    dp2, dp2rc = Parallel(dp=2), Parallel(dp=2, recompute=True)
    policy_cfg = PolicyConfig(actors={"t": "train"}, headroom=0.2, max_micro_batch_tokens=4096,
                              tp_max=1, pp_max=1)
    cap = 1467 * 2**20

    def plan(profile: RunProfile) -> Parallel | None:
        best = SearchPolicy(cost, policy_cfg, measured=profile).best("t", ("a", "b"), 4096, cap)
        return best.parallel if best is not None else None

    def predicted(par: Parallel, ctx: int, mb: int) -> float:
        return cost.memory("train", par, seq_len=ctx, micro_batch_tokens=mb).total

    def step(par: Parallel, ctx: int, mb: int, peak: float, whole: bool = True) -> None:
        """A step at half its roofline (every layout equally efficient: memory decides)."""
        roof = cost.tokens_per_s("train", par, profile.bucket_of(ctx), batch_tokens=mb)
        profile.record("train", par, ctx, tokens=round(roof / 2), seconds=1.0,
                       batch_tokens=mb, peak_bytes=peak, whole_device=whole)

    profile = RunProfile(cost)
    assert plan(profile) == dp2rc  # the model alone: 4,096 tokens only with recomputation
    # what a CUDA rank reports leaves out what the device holds besides: no slack from it
    step(dp2, 1024, 4096, 0.4 * predicted(dp2, 1024, 4096), whole=False)
    assert profile.memory_slack("train") == 0.0 and plan(profile) == dp2rc
    # two steps charged to the devices, both below the prediction: the smaller slack counts
    step(dp2, 1024, 4096, predicted(dp2, 1024, 4096) - 600 * 2**20)
    step(dp2rc, 3072, 3072, predicted(dp2rc, 3072, 3072) - 500 * 2**20)
    assert profile.memory_slack("train") == pytest.approx(500 * 2**20)
    assert profile.memory_scale("train") == 1.0
    assert plan(profile) == dp2  # fits without recomputation now
    rows = profile.record_row()
    assert rows["selector/profile/train/memory_slack_mib"] == pytest.approx(500)
    # a step above its prediction: the model under-counts somewhere, no slack any more
    step(dp2, 1024, 4096, 1.1 * predicted(dp2, 1024, 4096))
    assert profile.memory_slack("train") == 0.0 and profile.memory_scale("train") > 1.0
    assert plan(profile) == dp2rc


def test_a_step_credited_with_too_little_time_does_not_swing_the_rate() -> None:
    """A rollout batch whose play overlapped the previous one's is credited only the tail of
    the busy time: as a sum it moves the rate a little, never by its own ratio (here 100x)."""
    from earl.runtime.selector import RunProfile

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=512, params=120_000), CostConfig())
    profile = RunProfile(cost)
    for _ in range(4):
        profile.record("rollout", Parallel(), 900, tokens=10_000, seconds=1.0, batch_tokens=900)
    profile.record("rollout", Parallel(), 900, tokens=10_000, seconds=0.01, batch_tokens=900)
    assert 10_000 < profile.tokens_per_s("rollout", Parallel(), 900) < 25_000  # EMA: 505k


def test_a_layout_measured_slow_stays_slow_at_a_context_it_has_not_run() -> None:
    """Per-layout efficiency: a layout measured far below its roofline at one context is
    predicted as slow at the next one, not at the stage's median efficiency."""
    from earl.runtime.selector import RunProfile

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=512, params=120_000),
                     CostConfig(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, act_bytes=4))
    one, tp2 = Parallel(), Parallel(tp=2)
    profile = RunProfile(cost)
    for par, share in ((one, 0.8), (one, 0.8), (tp2, 0.1)):
        roof = cost.tokens_per_s("rollout", par, profile.bucket_of(900), batch_tokens=4096)
        profile.record("rollout", par, 900, tokens=int(share * roof * 10), seconds=10.0,
                       batch_tokens=4096)
    assert profile.efficiency("rollout", tp2) == pytest.approx(0.1, rel=0.01)
    assert profile.efficiency("rollout", one) == pytest.approx(0.8, rel=0.01)
    assert profile.efficiency("rollout", Parallel(dp=2)) == pytest.approx(0.8, rel=0.01)
    assert profile.tokens_per_s("rollout", tp2, 3000) is None  # another bucket: estimated


def test_a_layout_not_run_is_priced_by_what_the_stage_measured_at_its_bucket() -> None:
    """Two TP-1 replicas measured near their roofline at short contexts and far below it at
    long ones: an unmeasured TP-2 replica at a long context takes the long contexts'
    efficiency, not the median over every bucket (which priced it above the running layout)."""
    from earl.runtime.selector import RunProfile

    cost = CostModel(ModelShape(hidden=64, layers=2, heads=2, kv_heads=2, intermediate=192,
                                vocab=512, params=120_000),
                     CostConfig(weight_bytes=4, grad_bytes=4, optimizer_bytes=8, act_bytes=4))
    two = Parallel(dp=2)
    profile = RunProfile(cost)
    for ctx, share in ((300, 0.9), (600, 0.9), (900, 0.9), (2000, 0.3)):
        roof = cost.tokens_per_s("rollout", two, profile.bucket_of(ctx), batch_tokens=4096)
        profile.record("rollout", two, ctx, tokens=int(share * roof * 10), seconds=10.0,
                       batch_tokens=4096)
    tp2 = Parallel(tp=2)
    assert profile.efficiency("rollout", tp2) == pytest.approx(0.9, rel=0.01)
    assert profile.efficiency("rollout", tp2, 2000) == pytest.approx(0.3, rel=0.01)
    assert profile.efficiency("rollout", tp2, 5000) == pytest.approx(0.9, rel=0.01)  # not run
