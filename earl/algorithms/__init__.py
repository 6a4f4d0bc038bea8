"""RL algorithms as pure tensor functions: advantages, PPO losses, KL, entropy, off-policy fixes.

Nothing here touches a model, a process or a file; the trainer and the pipeline compose these.
The names below load on first use, so that the config tree (`LossConfig`, which needs no
torch) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from earl.algorithms.loss_config import AGG_MODES as AGG_MODES
from earl.algorithms.loss_config import LossConfig as LossConfig

if TYPE_CHECKING:
    from earl.algorithms.advantages import broadcast_to_tokens as broadcast_to_tokens
    from earl.algorithms.advantages import discounted_returns as discounted_returns
    from earl.algorithms.advantages import grpo_advantages as grpo_advantages
    from earl.algorithms.advantages import per_turn_advantages as per_turn_advantages
    from earl.algorithms.advantages import turn_token_values as turn_token_values
    from earl.algorithms.aggregation import aggregate as aggregate
    from earl.algorithms.aggregation import aggregation_denominator as aggregation_denominator
    from earl.algorithms.entropy import entropy_from_logits as entropy_from_logits
    from earl.algorithms.kl import kl_estimate as kl_estimate
    from earl.algorithms.kl import kl_penalty_rewards as kl_penalty_rewards
    from earl.algorithms.losses import ppo_clip_loss as ppo_clip_loss
    from earl.algorithms.losses import vanilla_pg_loss as vanilla_pg_loss
    from earl.algorithms.objective import policy_objective as policy_objective
    from earl.algorithms.offpolicy import decoupled_ppo_loss as decoupled_ppo_loss
    from earl.algorithms.offpolicy import truncated_is_weights as truncated_is_weights

_LAZY = {
    "broadcast_to_tokens": "advantages", "discounted_returns": "advantages",
    "grpo_advantages": "advantages", "per_turn_advantages": "advantages",
    "turn_token_values": "advantages", "aggregate": "aggregation",
    "aggregation_denominator": "aggregation", "entropy_from_logits": "entropy",
    "kl_estimate": "kl", "kl_penalty_rewards": "kl", "ppo_clip_loss": "losses",
    "vanilla_pg_loss": "losses", "policy_objective": "objective",
    "decoupled_ppo_loss": "offpolicy", "truncated_is_weights": "offpolicy",
}

__all__ = [
    "AGG_MODES",
    "LossConfig",
    "aggregate",
    "aggregation_denominator",
    "broadcast_to_tokens",
    "decoupled_ppo_loss",
    "discounted_returns",
    "entropy_from_logits",
    "grpo_advantages",
    "kl_estimate",
    "kl_penalty_rewards",
    "per_turn_advantages",
    "policy_objective",
    "ppo_clip_loss",
    "truncated_is_weights",
    "turn_token_values",
    "vanilla_pg_loss",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'earl.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"earl.algorithms.{_LAZY[name]}"), name)
