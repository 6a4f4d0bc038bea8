"""Token-exact recording of chat-completion requests into segments of a trajectory.

An OpenAI client sends its whole message history with every request. `SessionRecord` keeps one
*branch* per reply it has returned: the messages that led to it (in the template's form), the
reply, and the token record (ids, loss mask, sampling log-probs, policy versions, turn spans).
A request whose history starts with a branch's messages *continues* it: its prompt is that
branch's tokens, the model's own sampled tokens included, plus only the new messages encoded
as a continuation (`ChatCodec.encode_continuation`), so nothing is re-tokenized. A request that
continues no branch (the client edited, reordered or truncated its history, or changed the tools)
starts a new *segment* rendered from scratch: the old messages are prompt tokens there (loss mask
0), so the trainer never trains on tokens the model did not see in its context.

Segments as the trainer sees them: each segment is its own token row, a separate `Trajectory`
(the dock's columns are per-sample rows; concatenating segments would condition later tokens on
a context the model never had). At the end of a session the branches nobody continued are the
segments; the newest one is the session's main trajectory, the others are listed in
`Rollout.segments` and returned by `run_agent(..., segments=...)` with the episode's reward.
A sibling reply (another of `n` choices, or a concurrent request from the same history) that was
not continued while another was is dropped: the agent chose against it.

This module does not talk HTTP (`earl.agents.openai_server`) or validate requests
(`earl.agents.openai_protocol`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from earl.agents.chat import ChatCodec, Message
from earl.runtime.types import Generation, Trajectory

__all__ = ["Branch", "Prompt", "SessionRecord"]

Body = dict[str, object]


@dataclass(kw_only=True, slots=True)
class Branch:
    """One recorded reply and everything before it in its segment."""

    history: list[Message]
    tools: list[Body] | None
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    truncated: bool = False
    request: int = 0          # the request that produced it; siblings share it
    superseded: bool = False  # a sibling was continued instead


@dataclass(kw_only=True, slots=True)
class Prompt:
    """The tokens a request is answered from.

    Attributes:
        token_ids: the full prompt (the continued branch's tokens + the new messages' tokens).
        base: the branch this request continues, or None for a new segment.
        messages: the request's messages (template form).
        tools: the request's tools.
    """

    token_ids: list[int]
    base: Branch | None
    messages: list[Message]
    tools: list[Body] | None


class SessionRecord:
    """The branches of one session (see the module docstring).

    Args:
        codec: the ChatCodec of the rollout, so prompts render exactly as `rollout.generate`'s.
    """

    def __init__(self, codec: ChatCodec) -> None:
        self.codec = codec
        self.leaves: list[Branch] = []
        self.requests = 0
        self.continued = 0       # requests that reused recorded tokens
        self.new_segments = 0    # requests rendered from scratch

    def prompt(self, messages: list[Message], tools: list[Body] | None) -> Prompt:
        """The prompt for a request; takes the continued branch out of the leaves (give it back
        with `release` if the request fails)."""
        for k in range(len(self.leaves) - 1, -1, -1):
            leaf = self.leaves[k]
            n = len(leaf.history)
            if leaf.tools == tools and len(messages) >= n and messages[:n] == leaf.history:
                del self.leaves[k]
                ids = leaf.token_ids + self.codec.encode_continuation(messages[n:])
                return Prompt(token_ids=ids, base=leaf, messages=messages, tools=tools)
        ids = self.codec.encode_prompt(messages, tools)
        return Prompt(token_ids=ids, base=None, messages=messages, tools=tools)

    def release(self, prompt: Prompt) -> None:
        """Give back the branch a failed request had taken."""
        if prompt.base is not None:
            self.leaves.append(prompt.base)

    def start(self) -> int:
        """Number a new request (its replies become siblings)."""
        self.requests += 1
        return self.requests

    def add(self, prompt: Prompt, request: int, *, forced: list[int], gen: Generation,
            closed: bool, reply: Message) -> Branch:
        """Record one reply to `prompt`.

        Args:
            prompt: from `prompt()`.
            request: from `start()`.
            forced: tokens put at the start of the reply by the endpoint (a forced tool call's
                opening), in context but not trained.
            gen: the engine's output, already cut at a stop string.
            closed: `gen` ends with the end-of-turn token; otherwise one is appended (not
                trained) so the next prompt is well formed.
            reply: the assistant message as returned to the client (template form).
        """
        base = prompt.base
        if base is not None:
            b = Branch(history=[], tools=prompt.tools, token_ids=list(base.token_ids),
                       loss_mask=list(base.loss_mask), logprobs=list(base.logprobs),
                       versions=list(base.versions), turn_spans=list(base.turn_spans),
                       truncated=base.truncated)
            for leaf in self.leaves:
                if leaf.request == base.request:
                    leaf.superseded = True
        else:
            b = Branch(history=[], tools=prompt.tools)
        new = len(prompt.token_ids) - len(b.token_ids)
        b.token_ids += prompt.token_ids[len(b.token_ids):] + forced
        b.loss_mask += [0] * (new + len(forced))
        b.logprobs += [0.0] * (new + len(forced))
        b.versions += [-1] * (new + len(forced))
        start = len(b.token_ids) - len(forced)
        b.token_ids += gen.token_ids
        b.loss_mask += [1] * len(gen.token_ids)
        b.logprobs += gen.logprobs
        b.versions += gen.versions
        b.turn_spans.append((start, len(b.token_ids)))
        if not closed:
            b.token_ids.append(self.codec.end_id)
            b.loss_mask.append(0)
            b.logprobs.append(0.0)
            b.versions.append(-1)
        b.truncated |= gen.finish_reason == "length"
        b.history = [*prompt.messages, reply]
        b.request = request
        self.leaves.append(b)
        return b

    def commit(self, prompt: Prompt) -> None:
        """Count a request whose replies were all recorded."""
        if prompt.base is None:
            self.new_segments += 1
        else:
            self.continued += 1

    def segments(self) -> list[Branch]:
        """The branches to train on, oldest first (the last is the session's main one)."""
        return [b for b in self.leaves if not b.superseded]


def segment_trajectory(branch: Branch, *, sample_id: str, group_id: str) -> Trajectory:
    """A segment as its own Trajectory (reward and status are filled in by `run_agent`)."""
    traj = Trajectory(sample_id=sample_id, group_id=group_id, token_ids=list(branch.token_ids),
                      loss_mask=list(branch.loss_mask), logprobs=list(branch.logprobs),
                      versions=list(branch.versions), turn_spans=list(branch.turn_spans),
                      truncated=branch.truncated, info={"messages": len(branch.history)})
    traj.validate()
    return traj
