"""SamplingParams.min_tokens on the simulated engine: stop tokens cannot end a turn early
(the vLLM engine passes it to vLLM; bench/rollout.py's slow test checks exact counts there)."""

from __future__ import annotations

import asyncio

import pytest

from earl.engine import SamplingParams, SimConfig, SimEngine


def _gen(engine: SimEngine, params: SamplingParams, seed: int):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(engine.generate([1, 2, 3], params, session_id=str(seed)),
                                        10))


@pytest.mark.timeout(60)
def test_min_tokens_equal_to_max_gives_exact_counts_without_stops() -> None:
    engine = SimEngine(SimConfig(time_scale=0.0, vocab_size=8))  # stops are 1 in 4 tokens
    stops = [5, 7]
    for seed in range(50):
        g = _gen(engine, SamplingParams(max_tokens=12, min_tokens=12, stop_token_ids=stops,
                                        seed=seed), seed)
        assert len(g.token_ids) == 12 and g.finish_reason == "length"
        assert not set(stops) & set(g.token_ids)
        free = _gen(engine, SamplingParams(max_tokens=12, stop_token_ids=stops, seed=seed), seed)
        if free.finish_reason == "stop":
            assert free.token_ids[-1] in stops


@pytest.mark.timeout(60)
def test_min_tokens_below_max_and_responder_padding() -> None:
    engine = SimEngine(SimConfig(time_scale=0.0, vocab_size=8))
    lengths = set()
    for seed in range(50):
        g = _gen(engine, SamplingParams(max_tokens=10, min_tokens=4, stop_token_ids=[5],
                                        seed=seed), seed)
        assert 4 <= len(g.token_ids) <= 10 and 5 not in g.token_ids[:4]
        lengths.add(len(g.token_ids))
    assert len(lengths) > 1  # above the minimum, stops still end turns
    short = SimEngine(SimConfig(time_scale=0.0), responder=lambda prompt, rng: [9, 5])
    g = _gen(short, SamplingParams(max_tokens=8, min_tokens=6, stop_token_ids=[5]), 0)
    assert len(g.token_ids) == 6 and g.token_ids[0] == 9 and 5 not in g.token_ids


def test_min_tokens_validation() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=-1)
    assert SamplingParams(max_tokens=4, min_tokens=9).min_tokens == 9  # capped at max_tokens
