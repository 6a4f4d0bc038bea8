"""The Tic-Tac-Toe recipe's evaluation (earl.recipes.tictactoe.evaluation): illegal or failed
games lose, first/second move alternate, decoding is greedy, and the eval seeds never meet
training or validation seeds (SimEngine, no processes)."""

from __future__ import annotations

import asyncio

import pytest

import earl.recipes.tictactoe.evaluation as ev
from earl.agents.chat import ChatCodec
from earl.agents.rollout import run_agent
from earl.agents.tictactoe import sim_responder
from earl.engine import Generation, SamplingParams, SimConfig, SimEngine
from earl.models.tiny import build_tokenizer
from earl.recipes.tictactoe import TRAIN_SEED, eval_seeds


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


class _Recorder:
    """An Engine that forwards to a SimEngine and keeps each call's prompt and params."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.calls: list[tuple[str | None, list[int], SamplingParams]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        self.calls.append((session_id, list(prompt_ids), params))
        return await self.engine.generate(prompt_ids, params, session_id=session_id)


@pytest.fixture
def seeds_played(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The game seed of every game `evaluate` plays (a spy around the real run_agent)."""
    seen: list[int] = []

    async def spy(agent, sample, **kw):  # type: ignore[no-untyped-def]
        seen.append(sample)
        return await run_agent(agent, sample, **kw)

    monkeypatch.setattr(ev, "run_agent", spy)
    return seen


def _evaluate(engine: object, codec: ChatCodec, **kw: object) -> ev.EvalResult:
    return asyncio.run(asyncio.wait_for(ev.evaluate(engine, codec, **kw), 60))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_illegal_moves_lose(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0), responder=sim_responder(codec, illegal_rate=1.0))
    res = _evaluate(engine, codec, games=20)
    assert res.games == 20
    assert res.loss_rate == 1.0 and res.illegal_rate == 1.0 and res.win_draw == 0.0
    assert res.first_win_draw == res.second_win_draw == 0.0


@pytest.mark.timeout(60)
def test_failed_game_is_a_loss(codec: ChatCodec) -> None:
    async def crashes(rollout, seed):  # type: ignore[no-untyped-def]
        rollout.info["outcome"] = "win"  # what it claimed before failing
        raise RuntimeError("agent bug")

    engine = SimEngine(SimConfig(time_scale=0.0), responder=sim_responder(codec))

    async def main():  # type: ignore[no-untyped-def]
        bad = await run_agent(crashes, 4, engine=engine, codec=codec)
        good = await run_agent(ev.make_agent(), 6, engine=engine, codec=codec)
        return bad, good

    bad, good = asyncio.run(asyncio.wait_for(main(), 30))
    assert bad.failed and bad.info["outcome"] == "win"
    bad.info["seed"], good.info["seed"] = 4, 6
    good.info["outcome"] = "win"
    res = ev.summarize([bad, good])
    assert res.win_rate == 0.5 and res.loss_rate == 0.5 and res.first_win_draw == 0.5
    with pytest.raises(ValueError, match="at least one game"):
        ev.summarize([])


@pytest.mark.timeout(60)
def test_games_alternate_first_and_second_and_are_greedy(codec: ChatCodec,
                                                         seeds_played: list[int]) -> None:
    engine = _Recorder(SimEngine(SimConfig(time_scale=0.0), responder=sim_responder(codec)))
    res = _evaluate(engine, codec, games=12, seed=ev.EVAL_SEED + 1)  # odd seed: rounded down
    assert sorted(seeds_played) == list(range(ev.EVAL_SEED, ev.EVAL_SEED + 12))
    first_prompts: dict[str, str] = {}
    for sid, prompt, params in engine.calls:
        assert params.temperature == 0.0  # greedy, whatever training samples at
        first_prompts.setdefault(str(sid), codec.decode(prompt))
    free = sorted(sum(ch in "123456789" for ch in p.rsplit("digit.", 1)[1])
                  for p in first_prompts.values())
    assert free == [8] * 6 + [9] * 6  # half the games the opponent has moved first
    assert res.games == 12 and abs(res.win_rate + res.draw_rate + res.loss_rate - 1) < 1e-9
    assert res.illegal_rate == 0.0  # a legal random player never loses by an illegal move
    with pytest.raises(ValueError, match="even"):
        _evaluate(engine, codec, games=7)


def test_eval_seeds_disjoint_from_training_and_validation() -> None:
    games = 200
    final = set(range(ev.EVAL_SEED, ev.EVAL_SEED + games))  # evaluate()'s default seeds
    assert set(eval_seeds("final", 700, games)) == final
    # the longest default run: 2000 steps of 64 games, one seed per game
    training = range(TRAIN_SEED, TRAIN_SEED + 2000 * 64)
    assert final.isdisjoint(training)
    start = set(eval_seeds("start", 0, games))
    assert start.isdisjoint(final) and start.isdisjoint(training)
    seen: set[int] = set()
    for step in range(20, 2001, 20):  # every validation eval of that run: fresh seeds each time
        val = set(eval_seeds("validation", step, games))
        assert len(val) == games
        assert val.isdisjoint(seen) and val.isdisjoint(final) and val.isdisjoint(start)
        assert val.isdisjoint(training)
        seen |= val
