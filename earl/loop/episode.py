"""What the driver learns about one finished agent session: metadata, never tokens.

Producer actors keep a trajectory's token columns in their own warehouse shard and send the
driver an `Episode`: the numbers that metrics, evals, stop rules and `earl inspect` read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from earl.runtime.types import Trajectory
from earl.runtime.wire import message

__all__ = ["Episode", "episode_of"]


@message
@dataclass(kw_only=True, slots=True)
class Episode:
    """One agent session's outcome (see `Trajectory` for the field meanings).

    Attributes:
        tokens: trajectory length, prompt included.
        generated: tokens the policy generated (loss-mask ones).
        turns: assistant turns.
        version_sum: sum of the policy versions that sampled the generated tokens (the driver
            derives the mean staleness from it without seeing tokens).
    """

    sample_id: str
    group_id: str
    reward: float | None
    turn_rewards: list[float] = field(default_factory=list)
    failed: bool = False
    error: str | None = None
    truncated: bool = False
    tokens: int = 0
    generated: int = 0
    turns: int = 0
    version_sum: int = 0
    gen_time_s: float = 0.0
    tool_time_s: float = 0.0
    info: dict[str, float | int | str] = field(default_factory=dict)


def episode_of(t: Trajectory) -> Episode:
    """The metadata of trajectory `t`."""
    gen_versions = [v for v, m in zip(t.versions, t.loss_mask, strict=True) if m]
    return Episode(sample_id=t.sample_id, group_id=t.group_id, reward=t.reward,
                   turn_rewards=list(t.turn_rewards), failed=t.failed, error=t.error,
                   truncated=t.truncated, tokens=len(t.token_ids), generated=len(gen_versions),
                   turns=len(t.turn_spans), version_sum=sum(gen_versions),
                   gen_time_s=t.gen_time_s, tool_time_s=t.tool_time_s, info=dict(t.info))
