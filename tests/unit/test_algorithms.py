"""earl.algorithms against small hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from earl.algorithms import (
    LossConfig,
    aggregate,
    aggregation_denominator,
    broadcast_to_tokens,
    decoupled_ppo_loss,
    discounted_returns,
    entropy_from_logits,
    grpo_advantages,
    kl_estimate,
    kl_penalty_rewards,
    per_turn_advantages,
    policy_objective,
    ppo_clip_loss,
    truncated_is_weights,
    turn_token_values,
)

T = torch.tensor


def close(a: torch.Tensor, b: list[float] | float, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a.float(), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0)


# ---------------------------------------------------------------- advantages


def test_grpo_advantages_mean_only() -> None:
    # groups [1, 0, 0, 1] -> mean 0.5 ; [3, 3, 3, 3] -> all equal -> 0
    r = T([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    close(grpo_advantages(r, group_size=4, normalize_std=False),
          [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0])


def test_grpo_advantages_std_normalised() -> None:
    # group [1, 0, 0, 1]: mean .5, unbiased std sqrt(4 * .25 / 3) = 0.57735
    r = T([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0])
    a = grpo_advantages(r, group_size=4, normalize_std=True, eps=0.0)
    s = math.sqrt(1 / 3)
    close(a[:4], [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s])
    assert torch.isfinite(grpo_advantages(r, group_size=4)).all()
    close(grpo_advantages(r, group_size=4)[4:], [0, 0, 0, 0])


def test_grpo_advantages_group_ids_match_group_size() -> None:
    r = T([2.0, 4.0, 1.0, 5.0])
    by_ids = grpo_advantages(r, group_ids=T([7, 3, 7, 3]), normalize_std=False)
    close(by_ids, [0.5, -0.5, -0.5, 0.5])  # group 7: [2, 1] mean 1.5 ; group 3: [4, 5] mean 4.5


def test_grpo_advantages_bad_input() -> None:
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(T([1.0, 2.0, 3.0]), group_size=2)
    with pytest.raises(ValueError, match="exactly one"):
        grpo_advantages(T([1.0, 2.0]))


def test_broadcast_to_tokens() -> None:
    close(broadcast_to_tokens(T([1.0, -2.0]), [2, 3]), [1, 1, -2, -2, -2])
    with pytest.raises(ValueError):
        broadcast_to_tokens(T([1.0]), [2, 3])


def test_discounted_returns_padded_rows() -> None:
    r = T([[0.0, 0.0, 1.0], [1.0, 2.0, 0.0]])
    m = T([[1, 1, 1], [1, 1, 0]])
    # row 0: G2=1, G1=.5, G0=.25 ; row 1: G1=2, G0=1+.5*2=2, padding 0
    close(discounted_returns(r, 0.5, m), [[0.25, 0.5, 1.0], [2.0, 2.0, 0.0]])
    close(discounted_returns(T([1.0, 1.0, 1.0])), [3, 2, 1])


def test_turn_token_values_maps_spans() -> None:
    v = turn_token_values(T([0.5, -1.0]), [(1, 3), (4, 6)], length=7)
    close(v, [0, 0.5, 0.5, 0, -1, -1, 0])
    with pytest.raises(ValueError, match="outside"):
        turn_token_values(T([1.0]), [(5, 9)], length=7)


def test_per_turn_advantages_group_relative() -> None:
    # group 0: sample A turns [0, 1] -> returns (gamma 1) [1, 1]; sample B turns [0] -> [0]
    # group 0 turn returns [1, 1, 0]: mean 2/3 -> [1/3, 1/3, -2/3]
    # group 1: single sample, turns [2, 0] -> returns [2, 0], mean 1 -> [1, -1]
    out = per_turn_advantages([[0.0, 1.0], [0.0], [2.0, 0.0]], [0, 0, 1], normalize_std=False)
    close(out[0], [1 / 3, 1 / 3])
    close(out[1], [-2 / 3])
    close(out[2], [1.0, -1.0])
    # gamma 0.5: sample A returns [0.5, 1]
    out = per_turn_advantages([[0.0, 1.0]], [0], gamma=0.5, normalize_std=False)
    close(out[0], [-0.25, 0.25])


# ---------------------------------------------------------------- aggregation


def test_aggregation_modes_hand_computed() -> None:
    # sample 0: losses [1, 2, (9 masked)], sample 1: [4]
    v = T([1.0, 2.0, 9.0, 4.0])
    m = T([1, 1, 0, 1])
    sid = T([0, 0, 0, 1])
    close(aggregate(v, m, "token-mean", seq_ids=sid), (1 + 2 + 4) / 3)
    close(aggregate(v, m, "seq-mean-token-sum", seq_ids=sid), (3 + 4) / 2)
    close(aggregate(v, m, "seq-mean-token-mean", seq_ids=sid), (1.5 + 4) / 2)
    # padded layout gives the same
    vp = T([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]])
    mp = T([[1, 1, 0], [1, 0, 0]])
    close(aggregate(vp, mp, "seq-mean-token-mean"), (1.5 + 4) / 2)


def test_aggregation_global_denominator_sums_over_micro_batches() -> None:
    v = T([1.0, 2.0, 9.0, 4.0, 5.0])
    m = T([1, 1, 0, 1, 1])
    sid = T([0, 0, 0, 1, 2])
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        whole = aggregate(v, m, mode, seq_ids=sid)
        parts = [(slice(0, 3), T([0, 0, 0])), (slice(3, 5), T([0, 1]))]
        denom = sum(aggregation_denominator(m[s], mode, i) for s, i in parts)
        split = sum(aggregate(v[s], m[s], mode, seq_ids=i, denom=denom) for s, i in parts)
        close(split, float(whole))
    with pytest.raises(ValueError, match="unknown"):
        aggregate(v, m, "mean", seq_ids=sid)  # type: ignore[arg-type]


def test_empty_mask_gives_zero_not_nan() -> None:
    out = aggregate(T([1.0, 2.0]), T([0, 0]), "seq-mean-token-mean", seq_ids=T([0, 1]))
    close(out, 0.0)


# ---------------------------------------------------------------- PPO


def test_ppo_clip_hand_computed() -> None:
    old = torch.zeros(4)
    # ratios 1.5, 0.5, 1.5, 0.5 ; advantages +1, +1, -1, -1 ; eps 0.2
    logp = torch.log(T([1.5, 0.5, 1.5, 0.5])).requires_grad_()
    adv = T([1.0, 1.0, -1.0, -1.0])
    loss, clipped = ppo_clip_loss(logp, old, adv, clip_low=0.2, clip_high=0.2)
    # A>0,r=1.5 -> -1.2 (clipped) ; A>0,r=.5 -> -.5 ; A<0,r=1.5 -> 1.5 ; A<0,r=.5 -> .8 (clipped)
    close(loss, [-1.2, -0.5, 1.5, 0.8])
    assert clipped.tolist() == [True, False, False, True]
    loss.sum().backward()
    # d(-A r)/dlogp = -A r on unclipped tokens, 0 on clipped
    close(logp.grad, [0.0, -0.5, 1.5, 0.0])


def test_ppo_clip_higher_and_dual_clip() -> None:
    logp = torch.log(T([1.5, 10.0]))
    loss, _ = ppo_clip_loss(logp, torch.zeros(2), T([1.0, -1.0]), clip_low=0.2, clip_high=0.28)
    close(loss, [-1.28, 10.0])
    loss, clipped = ppo_clip_loss(logp, torch.zeros(2), T([1.0, -1.0]), dual_clip=3.0)
    close(loss, [-1.2, 3.0])
    assert clipped.tolist() == [True, True]
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_clip_loss(logp, torch.zeros(2), T([1.0, 1.0]), dual_clip=0.5)


# ---------------------------------------------------------------- KL, entropy


def test_kl_estimators_hand_computed() -> None:
    logp = torch.log(T([0.5, 0.25]))
    ref = torch.log(T([0.25, 0.5]))
    close(kl_estimate(logp, ref, "k1"), [math.log(2), -math.log(2)])
    close(kl_estimate(logp, ref, "k2"), [0.5 * math.log(2) ** 2] * 2)
    # k3 = ref/p - log(ref/p) - 1: [0.5 + ln2 - 1, 2 - ln2 - 1]
    close(kl_estimate(logp, ref, "k3"), [0.5 + math.log(2) - 1, 1 - math.log(2)])
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_kl_penalty_rewards() -> None:
    logp = T([0.0, -1.0, -2.0, -1.0])
    ref = T([0.0, -2.0, -2.5, -1.0])
    mask = T([0, 1, 1, 1])
    sid = T([0, 0, 0, 1])
    # k1 per token [0, 1, .5, 0] -> sample 0 sum 1.5, sample 1 sum 0; coef .1
    close(kl_penalty_rewards(T([1.0, 1.0]), logp, ref, mask, sid, coef=0.1), [0.85, 1.0])


def test_entropy_from_logits() -> None:
    close(entropy_from_logits(torch.zeros(2, 4)), [math.log(4)] * 2)
    close(entropy_from_logits(T([[0.0, -1e9]])), [0.0])
    p = T([0.7, 0.2, 0.1])
    close(entropy_from_logits(torch.log(p)[None]), [-(p * p.log()).sum().item()])


# ---------------------------------------------------------------- off-policy


def test_truncated_is_weights() -> None:
    old = torch.log(T([0.5, 0.9, 0.1]))
    roll = torch.log(T([0.25, 0.9, 0.5]))
    close(truncated_is_weights(old, roll, cap=1.5), [1.5, 1.0, 0.2])  # 2 -> capped to 1.5


def test_decoupled_ppo_hand_computed() -> None:
    # current / proximal ratio 1.5 (clipped to 1.2 for A>0), prox/behav weight 0.8 and 10 (dropped)
    prox = torch.log(T([0.4, 0.5]))
    behav = torch.log(T([0.5, 0.05]))
    logp = torch.log(T([0.6, 0.5]))
    loss, clipped, w = decoupled_ppo_loss(logp, prox, behav, T([1.0, 1.0]), behaviour_weight_cap=5.0)
    close(w, [0.8, 0.0])
    close(loss, [-1.2 * 0.8, 0.0])
    assert clipped.tolist() == [True, False]


def test_policy_objective_combines_terms() -> None:
    logp = torch.log(T([0.5, 0.5, 0.25])).requires_grad_()
    ref = torch.log(T([0.5, 0.25, 0.25]))
    adv = T([1.0, -1.0, 2.0])
    mask = T([1, 1, 1])
    sid = T([0, 0, 1])
    ent = T([1.0, 2.0, 3.0])
    cfg = LossConfig(kl_coef=0.5, kl_estimator="k1", entropy_coef=0.1)
    loss, m = policy_objective(cfg, logprobs=logp, advantages=adv, mask=mask, seq_ids=sid,
                               ref_logprobs=ref, entropy=ent)
    # old = current -> ratio 1: pg = mean(-A) = -2/3; kl k1 = mean([0, ln2, 0]); entropy mean 2
    expect = -2 / 3 + 0.5 * math.log(2) / 3 - 0.1 * 2
    close(loss, expect)
    close(m["pg_loss"], -2 / 3)
    close(m["clip_frac"], 0.0)
    loss.backward()
    close(logp.grad, [(-1 + 0.5) / 3, (1 + 0.5) / 3, (-2 + 0.5) / 3])


def test_policy_objective_tis_and_errors() -> None:
    logp = torch.log(T([0.5, 0.5]))
    roll = torch.log(T([0.25, 0.5]))
    cfg = LossConfig(off_policy="tis", is_cap=1.5)
    loss, m = policy_objective(cfg, logprobs=logp, advantages=T([1.0, 1.0]), mask=T([1, 1]),
                               seq_ids=T([0, 1]), rollout_logprobs=roll)
    close(loss, (-1.5 - 1.0) / 2)
    close(m["is_weight"], 1.25)
    with pytest.raises(ValueError, match="rollout_logprobs"):
        policy_objective(cfg, logprobs=logp, advantages=T([1.0, 1.0]), mask=T([1, 1]),
                         seq_ids=T([0, 1]))
    with pytest.raises(ValueError, match="off_policy"):
        LossConfig(off_policy="areal")  # type: ignore[arg-type]


def test_nan_rollout_logprob_is_on_policy() -> None:
    # token 0 was sampled at p=0.25 (now 0.5: ratio 2, clipped at 1.2); token 1 is a
    # self-imitation target nobody sampled (NaN): ratio 1, gradient -A.
    logp = torch.log(T([0.5, 0.5])).requires_grad_()
    roll = T([math.log(0.25), float("nan")])
    loss, m = policy_objective(LossConfig(), logprobs=logp, advantages=T([1.0, 2.0]),
                               mask=T([1, 1]), seq_ids=T([0, 1]), rollout_logprobs=roll)
    close(loss, (-1.2 - 2.0) / 2)
    loss.backward()
    close(logp.grad, [0.0, -1.0])
    assert not math.isnan(float(m["approx_kl_old"]))
