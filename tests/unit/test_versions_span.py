"""An episode whose turns span three policy versions (weights pushed while it ran, the
`partial_rollouts="continue"` case): every generated token keeps the version and the log-prob
of the policy that sampled it, through the rollout record and the dock's columns, and the
loss's importance weights correct each token against its own version's policy."""

from __future__ import annotations

import pytest
import torch

from earl.agents.chat import ChatCodec
from earl.agents.rollout import RolloutConfig, run_agent
from earl.algorithms.offpolicy import decoupled_ppo_loss
from earl.config import AlgorithmConfig
from earl.engine import SamplingParams
from earl.models.tiny import build_tokenizer
from earl.runtime.types import Generation
from earl.stages.advantages import Estimator

pytestmark = pytest.mark.timeout(60)

CODEC = ChatCodec(build_tokenizer())
VOCAB = list(range(40, 60))  # plain characters of the tiny tokenizer


def policy(version: int) -> torch.Tensor:
    """Log-probs over VOCAB of policy `version` (a different distribution per version)."""
    g = torch.Generator().manual_seed(version)
    return torch.log_softmax(torch.randn(len(VOCAB), generator=g) * 2, dim=0)


class VersionedEngine:
    """Samples each turn from the policy of the current version; the test bumps the version
    between turns, as a weight push in flight does."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.rng = torch.Generator().manual_seed(7)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        lp = policy(self.policy_version)
        picks = torch.multinomial(lp.exp(), 5, replacement=True, generator=self.rng).tolist()
        ids = [VOCAB[i] for i in picks] + [CODEC.stop_ids[0]]
        lps = [float(lp[i]) for i in picks] + [-0.01]
        return Generation(token_ids=ids, logprobs=lps, versions=[self.policy_version] * 6,
                          finish_reason="stop", prompt_tokens=len(prompt_ids))


async def test_importance_weights_follow_each_tokens_version() -> None:
    engine = VersionedEngine()

    async def agent(rollout, sample) -> float:  # three turns, new weights after each
        messages = [{"role": "user", "content": "go"}]
        engine.policy_version = 0
        for _ in range(3):
            turn = await rollout.generate(messages)
            messages += [turn.message, {"role": "user", "content": "again"}]
            engine.policy_version += 1
        return 1.0

    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=8, stop_token_ids=CODEC.stop_ids))
    trajs = [await run_agent(agent, None, engine=engine, codec=CODEC, config=cfg,
                             sample_id=f"s{i}", group_id="g") for i in range(2)]
    trajs[1].reward = 0.0  # advantages of opposite signs
    rows, _ = Estimator(AlgorithmConfig(name="grpo")).columns(trajs)
    for ids, mask, versions, behaviour in zip(rows["input_ids"], rows["loss_mask"],
                                              rows["versions"], rows["rollout_logprobs"],
                                              strict=True):
        gen = [i for i, m in enumerate(mask) if m and ids[i] in VOCAB]
        assert sorted({int(versions[i]) for i in gen}) == [0, 1, 2]  # spans three versions
        # the trainer's policy is version 3; proximal = current (first update of this step)
        current = torch.tensor([float(policy(3)[VOCAB.index(int(ids[i]))]) for i in gen])
        weights = decoupled_ppo_loss(current, current, torch.tensor(behaviour[gen]).float(),
                                     torch.ones(len(gen)), behaviour_weight_cap=None)[2]
        expected = torch.tensor([
            float(policy(3)[VOCAB.index(int(ids[i]))] - policy(int(versions[i]))
                  [VOCAB.index(int(ids[i]))]) for i in gen]).exp()
        torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(weights, torch.ones_like(weights))  # the versions differ
