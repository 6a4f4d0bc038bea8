"""A test helper: an engine wrapper that keeps every (prompt, generation) pair per session, so
tests can check that a trajectory holds exactly the tokens the engine saw and produced."""

from __future__ import annotations

from earl.engine import Generation


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
