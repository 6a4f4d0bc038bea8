"""What a client gets back from a reply, without sockets: malformed tool calls come back in
`tool_calls` with arguments that never parse (so LangChain's `ChatOpenAI` lists them in
`invalid_tool_calls`), `parallel_tool_calls: false` keeps the first call, a malformed call sent
back compares equal to the recorded reply, and tool results are counted once per returned call.
"""

from __future__ import annotations

import json

import pytest

from earl.agents.openai_protocol import assistant_message, parse_request
from earl.agents.openai_reply import ToolTally, reply_calls

MODEL = "earl-policy"
NAMES = {"calculator"}
GOOD = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>'
MALFORMED = [
    '<tool_call>{"name": "calculator", "arguments": "3+4"}</tool_call>',  # a string, not JSON
    '<tool_call>{"name": "calculator", "arguments": "5"}</tool_call>',    # JSON, not an object
    '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>',
    '<tool_call>{"name": "calculator", "arguments": 3+4}</tool_call>',    # not JSON
    '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}',  # not closed
]


def test_well_formed_calls_to_offered_tools_are_objects() -> None:
    content, calls = reply_calls(f"Let me see. {GOOD}", NAMES)
    assert content == "Let me see." and calls == [("calculator", {"expression": "1+1"})]
    unknown = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    assert reply_calls(unknown, NAMES) == (unknown, [])  # not offered: stays text
    assert reply_calls("no calls", NAMES) == ("no calls", [])


@pytest.mark.parametrize("text", MALFORMED)
def test_a_malformed_call_comes_back_with_its_text_as_arguments(text: str) -> None:
    content, [(name, args)] = reply_calls(text, NAMES)
    assert content == "" and name == "calculator" and args == text
    with pytest.raises(ValueError):
        json.loads(args)  # a client's JSON parse fails, whatever the model wrote


def test_a_malformed_call_without_a_readable_name_has_an_empty_name() -> None:
    _, [(name, args)] = reply_calls("<tool_call>{oops}</tool_call>", NAMES)
    assert (name, args) == ("", "<tool_call>{oops}</tool_call>")


@pytest.mark.parametrize("text", MALFORMED)
def test_langchain_lists_a_malformed_call_in_invalid_tool_calls(text: str) -> None:
    from langchain_openai.chat_models.base import _convert_dict_to_message

    name, args = reply_calls(text, NAMES)[1][0]
    msg = _convert_dict_to_message({"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1_0_0", "type": "function", "function": {"name": name, "arguments": args}}]})
    assert msg.tool_calls == []  # type: ignore[attr-defined]
    [bad] = msg.invalid_tool_calls  # type: ignore[attr-defined]
    assert (bad["name"], bad["args"], bad["id"]) == ("calculator", text, "call_1_0_0")


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    two = GOOD + GOOD.replace("1+1", "2+2") + MALFORMED[0]
    assert [a for _, a in reply_calls(two, NAMES)[1]] == [
        {"expression": "1+1"}, {"expression": "2+2"}, MALFORMED[0]]
    content, calls = reply_calls("ok " + two, NAMES, parallel=False)
    assert content == "ok" and calls == [("calculator", {"expression": "1+1"})]
    _, calls = reply_calls(MALFORMED[3] + GOOD, NAMES, parallel=False)
    assert calls == [("calculator", MALFORMED[3])]


def test_parallel_tool_calls_and_max_completion_tokens_are_read() -> None:
    def parse(**kw: object):  # type: ignore[no-untyped-def]
        return parse_request(json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "q"}], **kw}).encode(), model=MODEL)

    assert parse().parallel_tool_calls and parse(parallel_tool_calls=True).parallel_tool_calls
    assert not parse(parallel_tool_calls=False).parallel_tool_calls
    req = parse(max_completion_tokens=9)
    assert (req.max_tokens, req.max_tokens_field) == (9, "max_completion_tokens")
    req = parse(max_tokens=7)
    assert (req.max_tokens, req.max_tokens_field) == (7, "max_tokens")
    with pytest.raises(Exception, match="parallel_tool_calls must be a boolean"):
        parse(parallel_tool_calls="no")


def test_a_malformed_call_sent_back_compares_equal_and_its_result_is_read() -> None:
    text = f"Hm. {GOOD}{MALFORMED[3]}"
    content, calls = reply_calls(text, NAMES)
    recorded = assistant_message(content, calls)
    assert recorded["content"] == f"Hm.\n{MALFORMED[3]}"  # the model's text, for templates
    wire = [{"id": f"call_1_0_{j}", "type": "function", "function": {
        "name": n, "arguments": a if isinstance(a, str) else json.dumps(a)}}
        for j, (n, a) in enumerate(calls)]
    req = parse_request(json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": content, "tool_calls": wire},
        {"role": "tool", "tool_call_id": "call_1_0_0", "content": "2"},
        {"role": "tool", "tool_call_id": "call_1_0_1", "content": "Error: bad JSON"}]}).encode(),
        model=MODEL)
    assert req.messages[1] == recorded
    assert req.tool_results == [("call_1_0_0", "2"), ("call_1_0_1", "Error: bad JSON")]


def test_tool_results_count_once_per_returned_call() -> None:
    tally = ToolTally()
    tally.returned(["call_1_0_0", "call_1_0_1"])
    assert tally.answered([("call_1_0_0", "2"), ("made_up", "3")]) == (1, 0)
    # the next request carries the whole history again, plus the newer result
    assert tally.answered([("call_1_0_0", "2"), ("call_1_0_1", " Error: x")]) == (1, 1)
    assert tally.answered([("call_1_0_0", "2"), ("call_1_0_1", " Error: x")]) == (0, 0)
