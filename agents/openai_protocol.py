"""The OpenAI chat-completions wire format: request validation and response objects.

`parse_request` turns a request body into a typed `ChatRequest` whose messages are already in
the form the chat template renders (text content, tool-call arguments as JSON objects, tool
results named after their call), or raises `APIError` naming the offending field. It bounds the
number of messages and tools and the characters they carry (`Limits`, far above what fits in a
model's context), so that one request cannot make the endpoint render and tokenize without end.
The `completion_body` and `stream_body` builders write the `chat.completion` object and its
server-sent-events form. This module knows nothing about tokens, engines or HTTP.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from earl.agents.chat import Message
from earl.agents.openai_reply import Call, is_raw_call

__all__ = ["APIError", "ChatRequest", "Choice", "Limits", "assistant_message", "completion_body",
           "parse_request", "stream_body"]

Body = dict[str, object]
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# Set to a non-default value these would change sampling in ways EARL's engines do not do.
_UNSUPPORTED: dict[str, object] = {
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "functions": [],
    "function_call": "auto", "audio": None, "prediction": None, "web_search_options": None,
}


class APIError(Exception):
    """An OpenAI-style error: HTTP status plus the `{"error": {...}}` object.

    Args:
        status: HTTP status code.
        message: what is wrong and how to fix it.
        param: the request field at fault ("messages[2].content").
        code: OpenAI's machine-readable code ("model_not_found", "context_length_exceeded").
        type: OpenAI's error type.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def body(self) -> Body:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True, slots=True)
class Limits:
    """The most one request may carry; `EndpointConfig` holds the endpoint's (same names).

    Attributes:
        max_n: choices (`n`).
        max_messages: entries of `messages`.
        max_tools: entries of `tools`.
        max_chars: characters of text in all: message contents, tool-call arguments and the
            tools' definitions (as JSON). 4 Mi characters is about a million tokens.
    """

    max_n: int = 8
    max_messages: int = 4096
    max_tools: int = 128
    max_chars: int = 4 << 20


class _Budget:
    """Characters left of `Limits.max_chars` while a request is read."""

    __slots__ = ("left", "limit")

    def __init__(self, limit: int) -> None:
        self.left = self.limit = limit

    def spend(self, n: int, param: str) -> None:
        self.left -= n
        if self.left < 0:
            raise _bad(f"the request carries over {self.limit} characters of messages and tools "
                       f"(EndpointConfig.max_chars); send less text", param,
                       code="request_too_large")


@dataclass(kw_only=True, slots=True)
class ChatRequest:
    """A validated `/v1/chat/completions` request.

    `tool_choice` is "auto", "none", "required" or the name of the function to call.
    `max_tokens`, `temperature`, `top_p` and `seed` are None when the client left them out;
    `max_tokens_field` is the field the client set ("max_tokens" or "max_completion_tokens").
    `tool_results` holds (tool_call_id, content) of each tool message, in order.
    """

    model: str
    messages: list[Message]
    tools: list[Body] | None = None
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    stream: bool = False
    include_usage: bool = False
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    max_tokens_field: str = "max_tokens"
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    seed: int | None = None
    tool_results: list[tuple[str, str]] = field(default_factory=list)


def _number(body: Body, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"{key} must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def _int(body: Body, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{key} must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def parse_request(raw: bytes, *, model: str, limits: Limits = Limits()) -> ChatRequest:
    """Validate a request body against what the endpoint serves.

    Args:
        raw: the HTTP body.
        model: the one model name this endpoint serves.
        limits: the most a request may carry.

    Raises:
        APIError: 400 for a malformed or oversized request, 404 for an unknown model.
    """
    # json.loads holds the GIL however it is threaded: a body of millions of tiny values
    # ("[],[],...") stalls the whole process for seconds. Count brackets first (C speed; those
    # inside strings count too, so the bound is loose): no request within the limits needs more.
    containers = raw.count(b"[") + raw.count(b"{")
    bound = 64 * (limits.max_messages + limits.max_tools) + 65536
    if containers > bound:
        raise APIError(400, f"the request body holds {containers} JSON arrays/objects, more than "
                       f"{bound} (64 per message and tool allowed by EndpointConfig.max_messages "
                       "and max_tools, plus 65536)", param="messages", code="request_too_large")
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise _bad(f"the request body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    name = body.get("model")
    if not isinstance(name, str):
        raise _bad(f"model must be a string naming the served model {model!r}", "model")
    if name != model:
        raise APIError(404, f"The model {name!r} does not exist; this endpoint serves {model!r}",
                       param="model", code="model_not_found")
    for key, default in _UNSUPPORTED.items():
        if body.get(key) not in (None, default):
            raise _bad(f"{key} is not supported by this endpoint; leave it out", key)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad('response_format is not supported (no constrained decoding); leave it out '
                   'or use {"type": "text"}', "response_format")
    if body.get("top_logprobs") not in (None, 0):
        raise _bad("top_logprobs > 0 is not supported: the engine returns the sampled token's "
                   "log-prob only (use logprobs=true)", "top_logprobs")
    budget = _Budget(limits.max_chars)
    results: list[tuple[str, str]] = []
    messages = _messages(body.get("messages"), limits.max_messages, budget, results)
    tools = _tools(body.get("tools"), limits.max_tools, budget)
    req = ChatRequest(model=name, messages=messages, tools=tools,
                      tool_choice=_tool_choice(body.get("tool_choice"), tools),
                      tool_results=results)
    parallel = body.get("parallel_tool_calls")
    if not isinstance(parallel, bool | None):
        raise _bad(f"parallel_tool_calls must be a boolean, got {parallel!r}",
                   "parallel_tool_calls")
    req.parallel_tool_calls = parallel is not False
    stream = body.get("stream", False)
    if not isinstance(stream, bool | None):
        raise _bad(f"stream must be a boolean, got {stream!r}", "stream")
    req.stream = bool(stream)
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise _bad("stream_options must be an object", "stream_options")
        req.include_usage = bool(opts.get("include_usage", False))
    req.n = _int(body, "n", 1, limits.max_n) or 1
    req.temperature = _number(body, "temperature", 0.0, 2.0)
    req.top_p = _number(body, "top_p", 1e-9, 1.0)
    max_completion = _int(body, "max_completion_tokens", 1, 1 << 30)
    req.max_tokens = _int(body, "max_tokens", 1, 1 << 30)
    if req.max_tokens is None and max_completion is not None:
        req.max_tokens, req.max_tokens_field = max_completion, "max_completion_tokens"
    req.seed = _int(body, "seed", -(1 << 63), (1 << 63) - 1)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4
                             or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop must be a non-empty string or a list of up to 4 of them", "stop")
    req.stop = list(stop or [])
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool | None):
        raise _bad(f"logprobs must be a boolean, got {logprobs!r}", "logprobs")
    req.logprobs = bool(logprobs)
    return req


def _text(content: object, where: str, *, optional: bool = False) -> str:
    if isinstance(content, str):
        return content
    if content is None and optional:
        return ""
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise _bad(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": "
                           f"...}}; images, audio and files are not supported", f"{where}[{i}]")
            parts.append(part["text"])
        return "\n".join(parts)
    raise _bad(f"{where} must be a string or a list of text parts, got {type(content).__name__}",
               where)


def _too_many(key: str, n: int, limit: int) -> APIError:
    return _bad(f"{key} has {n} entries, over this endpoint's limit of {limit} "
                f"(EndpointConfig.max_{key})", key, code="request_too_large")


def _messages(raw: object, limit: int, budget: _Budget,
              results: list[tuple[str, str]]) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise _bad("messages must be a non-empty list of message objects", "messages")
    if len(raw) > limit:
        raise _too_many("messages", len(raw), limit)
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_call_id -> function name, for templates that render it
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object with a role and content", where)
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role must be one of {sorted(_ROLES)}, got {role!r}",
                       f"{where}.role")
        if role == "assistant":
            calls = _calls(m.get("tool_calls"), where, names, budget)
            text = _text(m.get("content"), f"{where}.content", optional=bool(calls))
            out.append(assistant_message(text, calls))
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str):
                raise _bad(f"{where}.tool_call_id must be the id of the call it answers",
                           f"{where}.tool_call_id")
            text = _text(m.get("content"), f"{where}.content")
            results.append((cid, text))
            msg: Message = {"role": "tool", "content": text}
            if cid in names:
                msg["name"] = names[cid]
            out.append(msg)
        else:
            text = _text(m.get("content"), f"{where}.content")
            out.append({"role": "system" if role == "developer" else role, "content": text})
        budget.spend(len(text), "messages")
    return out


def _calls(raw: object, where: str, names: dict[str, str], budget: _Budget) -> list[Call]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise _bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls: list[Call] = []
    for j, c in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _bad(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": '
                       f'..., "arguments": "<JSON object>"}}}}', at)
        args = fn.get("arguments", "{}")
        budget.spend(len(args) if isinstance(args, str) else len(json.dumps(args)), "messages")
        if isinstance(c.get("id"), str):
            names[c["id"]] = fn["name"]
        if is_raw_call(args):  # a malformed call this endpoint returned, sent back
            calls.append((fn["name"], args))
            continue
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise _bad(f"{at}.function.arguments must be a JSON object encoded as a string",
                       f"{at}.function.arguments")
        calls.append((fn["name"], parsed))
    return calls


def assistant_message(content: str, calls: Sequence[Call]) -> Message:
    """The template form of an assistant message; one function for replies and for requests, so
    a reply sent back unchanged compares equal to the recorded one. A malformed call's raw text
    (`earl.agents.openai_reply`) goes back into the content, as the model wrote it."""
    raw = [a for _, a in calls if isinstance(a, str)]
    if raw:
        content = "\n".join([content, *raw] if content else raw)
    msg: Message = {"role": "assistant", "content": content}
    good = [(n, a) for n, a in calls if not isinstance(a, str)]
    if good:
        msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in good]
    return msg


def _tools(raw: object, limit: int, budget: _Budget) -> list[Body] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _bad("tools must be a list of function tools", "tools")
    if len(raw) > limit:
        raise _too_many("tools", len(raw), limit)
    budget.spend(len(json.dumps(raw)), "tools")  # before checking schemas, which is slow
    seen: set[str] = set()
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad(f'{at} must be {{"type": "function", "function": {{"name": ..., '
                       f'"parameters": <JSON Schema>}}}}', at)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise _bad(f"{at}.function.name must match [A-Za-z0-9_-]{{1,64}}, got {name!r}",
                       f"{at}.function.name")
        if name in seen:
            raise _bad(f"{at}.function.name {name!r} is used by two tools", f"{at}.function.name")
        seen.add(name)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise _bad(f"{at}.function.parameters must be a JSON Schema object",
                       f"{at}.function.parameters")
        if (error := _schema_error(json.dumps(params, sort_keys=True))) is not None:
            message, path = error
            raise _bad(f"{at}.function.parameters is not a valid JSON Schema: {message} "
                       f"(at parameters{path})", f"{at}.function.parameters")
    return list(raw)


@functools.lru_cache(maxsize=256)
def _schema_error(text: str) -> tuple[str, str] | None:
    """None when `text` is a valid JSON Schema, else (message, path). Cached: an agent sends
    the same tools with every request, and checking a schema costs ~15% of a request's CPU."""
    from jsonschema import SchemaError, validators

    params = json.loads(text)
    try:
        validators.validator_for(params).check_schema(params)
    except SchemaError as exc:
        return exc.message, "".join(f"[{p!r}]" for p in exc.path)
    return None


def _tool_choice(raw: object, tools: list[Body] | None) -> str:
    if raw is None or raw == "auto" or raw == "none":
        return str(raw or "auto")
    names = [str(t["function"]["name"]) for t in tools or []]  # type: ignore[index]
    if raw == "required":
        if not names:
            raise _bad('tool_choice "required" needs tools', "tool_choice")
        return "required"
    fn = raw.get("function") if isinstance(raw, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise _bad('tool_choice must be "auto", "none", "required" or {"type": "function", '
                   '"function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise _bad(f"tool_choice names {name!r}, which is not in tools {names}", "tool_choice")
    return name


@dataclass(kw_only=True, slots=True)
class Choice:
    """One generated choice as the client sees it.

    Attributes:
        content: the text (None when the reply is only tool calls).
        tool_calls: (id, name, arguments as a JSON string) per call.
        finish_reason: "stop", "length" or "tool_calls".
        logprobs: (token text, log-prob) per generated token when the client asked for them.
    """

    content: str | None
    tool_calls: list[tuple[str, str, str]]
    finish_reason: str
    logprobs: list[tuple[str, float]] | None = None


def _logprobs(items: list[tuple[str, float]] | None) -> Body | None:
    if items is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": []} for t, lp in items], "refusal": None}


def _calls_out(calls: list[tuple[str, str, str]]) -> list[Body]:
    return [{"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
            for cid, n, a in calls]


def completion_body(cid: str, created: int, model: str, choices: list[Choice],
                    usage: Body) -> bytes:
    """The `chat.completion` object, JSON-encoded."""
    out = []
    for i, c in enumerate(choices):
        msg: Body = {"role": "assistant", "content": c.content, "refusal": None}
        if c.tool_calls:
            msg["tool_calls"] = _calls_out(c.tool_calls)
        out.append({"index": i, "message": msg, "logprobs": _logprobs(c.logprobs),
                    "finish_reason": c.finish_reason})
    return json.dumps({"id": cid, "object": "chat.completion", "created": created, "model": model,
                       "choices": out, "usage": usage}).encode()


def stream_body(cid: str, created: int, model: str, choices: list[Choice],
                usage: Body | None) -> bytes:
    """The same completion as server-sent events: per choice a role delta, a content delta, one
    delta per tool call and a finish delta; then the usage chunk if asked for, then [DONE]."""
    head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
    events: list[Body] = []

    def add(i: int, delta: Body, finish: str | None = None, lps: Body | None = None) -> None:
        events.append({**head, "choices": [{"index": i, "delta": delta, "logprobs": lps,
                                            "finish_reason": finish}]})

    for i, c in enumerate(choices):
        add(i, {"role": "assistant", "content": ""})
        lps = _logprobs(c.logprobs)  # on the content delta, or the first delta after it
        if c.content:
            add(i, {"content": c.content}, lps=lps)
            lps = None
        for j, call in enumerate(_calls_out(c.tool_calls)):
            add(i, {"tool_calls": [{"index": j, **call}]}, lps=lps)
            lps = None
        add(i, {}, c.finish_reason, lps=lps)
    if usage is not None:
        events.append({**head, "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) \
        + b"data: [DONE]\n\n"
