"""A third-party agent framework, unchanged, against the endpoint over loopback with a scripted
engine: a LangGraph ReAct agent over LangChain's `ChatOpenAI` (`langgraph_calc.py`) calls the
calculator and answers; the episode holds exactly the engine's tokens, trains only the sampled
ones, and counts the tool call. A malformed call reaches LangChain as an `invalid_tool_call`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import langgraph_calc  # a user's module (LangGraph, LangChain: the dev extra)
import pytest
import pytest_asyncio
from recording import Recorder, assert_token_exact

from earl.agents.calc import tool_sim_responder
from earl.agents.chat import ChatCodec
from earl.agents.openai_server import OpenAIEndpoint
from earl.agents.rollout import RolloutConfig, run_agent
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.models.tiny import build_tokenizer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


@pytest_asyncio.fixture
async def endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with OpenAIEndpoint() as ep:
        yield ep


async def test_a_langgraph_react_agent_is_recorded_token_exactly(codec, endpoint) -> None:
    rec = Recorder(SimEngine(SimConfig(time_scale=0.0), responder=tool_sim_responder(codec)))
    samples = [{"question": f"What is {k} times {k}?", "answer": k * k} for k in (3, 7)]
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=64))
    for i, sample in enumerate(samples):
        t = await run_agent(langgraph_calc.agent, sample, engine=rec, codec=codec,
                            endpoint=endpoint, config=cfg, sample_id=f"lg{i}")
        assert not t.failed, t.error
        assert t.reward == 1.0 and t.num_turns == 2
        assert t.info["segments"] == 1 and t.info["requests"] == 2  # one history, continued
        assert (t.info["tool_calls"], t.info["tool_errors"]) == (1, 0)
        assert_token_exact(t, rec)
        (s1, e1), (s2, e2) = t.turn_spans
        assert sum(t.loss_mask) == (e1 - s1) + (e2 - s2)  # only the sampled tokens train
        text = codec.decode(t.token_ids)
        k = sample["answer"]
        assert f"<tool_response>{k}</tool_response>" in text
        assert text.endswith(f"The answer is {k}<|im_end|>")


async def test_a_malformed_call_is_an_invalid_tool_call_in_langchain(codec, endpoint) -> None:
    from langchain_openai import ChatOpenAI

    bad = '<tool_call>{"name": "calculator", "arguments": "3 times 3"}</tool_call>'

    def respond(prompt_ids, rng):  # type: ignore[no-untyped-def]
        return codec.encode_text(bad) + [codec.end_id]

    rec = Recorder(SimEngine(SimConfig(time_scale=0.0), responder=respond))
    seen = []

    async def agent(rollout, sample) -> float:  # type: ignore[no-untyped-def]
        model = ChatOpenAI(model=langgraph_calc.MODEL, base_url=rollout.base_url,
                           api_key=rollout.api_key, max_retries=0)
        seen.append(await model.bind_tools([langgraph_calc.calculator]).ainvoke(sample))
        return 0.0

    t = await run_agent(agent, "What is 3 times 3?", engine=rec, codec=codec, endpoint=endpoint)
    assert not t.failed, t.error
    [msg] = seen
    assert msg.tool_calls == []
    [call] = msg.invalid_tool_calls
    assert (call["name"], call["args"]) == ("calculator", bad)
    assert "not valid JSON" in call["error"]
