"""The record of one agent session: tokens, loss mask, log-probs, versions, turns, reward, timing.

A `Trajectory` is what the rollout side hands to the trainer side; it is plain data (no tensors,
no tokenizer). `earl.agents.rollout.Rollout` builds it; the pipeline turns it into dock columns
("input_ids", "loss_mask", "rollout_logprobs", "versions").
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Trajectory"]


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One multi-turn sample.

    Attributes:
        sample_id: unique id of this trajectory.
        group_id: id shared by trajectories of the same prompt (GRPO groups).
        token_ids: the whole conversation as token ids, prompt included.
        loss_mask: 1 for tokens the model generated, 0 for prompt/tool/observation tokens.
        logprobs: sampling log-prob per token (0.0 where loss_mask is 0).
        versions: policy version per token (-1 where loss_mask is 0).
        turn_spans: [start, end) of each assistant turn in token_ids.
        turn_rewards: optional per-turn reward (per-move credit); [] when unused.
        reward: scalar reward; None when the agent rejected the trajectory.
        truncated: a per-turn or per-trajectory token cap was hit.
        failed: the agent raised or timed out.
        error: the error text when failed.
        gen_time_s: wall time spent waiting on the engine.
        tool_time_s: wall time spent waiting on tools.
        info: small scalars about the episode, e.g. {"outcome": "win", "illegal": 0}.
    """

    sample_id: str
    group_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float | None = None
    truncated: bool = False
    failed: bool = False
    error: str | None = None
    gen_time_s: float = 0.0
    tool_time_s: float = 0.0
    info: dict[str, float | int | str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> None:
        """Raise ValueError if the per-token columns or turn spans are inconsistent."""
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                                 f"token_ids has {n}; every per-token column needs one per token")
        prev = 0
        for start, end in self.turn_spans:
            if not prev <= start <= end <= n:
                raise ValueError(f"Trajectory.turn_spans entry {(start, end)} is out of order or "
                                 f"outside [0, {n}]")
            prev = end
        if self.turn_rewards and len(self.turn_rewards) != len(self.turn_spans):
            raise ValueError(f"Trajectory.turn_rewards has {len(self.turn_rewards)} entries for "
                             f"{len(self.turn_spans)} turns; give one per turn or none")
