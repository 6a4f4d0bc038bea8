"""OpenAI endpoint logic without sockets: request validation and token-exact recording.

Continuations reuse the recorded tokens (the model's own, even where re-tokenizing would give
other ids); edited, truncated or re-tooled histories start a new segment; `n` siblings that were
not continued are dropped; replies sent back by a client compare equal to the recorded ones.
"""

from __future__ import annotations

import json

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.openai_protocol import (
    APIError,
    Choice,
    assistant_message,
    completion_body,
    parse_request,
    stream_body,
)
from earl.agents.openai_record import SessionRecord, segment_trajectory
from earl.models.tiny import build_tokenizer
from earl.runtime.types import Generation

MODEL = "earl-policy"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "calc",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def gen(ids: list[int], version: int = 0, finish: str = "stop") -> Generation:
    return Generation(token_ids=ids, logprobs=[-0.5] * len(ids), versions=[version] * len(ids),
                      finish_reason=finish, prompt_tokens=0)


def body(**kw: object) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       **kw}).encode()


def reply(rec: SessionRecord, messages, ids, *, tools=None, version=0, n=1):
    """Answer `messages` with `ids` (n identical siblings); returns the prompt and reply."""
    p = rec.prompt(messages, tools)
    req = rec.start()
    text = rec.codec.decode(ids[:-1] if ids and ids[-1] == rec.codec.end_id else ids)
    msg = assistant_message(text, [])
    for _ in range(n):
        rec.add(p, req, forced=[], gen=gen(ids, version),
                closed=bool(ids) and ids[-1] == rec.codec.end_id, reply=msg)
    rec.commit(p)
    return p, msg


def test_continuation_reuses_the_models_own_tokens(codec: ChatCodec) -> None:
    rec = SessionRecord(codec)
    user = [{"role": "user", "content": "go"}]
    # The model spells "<tool_call>" one character at a time; re-encoding the text would give
    # the single added token instead: the continuation must keep the sampled ids.
    spelled = [codec.encode_text(ch)[0] for ch in "<tool_call>"] + [codec.end_id]
    assert codec.encode_text("<tool_call>") != spelled[:-1]
    p1, msg = reply(rec, user, spelled, version=3)
    history = [*user, msg, {"role": "user", "content": "again"}]
    p2, _ = reply(rec, history, codec.encode_text("ok") + [codec.end_id], version=4)
    assert p2.base is not None and rec.continued == 1 and rec.new_segments == 1
    n1 = len(p1.token_ids)
    assert p2.token_ids[:n1 + len(spelled)] == p1.token_ids + spelled
    assert p2.token_ids[n1 + len(spelled):] == codec.encode_continuation(history[2:])
    [seg] = rec.segments()
    t = segment_trajectory(seg, sample_id="s", group_id="g")
    assert t.token_ids[: len(p2.token_ids)] == p2.token_ids
    (s1, e1), (s2, e2) = t.turn_spans
    assert t.token_ids[s1:e1] == spelled and t.versions[s1:e1] == [3] * len(spelled)
    assert t.versions[s2:e2] == [4] * (e2 - s2) and t.logprobs[s2:e2] == [-0.5] * (e2 - s2)
    assert sum(t.loss_mask) == (e1 - s1) + (e2 - s2)  # prompts and observations are not trained
    assert t.versions[e1:s2] == [-1] * (s2 - e1)


@pytest.mark.parametrize("change", ["edit", "truncate", "tools", "reorder"])
def test_a_rewritten_history_starts_a_new_segment(codec: ChatCodec, change: str) -> None:
    rec = SessionRecord(codec)
    first = [{"role": "system", "content": "sys"}, {"role": "user", "content": "q1"}]
    _, msg = reply(rec, first, codec.encode_text("a1") + [codec.end_id], tools=TOOLS)
    history = [*first, msg, {"role": "user", "content": "q2"}]
    tools: list | None = TOOLS
    if change == "edit":  # the client rewrote the assistant's reply
        history[2] = assistant_message("a1 (edited)", [])
    elif change == "truncate":  # the client dropped the system prompt to save context
        history = history[1:]
    elif change == "tools":
        tools = None
    else:
        history[0], history[1] = history[1], history[0]
    p2, _ = reply(rec, history, codec.encode_text("a2") + [codec.end_id], tools=tools)
    assert p2.base is None
    assert p2.token_ids == codec.encode_prompt(history, tools)  # rendered from scratch
    old, new = rec.segments()
    assert old.history == [*first, msg]
    t = segment_trajectory(new, sample_id="s", group_id="g")
    assert t.num_turns == 1 and t.num_generated == len(codec.encode_text("a2")) + 1


def test_an_unchosen_sibling_is_dropped_and_a_failed_request_gives_its_branch_back(
        codec: ChatCodec) -> None:
    rec = SessionRecord(codec)
    user = [{"role": "user", "content": "q"}]
    p = rec.prompt(user, None)
    req = rec.start()
    msgs = []
    for text in ("first", "second"):
        msgs.append(assistant_message(text, []))
        rec.add(p, req, forced=[], gen=gen(codec.encode_text(text) + [codec.end_id]),
                closed=True, reply=msgs[-1])
    assert len(rec.segments()) == 2  # nothing chosen yet: both are answers
    history = [*user, msgs[1], {"role": "user", "content": "more"}]
    p2 = rec.prompt(history, None)
    assert p2.base is not None and p2.base.history[-1] == msgs[1]
    rec.release(p2)  # the engine failed: the branch is continuable again
    p3 = rec.prompt(history, None)
    assert p3.base is p2.base
    rec.add(p3, rec.start(), forced=[], gen=gen(codec.encode_text("x") + [codec.end_id]),
            closed=True, reply=assistant_message("x", []))
    [seg] = rec.segments()  # "first" was not chosen: dropped
    assert seg.history[1] == msgs[1]


def test_unclosed_turns_get_an_untrained_end_token_and_forced_tokens_are_context(
        codec: ChatCodec) -> None:
    rec = SessionRecord(codec)
    user = [{"role": "user", "content": "q"}]
    p = rec.prompt(user, TOOLS)
    forced = codec.encode_text('<tool_call>{"name": "calculator", "arguments": ')
    out = codec.encode_text('{"expression": "1+')
    b = rec.add(p, rec.start(), forced=forced, gen=gen(out, finish="length"), closed=False,
                reply=assistant_message("", []))
    start, end = b.turn_spans[0]
    assert b.token_ids[start:end] == forced + out
    assert b.loss_mask[start:end] == [0] * len(forced) + [1] * len(out)
    assert b.token_ids[end:] == [codec.end_id] and b.loss_mask[end:] == [0]
    assert b.truncated


def test_a_reply_sent_back_by_a_client_compares_equal() -> None:
    recorded = assistant_message("", [("calculator", {"expression": "2*3"})])
    # what openai's ChatCompletionMessage.model_dump(exclude_none=True) sends back
    sent = {"role": "assistant", "tool_calls": [{
        "id": "call_1_0_0", "type": "function",
        "function": {"name": "calculator", "arguments": "{\"expression\": \"2*3\"}"}}]}
    req = parse_request(json.dumps({"model": MODEL, "tools": TOOLS, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "q"}]}, sent,
        {"role": "tool", "tool_call_id": "call_1_0_0", "content": "6"}]}).encode(), model=MODEL)
    assert req.messages[1] == recorded
    assert req.messages[0] == {"role": "user", "content": "q"}
    assert req.messages[2] == {"role": "tool", "content": "6", "name": "calculator"}


def test_request_options_are_read() -> None:
    req = parse_request(body(n=3, temperature=0.5, top_p=0.9, max_completion_tokens=7,
                             stop="\n\n", logprobs=True, seed=11, stream=True,
                             stream_options={"include_usage": True}, tools=TOOLS,
                             tool_choice={"type": "function", "function": {"name": "calculator"}},
                             store=False, parallel_tool_calls=True, presence_penalty=0),
                        model=MODEL)
    assert (req.n, req.temperature, req.top_p, req.max_tokens, req.stop, req.seed) == \
        (3, 0.5, 0.9, 7, ["\n\n"], 11)
    assert req.logprobs and req.stream and req.include_usage
    assert req.tool_choice == "calculator"
    assert parse_request(body(), model=MODEL).tool_choice == "auto"


BAD = [
    (body(model="gpt-4o"), 404, "model", "does not exist"),
    (b"{not json", 400, None, "not valid JSON"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages", "non-empty"),
    (body(messages=[{"content": "hi"}]), 400, "messages[0].role", "role must be one of"),
    (body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content", "string"),
    (body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400,
     "messages[0].content[0]", "images"),
    (body(messages=[{"role": "tool", "content": "6"}]), 400, "messages[0].tool_call_id",
     "tool_call_id"),
    (body(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]), 400, "messages[0].tool_calls[0].function.arguments",
     "JSON object"),
    (body(messages=[{"role": "user"}]), 400, "messages[0].content", "string"),
    (body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objekt"}}}]), 400, "tools[0].function.parameters", "not a valid JSON Schema"),
    (body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "minLength": -1}}}}}]),
     400, "tools[0].function.parameters", "not a valid JSON Schema"),
    (body(tools=[{"type": "function", "function": {"name": "bad name!"}}]), 400,
     "tools[0].function.name", "must match"),
    (body(tools=[{"name": "f"}]), 400, "tools[0]", '"type": "function"'),
    (body(tool_choice="required"), 400, "tool_choice", "needs tools"),
    (body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice", "not in tools"),
    (body(n=99), 400, "n", "integer in [1, 8]"),
    (body(temperature=-1), 400, "temperature", "number in"),
    (body(max_tokens=0), 400, "max_tokens", "integer in"),
    (body(stop=["a", "b", "c", "d", "e"]), 400, "stop", "up to 4"),
    (body(top_logprobs=3, logprobs=True), 400, "top_logprobs", "sampled token"),
    (body(response_format={"type": "json_object"}), 400, "response_format", "not supported"),
    (body(presence_penalty=0.5), 400, "presence_penalty", "not supported"),
]


@pytest.mark.parametrize(("raw", "status", "param", "text"), BAD)
def test_bad_requests_get_an_openai_error_naming_the_field(raw: bytes, status: int,
                                                           param: str | None, text: str) -> None:
    with pytest.raises(APIError) as err:
        parse_request(raw, model=MODEL)
    e = err.value
    assert (e.status, e.param) == (status, param)
    assert text in e.message
    payload = e.body()["error"]
    assert payload["message"] == e.message and payload["type"] == "invalid_request_error"  # type: ignore[index]


def test_response_bodies_are_openai_shaped() -> None:
    choices = [Choice(content=None, tool_calls=[("call_1_0_0", "calculator", '{"expression": "1"}')],
                      finish_reason="tool_calls", logprobs=[("<", -0.1)]),
               Choice(content="hi", tool_calls=[], finish_reason="stop")]
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    obj = json.loads(completion_body("id1", 1, MODEL, choices, usage))
    assert obj["object"] == "chat.completion" and obj["usage"] == usage
    c0 = obj["choices"][0]
    assert c0["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert c0["logprobs"]["content"][0]["logprob"] == -0.1
    events = stream_body("id1", 1, MODEL, choices, usage).decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert chunks[-1]["usage"] == usage and chunks[-1]["choices"] == []
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]
                if c["choices"][0]["finish_reason"]]
    assert finishes == ["tool_calls", "stop"]
    streamed_lps = [c["choices"][0]["logprobs"] for c in chunks[:-1] if c["choices"][0]["logprobs"]]
    assert streamed_lps and streamed_lps[0]["content"][0]["token"] == "<"


async def test_an_agents_own_timeout_error_fails_its_trajectory(codec: ChatCodec) -> None:
    from earl.agents.rollout import run_agent
    from earl.engine import SimConfig, SimEngine

    async def agent(rollout, sample) -> float:  # e.g. an HTTP client's own timeout
        raise TimeoutError("read timed out")

    t = await run_agent(agent, None, engine=SimEngine(SimConfig(time_scale=0.0)), codec=codec)
    assert t.failed and t.error == "TimeoutError: read timed out"
