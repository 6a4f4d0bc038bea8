"""The OpenAI-compatible endpoint over real loopback sockets, driven by the real `openai` client
and by an OpenAI Agents SDK agent: on SimEngine, on the tiny model through the vLLM rollout
actor (`vllm`), and on SmolLM2-135M (`slow`). Every request must land token-exactly in the
trajectory: each engine prompt is exactly the recorded tokens before its turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from dataclasses import asdict
from types import ModuleType

import aiohttp
import openai
import pytest
import pytest_asyncio
from recording import Recorder, assert_token_exact

from earl.agents.calc import tool_sim_responder
from earl.agents.chat import ChatCodec
from earl.agents.openai_calc import MODEL, TOOLS
from earl.agents.openai_calc import agent as calc_agent
from earl.agents.openai_server import EndpointConfig, OpenAIEndpoint
from earl.agents.rollout import RolloutConfig, run_agent
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.arithmetic import calculator as calc
from earl.models.tiny import build_tokenizer, default_model_dir
from earl.runtime.types import Trajectory
from earl.stages.compute import Compute

pytestmark = pytest.mark.timeout(120)


def agents_sdk() -> ModuleType:
    """The OpenAI Agents SDK (`import agents`), not this repository's `agents/` folder, which
    shadows it when the repository root is on sys.path."""
    mod = sys.modules.get("agents")
    if mod is not None and hasattr(mod, "Runner"):
        return mod
    saved = sys.path[:]
    sys.modules.pop("agents", None)
    sys.path[:] = [p for p in sys.path
                   if not os.path.isfile(os.path.join(p or os.getcwd(), "agents", "openai_calc.py"))]
    try:
        import agents as sdk
    finally:
        sys.path[:] = saved
    sdk.set_tracing_disabled(True)
    return sdk


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


@pytest_asyncio.fixture
async def endpoint() -> AsyncIterator[OpenAIEndpoint]:
    async with OpenAIEndpoint() as ep:
        yield ep


def sim(codec: ChatCodec, **kw: object) -> Recorder:
    return Recorder(SimEngine(SimConfig(time_scale=0.0, **kw),  # type: ignore[arg-type]
                              responder=tool_sim_responder(codec)))


def run_tool(call) -> dict[str, object]:
    args = json.loads(call.function.arguments)
    return {"role": "tool", "tool_call_id": call.id, "content": calc(args["expression"])}


async def test_openai_client_tool_calls_and_streaming_are_token_exact(codec, endpoint) -> None:
    rec = sim(codec)
    seen: dict[str, object] = {}

    async def agent(rollout, sample) -> float:
        client = openai.AsyncOpenAI(base_url=rollout.base_url, api_key=rollout.api_key)
        messages = [{"role": "user", "content": "What is 3 times 3?"}]
        r1 = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                  logprobs=True)
        msg = r1.choices[0].message
        seen["r1"] = r1
        messages += [msg.model_dump(exclude_none=True), *map(run_tool, msg.tool_calls or [])]
        rec.engine.set_policy_version(7)  # new weights arrive between turns
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, stream=True,
            stream_options={"include_usage": True})
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        seen.update(text=text, finish=finish, usage=usage)
        await client.close()
        return float(text.endswith("9"))

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint, sample_id="s1")
    assert not t.failed, t.error
    assert t.reward == 1.0 and t.info["segments"] == 1 and t.info["requests"] == 2
    r1 = seen["r1"]
    [call] = r1.choices[0].message.tool_calls  # type: ignore[attr-defined]
    assert r1.choices[0].finish_reason == "tool_calls"  # type: ignore[attr-defined]
    assert call.function.name == "calculator"
    assert json.loads(call.function.arguments) == {"expression": "3*3"}
    assert seen["text"] == "The answer is 9" and seen["finish"] == "stop"
    assert_token_exact(t, rec)
    (s1, e1), (s2, e2) = t.turn_spans
    assert set(t.versions[s1:e1]) == {0} and set(t.versions[s2:e2]) == {7}
    lps = [c.logprob for c in r1.choices[0].logprobs.content]  # type: ignore[attr-defined]
    assert lps == t.logprobs[s1:e1 - 1]  # the end-of-turn token is not part of the reply
    assert seen["usage"].prompt_tokens == s2  # type: ignore[attr-defined]


async def test_n_stop_seed_and_tool_choice(codec, endpoint) -> None:
    replies = iter(["alpha beta. gamma", "one. two", "ok", "x"])

    def respond(prompt_ids, rng):
        return codec.encode_text(next(replies)) + [codec.end_id]

    rec = Recorder(SimEngine(SimConfig(time_scale=0.0), responder=respond))
    out: dict[str, object] = {}

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        msgs = [{"role": "user", "content": "hi"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, n=2, seed=5,
                                                 stop=[". "], logprobs=True)
        out["contents"] = [c.message.content for c in r.choices]
        out["lp_tokens"] = ["".join(x.token for x in c.logprobs.content) for c in r.choices]
        msgs += [r.choices[1].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "and?"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs)
        msgs += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "use it"}]
        forced = await client.chat.completions.create(
            model=MODEL, messages=msgs, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "calculator"}})
        out["forced"] = forced.choices[0].message
        return 0.0

    segs: list[Trajectory] = []
    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint, segments=segs)
    assert not t.failed, t.error
    assert out["contents"] == ["alpha beta", "one"]
    assert out["lp_tokens"] == ["alpha beta. ", "one. "]  # tokens through the stop string
    # Choice 1 went on, choice 0 was dropped; tools appeared in request 3: a second segment.
    assert len(segs) == 1 and segs[0].reward == 0.0 and segs[0].sample_id.endswith("/0")
    assert segs[0].num_turns == 2 and "alpha" not in codec.decode(segs[0].token_ids)
    assert "one. <|im_end|>" in codec.decode(segs[0].token_ids)
    forced = out["forced"]
    # The forced opening is context, then the model went on with "x": a malformed call, which
    # comes back as OpenAI reports one, arguments that are not JSON (the model's text).
    [call] = forced.tool_calls  # type: ignore[attr-defined]
    assert call.function.name == "calculator" and forced.content is None  # type: ignore[attr-defined]
    assert call.function.arguments == '<tool_call>{"name": "calculator", "arguments": x'
    start, end = t.turn_spans[-1]
    opening = codec.encode_text('<tool_call>{"name": "calculator", "arguments": ')
    assert t.token_ids[start:start + len(opening)] == opening
    assert t.loss_mask[start:end] == [0] * len(opening) + [1] * (end - start - len(opening))


async def test_calls_to_offered_tools_are_tool_calls_malformed_ones_too(codec, endpoint) -> None:
    good = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
    replies = iter(['<tool_call>{"name": "search", "arguments": {}}</tool_call>',
                    f'Let me see. {good}<tool_call>{{"name": oops}}</tool_call>'])

    def respond(prompt_ids, rng):
        return codec.encode_text(next(replies)) + [codec.end_id]

    rec = Recorder(SimEngine(SimConfig(time_scale=0.0), responder=respond))
    got = []
    streamed: dict[str, object] = {"content": "", "calls": {}}

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        r = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], tools=TOOLS)
        got.append(r.choices[0])
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], tools=TOOLS, stream=True)
        async for chunk in stream:  # reassembled as OpenAI's docs show
            delta = chunk.choices[0].delta
            streamed["content"] += delta.content or ""  # type: ignore[operator]
            for tc in delta.tool_calls or []:
                call = streamed["calls"].setdefault(tc.index, {"name": "", "args": ""})  # type: ignore[attr-defined]
                call["name"] += tc.function.name or ""
                call["args"] += tc.function.arguments or ""
            streamed["finish"] = chunk.choices[0].finish_reason or streamed.get("finish")
        return 0.0

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        config=RolloutConfig(sampling=SamplingParams(max_tokens=200)))
    assert not t.failed, t.error
    [unknown] = got
    assert unknown.message.tool_calls is None and unknown.finish_reason == "stop"
    assert unknown.message.content.startswith('<tool_call>{"name": "search"')
    assert streamed["finish"] == "tool_calls"
    assert streamed["calls"] == {0: {"name": "calculator", "args": '{"expression": "1+1"}'},
                                 1: {"name": "", "args": '<tool_call>{"name": oops}</tool_call>'}}
    assert streamed["content"] == "Let me see."


async def test_auth_routes_and_session_lifetime(codec, endpoint) -> None:
    rec = sim(codec)
    urls: list[str] = []

    async def agent(rollout, sample) -> float:
        urls.append(rollout.base_url)
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"},
                            {"Authorization": rollout.api_key}):
                async with http.get(f"{rollout.base_url}/models", headers=headers) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["code"] == "invalid_api_key"
            ok = {"Authorization": f"Bearer {rollout.api_key}"}
            async with http.get(f"{rollout.base_url}/models", headers=ok) as resp:
                assert (await resp.json())["data"][0]["id"] == MODEL
            async with http.get(f"{rollout.base_url}/chat/completions", headers=ok) as resp:
                assert resp.status == 404
            other = rollout.base_url.replace("/s/", "/s/x")
            async with http.post(f"{other}/chat/completions", headers=ok, json={}) as resp:
                assert resp.status == 404
        bad = openai.AsyncOpenAI(base_url=rollout.base_url, api_key="earl-guess", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await bad.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                      "content": "q"}])
        await bad.close()
        return 0.0

    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint)
    assert not t.failed, t.error
    assert urls[0].startswith(f"http://127.0.0.1:{endpoint.port}/s/")
    client = openai.AsyncOpenAI(base_url=urls[0], api_key=endpoint.api_key, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no live session"):  # the session ended
        await client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                     "content": "q"}])
    await client.close()


async def test_hostile_bytes_do_not_hurt_the_server(codec) -> None:
    rec = sim(codec)

    async def agent(rollout, sample) -> float:
        host, port = "127.0.0.1", int(rollout.base_url.split(":")[2].split("/")[0])
        path = rollout.base_url.split(str(port), 1)[1] + "/chat/completions"
        auth = f"Host: {host}\r\nAuthorization: Bearer {rollout.api_key}\r\n".encode()
        deep = b'{"model": "earl-policy", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        raws = [
            b"\x00\xff garbage\r\n\r\n",
            b"POST " + path.encode() + b" HTTP/1.1\r\nContent-Length: 99999999999\r\n" + auth
            + b"\r\n",
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + auth
            + f"Content-Length: {len(deep)}\r\n\r\n".encode() + deep,
            b"POST " + path.encode() + b" HTTP/1.1\r\n" + auth + b"Content-Length: 3\r\n\r\n\xff\xfe\x00",
        ]
        statuses = []
        for raw in raws:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(raw)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 10)
            statuses.append(line.split()[1].decode() if line else "closed")
            writer.close()
        rollout.info["statuses"] = ",".join(statuses)
        return await calc_agent(rollout, {"question": "What is 7 times 7?", "answer": 49})

    async with OpenAIEndpoint(EndpointConfig(max_request_bytes=1 << 20)) as ep:
        t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=ep)
    assert not t.failed, t.error
    assert t.info["statuses"] == "400,413,400,400"  # garbage, huge, too deep, not UTF-8
    assert t.reward == 1.0 and t.num_turns == 2


async def test_bad_input_gets_an_error_and_the_session_goes_on(codec) -> None:
    rec = sim(codec, max_model_len=1000)
    errors: list[tuple[type, str | None, str]] = []

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        good = [{"role": "user", "content": "What is 2 times 2?"}]
        attempts = [
            {"model": "gpt-4o", "messages": good},
            {"model": MODEL, "messages": [{"role": "user", "content": 3}]},
            {"model": MODEL, "messages": good, "tools": [{"type": "function", "function": {
                "name": "calculator", "parameters": {"type": "object", "required": "x"}}}]},
            {"model": MODEL, "messages": [{"role": "user", "content": "long " * 250}]},
        ]
        for kw in attempts:
            try:
                await client.chat.completions.create(**kw)
            except openai.APIStatusError as exc:
                errors.append((type(exc), exc.code, exc.message))
        r = await client.chat.completions.create(model=MODEL, messages=good, tools=TOOLS)
        msg = r.choices[0].message
        good += [msg.model_dump(exclude_none=True), *map(run_tool, msg.tool_calls)]
        r = await client.chat.completions.create(model=MODEL, messages=good, tools=TOOLS)
        return float(r.choices[0].message.content == "The answer is 4")

    async with OpenAIEndpoint(EndpointConfig(model=MODEL)) as ep:
        t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=ep,
                            config=RolloutConfig(sampling=SamplingParams(max_tokens=96)))
    assert [(e[0], e[1]) for e in errors] == [
        (openai.NotFoundError, "model_not_found"), (openai.BadRequestError, None),
        (openai.BadRequestError, None), (openai.BadRequestError, "context_length_exceeded")]
    assert "'gpt-4o' does not exist" in errors[0][2]
    assert "messages[0].content must be a string" in errors[1][2]
    assert "tools[0].function.parameters is not a valid JSON Schema" in errors[2][2]
    assert "max_model_len=1000" in errors[3][2]
    assert not t.failed, t.error
    assert t.reward == 1.0
    assert t.info["segments"] == 1 and t.info["requests"] == 2  # failed requests left no trace
    assert_token_exact(t, rec)


async def test_a_rewritten_history_is_a_separate_segment(codec, endpoint) -> None:
    rec = sim(codec)

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        msgs = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 4 times 4?"}]
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        msg = r.choices[0].message
        msgs += [msg.model_dump(exclude_none=True), *map(run_tool, msg.tool_calls)]
        msgs = msgs[1:]  # context management: the client drops the system prompt
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS)
        return 1.0

    segs: list[Trajectory] = []
    t = await run_agent(agent, None, engine=rec, codec=codec, endpoint=endpoint,
                        sample_id="edit", group_id="g", segments=segs)
    assert not t.failed, t.error
    [first] = segs
    assert (first.sample_id, first.group_id, first.reward) == ("edit/0", "g", 1.0)
    assert first.num_turns == 1 and t.num_turns == 1 and t.info["segments"] == 2
    # The new segment re-renders the old tool call as prompt: nothing of it is trained.
    text = codec.decode(t.token_ids[: t.turn_spans[0][0]])
    assert '<tool_call>{"name": "calculator"' in text and "Be brief" not in text
    calls = rec.calls["edit"]
    assert calls[0][0] == first.token_ids[: first.turn_spans[0][0]]
    assert calls[1][0] == t.token_ids[: t.turn_spans[0][0]]


async def test_an_openai_agents_sdk_agent(codec, endpoint) -> None:
    sdk = agents_sdk()
    rec = sim(codec)

    @sdk.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * 4".
        """
        return calc(expression)

    async def agent(rollout, sample) -> float:
        model = sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=rollout.openai_client())
        bot = sdk.Agent(name="calc", instructions="Solve it.", model=model, tools=[calculator])
        result = await sdk.Runner.run(bot, sample, max_turns=4)
        return float(result.final_output.endswith("36"))

    t = await run_agent(agent, "What is 6 times 6?", engine=rec, codec=codec, endpoint=endpoint)
    assert not t.failed, t.error
    assert t.reward == 1.0 and t.num_turns == 2 and t.info["segments"] == 1
    assert_token_exact(t, rec)
    assert "<tool_response>36</tool_response>" in codec.decode(t.token_ids)


async def test_the_example_agent_and_many_concurrent_sessions(codec, endpoint) -> None:
    rec = sim(codec)
    samples = [{"question": f"What is {k} times {k}?", "answer": k * k} for k in range(2, 10)]
    trajs = await asyncio.wait_for(asyncio.gather(*(
        run_agent(calc_agent, samples[i % len(samples)], engine=rec, codec=codec,
                  endpoint=endpoint, sample_id=f"c{i}") for i in range(64))), 60)
    for t in trajs:
        assert not t.failed, t.error
        assert t.reward == 1.0 and t.num_turns == 2
        assert_token_exact(t, rec)


async def test_closing_a_sessions_client_leaves_the_shared_pool_open(codec, endpoint) -> None:
    rec = sim(codec)

    async def closes(rollout, sample) -> float:
        async with rollout.openai_client() as client:  # closes only this session's client
            await client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "What is 2 times 5?"}], tools=TOOLS)
        return 1.0

    first = await run_agent(closes, None, engine=rec, codec=codec, endpoint=endpoint)
    second = await run_agent(calc_agent, {"question": "What is 5 times 5?", "answer": 25},
                             engine=rec, codec=codec, endpoint=endpoint)
    assert not first.failed and not second.failed, (first.error, second.error)
    assert second.reward == 1.0 and second.num_turns == 2


# -- the real engine ---------------------------------------------------------------------------

@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rollout_engine() -> AsyncIterator[object]:
    from earl.runtime import Runtime
    from earl.stages.rollout import RolloutActor, RolloutClient
    from earl.stages.vllm_engine import EngineConfig

    cfg = asdict(EngineConfig(model=str(default_model_dir()), compute=Compute(dtype="float32"),
                              max_model_len=1024))
    async with Runtime() as rt:
        group = await rt.spawn("rollout", RolloutActor, cfg, env={"OMP_NUM_THREADS": "1"})
        yield RolloutClient(group)


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.asyncio(loop_scope="module")
async def test_tiny_model_through_the_rollout_actor(rollout_engine) -> None:
    from transformers import AutoTokenizer

    codec = ChatCodec(AutoTokenizer.from_pretrained(default_model_dir()))
    rec = Recorder(rollout_engine)
    sdk = agents_sdk()
    errors: list[str | None] = []

    async def agent(rollout, sample) -> float:
        client = rollout.openai_client()
        msgs = [{"role": "user", "content": f"Say something, {sample}."}]
        for turn in range(3):
            kw = {"stream": True} if turn == 1 else {"logprobs": True}
            r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS,
                                                     max_tokens=24, **kw)
            if turn == 1:
                text = "".join([c.choices[0].delta.content or "" async for c in r
                                if c.choices])
                msgs.append({"role": "assistant", "content": text})
            else:
                msgs.append(r.choices[0].message.model_dump(exclude_none=True))
            msgs.append({"role": "user", "content": "go on"})
        try:
            await client.chat.completions.create(
                model=MODEL, messages=[*msgs, {"role": "user", "content": "long " * 200}])
        except openai.BadRequestError as exc:
            errors.append(exc.code)
        return 0.5

    async def sdk_agent(rollout, sample) -> float:
        model = sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=rollout.openai_client())
        bot = sdk.Agent(name="chat", instructions="Be brief.", model=model,
                        model_settings=sdk.ModelSettings(max_tokens=16))
        result = await sdk.Runner.run(bot, sample, max_turns=2)
        return float(isinstance(result.final_output, str))

    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=32, temperature=1.0))
    async with OpenAIEndpoint() as ep:
        trajs = await asyncio.gather(*(run_agent(agent, i, engine=rec, codec=codec, config=cfg,
                                                 endpoint=ep, sample_id=f"v{i}")
                                       for i in range(4)))
        sdk_traj = await run_agent(sdk_agent, "hello", engine=rec, codec=codec, config=cfg,
                                   endpoint=ep, sample_id="sdk")
    # Continuing a branch the tiny model closed needs the client's text to match the model's
    # decoded reply, which holds for ChatML: one segment per session.
    for t in [*trajs, sdk_traj]:
        assert not t.failed, t.error
        assert t.info["segments"] == 1
        assert_token_exact(t, rec)
        assert all(lp <= 0 for lp in t.logprobs) and set(t.versions) <= {-1, 0}
    assert [t.num_turns for t in trajs] == [3] * 4 and sdk_traj.num_turns == 1
    assert errors == ["context_length_exceeded"] * 4


@pytest.mark.slow  # SmolLM2-135M on CPU: ~1 min with the conversion cached
@pytest.mark.timeout(600)
async def test_smollm2_calc_agents() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer

    from earl.envs.arithmetic import CalcTasks
    from earl.models.smollm2 import smollm2_dir
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    path = smollm2_dir()
    codec = ChatCodec(AutoTokenizer.from_pretrained(path))
    sdk = agents_sdk()

    @sdk.function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: e.g. "3 * 4".
        """
        return calc(expression)

    async def sdk_agent(rollout, sample) -> float:
        model = sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=rollout.openai_client())
        bot = sdk.Agent(name="calc", instructions="Use the calculator, then answer.",
                        model=model, tools=[calculator])
        try:
            result = await sdk.Runner.run(bot, sample["question"], max_turns=3)
        except sdk.exceptions.MaxTurnsExceeded:
            return 0.0
        return float(str(sample["answer"]) in str(result.final_output))

    async def forced_agent(rollout, sample) -> float:
        r = await rollout.openai_client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": sample["question"]}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "calculator"}})
        msg = r.choices[0].message
        # SmolLM2-135M rarely completes valid arguments; what it wrote follows the opening.
        opening = '<tool_call>{"name": "calculator", "arguments": '
        return float(bool(msg.tool_calls) or (msg.content or "").startswith(opening))

    tasks = CalcTasks("eval").take(3)
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=64, temperature=0.7))
    async with VLLMEngine(EngineConfig(model=str(path), max_model_len=2048)) as eng, \
            OpenAIEndpoint() as ep:
        rec = Recorder(eng)
        trajs = await asyncio.gather(*(
            run_agent(a, s, engine=rec, codec=codec, config=cfg, endpoint=ep,
                      sample_id=f"{n}{i}")
            for n, a in (("calc", calc_agent), ("sdk", sdk_agent), ("forced", forced_agent))
            for i, s in enumerate(tasks)))
    print([(t.sample_id, t.reward, t.num_turns, t.info) for t in trajs])
    forced = [t for t in trajs if t.sample_id.startswith("forced")]
    assert [t.reward for t in forced] == [1.0] * len(tasks)
    for t in trajs:
        assert not t.failed, t.error
        assert t.info["segments"] == 1, t.info
        assert_token_exact(t, rec)
