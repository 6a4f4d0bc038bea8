"""Nothing a client asks for is silently changed, over real loopback sockets with the `openai`
client and a scripted engine: `parallel_tool_calls: false` gets one call, a client's `max_tokens`
is served up to the session's budget and the context window, a turn cut at the cap is text, a malformed call comes back as
OpenAI reports one and the session goes on token-exactly, and the tool calls an agent runs
itself are the episode's `info.tool_calls` / `info.tool_errors`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest
import pytest_asyncio
from recording import Recorder, assert_token_exact

from earl.agents.chat import ChatCodec
from earl.agents.openai_calc import MODEL, TOOLS
from earl.agents.openai_calc import agent as calc_agent
from earl.agents.openai_server import OpenAIEndpoint
from earl.agents.rollout import RolloutConfig, run_agent
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.models.tiny import build_tokenizer

pytestmark = pytest.mark.timeout(120)

GOOD = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
BAD = '<tool_call>{"name": "calculator", "arguments": 1+1}</tool_call>'


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


@pytest_asyncio.fixture
async def endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with OpenAIEndpoint() as ep:
        yield ep


def scripted(codec: ChatCodec, *replies: str, end: bool = True) -> Recorder:
    """An engine that answers the k-th request of a session with `replies[k]`."""

    def respond(prompt_ids: list[int], rng: object) -> list[int]:
        k = codec.decode(prompt_ids).count("<|im_start|>assistant") - 1
        return codec.encode_text(replies[k]) + ([codec.end_id] if end else [])

    return Recorder(SimEngine(SimConfig(time_scale=0.0), responder=respond))


def config(max_tokens: int = 64, **kw: object) -> RolloutConfig:
    return RolloutConfig(sampling=SamplingParams(max_tokens=max_tokens), **kw)  # type: ignore[arg-type]


async def test_parallel_tool_calls_false_returns_one_call(codec, endpoint) -> None:
    rec = scripted(codec, GOOD + GOOD.replace("1+1", "2+2"), "The answer is 2",
                   GOOD + GOOD.replace("1+1", "2+2"))
    got: dict[str, object] = {}

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        msgs = [{"role": "user", "content": "What is 1+1?"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                                 parallel_tool_calls=False)
        msg = r.choices[0].message
        got["one"] = [c.function.arguments for c in msg.tool_calls or []]
        msgs += [msg.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "2"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                                 parallel_tool_calls=False)
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "And again?"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        got["both"] = [c.function.arguments for c in r.choices[0].message.tool_calls or []]
        return 1.0

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        config=config(max_tokens=256))
    assert not t.failed, t.error
    assert got["one"] == ['{"expression": "1+1"}']
    assert got["both"] == ['{"expression": "1+1"}', '{"expression": "2+2"}']  # the default
    assert t.info["segments"] == 1 and t.info["tool_calls"] == 1  # the reply sent back matched
    assert_token_exact(t, rec)


async def test_a_clients_max_tokens_is_served_up_to_the_budget(codec, endpoint) -> None:
    """The run's per-turn max_tokens is a default, not a ceiling: a client's larger max_tokens
    is served (an agent framework's max_tokens=96 under a run's 64), cut only where the
    session's budget ends ("length"); a prompt with no room left is a 400 naming the budget."""
    long = "x " * 200  # longer than any cap here: the reply is cut where the cap ends
    rec = scripted(codec, *[long] * 4, end=False)
    got: list[tuple[int, str]] = []
    errors: list[openai.BadRequestError] = []
    prompt = len(codec.encode_prompt([{"role": "user", "content": "hi"}]))

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        msgs = [{"role": "user", "content": "hi"}]
        for kw in ({"max_tokens": 96}, {"max_completion_tokens": 80}, {}, {"max_tokens": 500}):
            r = await client.chat.completions.create(model=MODEL, messages=msgs, **kw)
            got.append((r.usage.completion_tokens, r.choices[0].finish_reason))
        try:  # a prompt that fills the budget: nothing can be served
            await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi " * 200}])
        except openai.BadRequestError as exc:
            errors.append(exc)
        return 1.0

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        config=config(max_total_tokens=prompt + 121))
    assert not t.failed, t.error
    # over the run's 64: served; left out: the run's 64; 500: what the budget leaves (120)
    assert got == [(96, "length"), (80, "length"), (64, "length"), (120, "length")]
    (budget,) = errors
    assert budget.code == "context_length_exceeded" and "max_total_tokens" in budget.message
    assert "leaves no room in this session's budget" in budget.message


async def test_a_clients_max_tokens_is_served_up_to_the_context_window(codec,
                                                                       endpoint) -> None:
    rec = scripted(codec, *["x " * 200] * 2, end=False)
    got: list[int] = []
    prompt = len(codec.encode_prompt([{"role": "user", "content": "hi"}]))

    async def agent(rollout, sample) -> float:
        r = await rollout.openai_client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4096)
        got.append(r.usage.completion_tokens)
        return 1.0

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        config=config(context_window=prompt + 100))
    assert not t.failed, t.error
    assert got == [100]  # up to the window, not the client's 4096 (no 400)


async def test_a_turn_cut_at_the_cap_is_text_never_a_tool_call(codec, endpoint) -> None:
    cut = GOOD + " and then I would go on"  # a completed call, then the cap cuts the turn
    rec = scripted(codec, cut, end=False)
    got = []

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        for stream in (False, True):
            r = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "q"}], tools=TOOLS,
                stream=stream)
            if stream:
                chunks = [c async for c in r]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                calls = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
                finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                got.append((text, bool(calls), finish))
            else:
                msg = r.choices[0].message
                got.append((msg.content, bool(msg.tool_calls), r.choices[0].finish_reason))
        return 0.0

    n = len(codec.encode_text(GOOD)) + 3
    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        config=config(max_tokens=n))
    assert not t.failed, t.error
    text = codec.decode(codec.encode_text(cut)[:n])
    assert text.startswith(GOOD) and len(text) > len(GOOD)
    assert got == [(text, False, "length")] * 2


async def test_a_malformed_call_comes_back_and_the_session_goes_on(codec, endpoint) -> None:
    """The example OpenAI-client agent runs a malformed call (its JSON parse fails: an error
    result), then a good one, then answers: both calls counted, one segment."""
    rec = scripted(codec, BAD, GOOD, "The answer is 2")
    t = await run_agent(calc_agent, {"question": "What is 1+1?", "answer": 2}, engine=rec,
                        codec=codec, endpoint=endpoint, config=config())
    assert not t.failed, t.error
    assert t.reward == 1.0 and t.num_turns == 3
    assert (t.info["tool_calls"], t.info["tool_errors"]) == (2, 1)
    assert t.info["segments"] == 1  # the malformed call sent back continued the record
    assert_token_exact(t, rec)
    assert "<tool_response>Error: JSONDecodeError" in codec.decode(t.token_ids)


async def test_calls_of_a_session_that_ends_without_sending_results_are_not_counted(
        codec, endpoint) -> None:
    rec = scripted(codec, GOOD)

    async def agent(rollout, sample) -> float:
        r = await rollout.openai_client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], tools=TOOLS)
        return float(bool(r.choices[0].message.tool_calls))

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint)
    assert t.reward == 1.0 and (t.info["tool_calls"], t.info["tool_errors"]) == (0, 0)
