"""What a run's producers play and keep, declared once: `ProducerSettings`.

The run's config is one (`earl.config.RunConfig`: `--agent`, `--reward`, `--max_tokens`,
`--tool_timeout_s`, `--dump_share` are its top-level keys) and so is each producer's
(`earl.stages.producer.ProducerConfig`), which the run builds from the run's with
`earl.stages.compute.fields_of`, the recipe's agent and per-turn cap resolved. Imports nothing
heavy: the run's config module reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from earl.runtime.errors import need

__all__ = ["ProducerSettings"]


@dataclass(kw_only=True)
class ProducerSettings:
    """How each episode is played and kept. Without slots, like `earl.stages.compute.Seeded`,
    so that a slotted config can join it.

    Attributes:
        agent: the agent's reference, "module:name" or "/path/file.py:name" (a run's "": the
            recipe's; a producer's is always resolved).
        reward: a reward rule's reference ("" = the agent's own reward): `reward(sample,
            response)` scores the final assistant text and replaces the agent's return.
        max_tokens: per-turn generation cap (a run's 0: the recipe's).
        tool_timeout_s: per tool call; a call taking longer comes back to the agent as an
            error and the session goes on (a hung sync tool is left on its thread, see
            `run_local`).
        dump_share: the share of groups dumped for `earl inspect` (whole groups; 1 = all;
            failed episodes always are).
    """

    agent: str = ""
    reward: str = ""
    max_tokens: int = 0
    tool_timeout_s: float = 30.0
    dump_share: float = 0.1

    def __post_init__(self) -> None:
        need(self.max_tokens >= 0, "max_tokens", "must be >= 0 (0 = the recipe's per-turn cap)")
        need(self.tool_timeout_s > 0, "tool_timeout_s",
             "must be > 0 seconds (a tool call taking longer comes back to the agent as an "
             "error)")
        need(0 < self.dump_share <= 1, "dump_share",
             "must be in (0, 1] (the share of groups dumped; 1 = all)")
