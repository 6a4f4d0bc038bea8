"""The plain records producers and the driver exchange: metadata, never tokens.

The driver deals a batch's groups to the producer actors (`GroupTask`); each producer keeps a
trajectory's token columns in its own warehouse shard of the dock, under ids from `sample_id`,
and sends back a `BatchResult` of `Episode`s: the numbers that metrics, evals, stop rules and
`earl inspect` read. Both the producer (`earl.stages.producer`) and the loop (`earl.loop`)
import these types from here; this module imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from earl.runtime.types import Trajectory
from earl.runtime.wire import message

__all__ = ["BatchResult", "Episode", "GroupTask", "batch_of", "episode_of", "sample_id"]


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
        first_version: the version of its oldest generated token (-1: none generated).
        last_version: the version of its newest generated token (-1: none generated). A step
            trains a sample's tokens inside `max_policy_lag`; one with none inside is dropped.
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
    first_version: int = -1
    last_version: int = -1
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
                   first_version=min(gen_versions, default=-1),
                   last_version=max(gen_versions, default=-1),
                   gen_time_s=t.gen_time_s, tool_time_s=t.tool_time_s, info=dict(t.info))


def sample_id(batch: int, j: int, tag: str = "", rank: int = 0) -> str:
    """Dock id of row `j` of producer `rank`'s share of a batch's play ("" tag) or of a re-play
    after a fault ("x1", ...); unique across producers."""
    return f"b{batch:06d}-p{rank}-{tag + '-' if tag else ''}{j:04d}"


def batch_of(sample_id: str) -> int:
    """The batch of a `sample_id` ("b000012-..." -> 12; -1 for an id it did not make)."""
    head = sample_id.partition("-")[0]
    return int(head[1:]) if head[:1] == "b" and head[1:].isdigit() else -1


@message
@dataclass(kw_only=True, slots=True)
class GroupTask:
    """One group to play: `samples[i]` is member i's task (equal for GRPO groups)."""

    group_id: str
    samples: list[object]


@message
@dataclass(kw_only=True, slots=True)
class BatchResult:
    """What the driver gets back for one batch: metadata only.

    Attributes:
        episodes: one per trajectory kept, in group order.
        samples: rows put in the dock (trajectories plus self-imitation samples).
        seconds: wall time of the batch's play.
        cut: ids of the over-sampled groups cut unfinished (nothing of them was kept).
        row_groups: the group of each row put, in the order of the rows' sample ids.
    """

    batch: int
    episodes: list[Episode]
    samples: int
    seconds: float
    cut: list[str] = field(default_factory=list)
    row_groups: list[str] = field(default_factory=list)
