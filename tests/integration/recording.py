"""A test helper: an engine wrapper that keeps every (prompt, generation) pair per session, so
tests can check that a trajectory holds exactly the tokens the engine saw and produced
(`assert_token_exact`)."""

from __future__ import annotations

from earl.engine import Generation
from earl.runtime.types import Trajectory


class Recorder:
    """Wraps an engine; keeps every (prompt, generation) pair per session."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.calls: dict[str, list[tuple[list[int], Generation]]] = {}

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version  # type: ignore[attr-defined]

    async def generate(self, prompt_ids, params, *, session_id=None) -> Generation:  # type: ignore[no-untyped-def]
        gen = await self.engine.generate(prompt_ids, params, session_id=session_id)  # type: ignore[attr-defined]
        self.calls.setdefault(session_id, []).append((list(prompt_ids), gen))
        return gen


def assert_token_exact(t: Trajectory, rec: Recorder) -> None:
    """Each engine call's prompt is the record before its sampled tokens (a forced tool-call
    opening, untrained, may start the turn); its tokens close the turn, trained."""
    calls = rec.calls[t.sample_id]
    assert len(calls) == t.num_turns
    for (prompt, gen), (start, end) in zip(calls, t.turn_spans, strict=True):
        n = len(prompt)
        assert prompt == t.token_ids[:n] and start <= n
        assert gen.token_ids == t.token_ids[n:end]
        assert gen.logprobs == t.logprobs[n:end] and gen.versions == t.versions[n:end]
        assert t.loss_mask[start:end] == [0] * (n - start) + [1] * (end - n)
    assert t.num_generated == sum(len(g.token_ids) for _, g in calls)
