"""Tools for agents: typed Python functions become JSON schemas; model text becomes tool calls.

`Tool.from_function(fn)` reads the signature and the Google docstring (via transformers'
`get_json_schema`, the same code `apply_chat_template(tools=[fn])` uses). `parse_tool_calls`
extracts Hermes/Qwen `<tool_call>{json}</tool_call>` blocks; a malformed block becomes a
`ToolCall` with `error` set, never an exception, so the model can be told what went wrong.
This module does not run tools: that is `earl.agents.rollout` (in-process) or
`earl.runtime.tools` (the shared worker pool).
"""

from __future__ import annotations

import inspect
import json
import re
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

__all__ = [
    "Tool", "ToolCall", "ToolResult", "ToolRunner", "as_toolbox", "check_arguments",
    "parse_tool_calls", "to_text",
]

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"
_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One tool call parsed from the model's text.

    Attributes:
        name: the tool name ("" when it could not be read).
        arguments: keyword arguments for the tool.
        raw: the text inside the <tool_call> block.
        error: why the call is malformed, or None when it is well formed.
        id: position of the call in its turn ("call_0", ...).
    """

    name: str
    arguments: dict[str, JSONValue] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None
    id: str = "call_0"

    def to_message(self) -> dict[str, object]:
        """The OpenAI/HF `tool_calls` entry for an assistant message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(kw_only=True, slots=True)
class Tool:
    """A callable the model may use.

    Attributes:
        name: the name the model calls it by.
        fn: the function; sync or async, returns a string (other JSON values are dumped).
        schema: the JSON schema handed to the chat template.
        ref: "module:qualname" so a worker process can import it; None for local functions.
    """

    name: str
    fn: Callable[..., object]
    schema: dict[str, object]
    ref: str | None = None

    @classmethod
    def from_function(cls, fn: Callable[..., object], name: str | None = None) -> Tool:
        """Build a tool from a typed function with a Google-style docstring.

        Raises:
            TypeError: a parameter lacks a type hint or the docstring lacks an Args entry.
        """
        from transformers.utils import get_json_schema

        if not callable(fn):
            raise TypeError(f"tool must be a callable, got {type(fn).__name__}")
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers raises its own DocstringParsingException types
            raise TypeError(f"cannot make a tool schema from {fn.__qualname__}: {exc}. Give every "
                            "parameter a type hint and an `Args:` docstring entry") from exc
        schema["function"].pop("return", None)  # type: ignore[union-attr]
        if name is not None:
            schema["function"]["name"] = name  # type: ignore[index]
        qual = getattr(fn, "__qualname__", "")
        ref = None if "<locals>" in qual else f"{fn.__module__}:{qual}"
        return cls(name=name or fn.__name__, fn=fn, schema=schema, ref=ref)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


_FROM_FUNCTION: weakref.WeakKeyDictionary[Callable[..., object], Tool] = weakref.WeakKeyDictionary()


def as_toolbox(tools: list[Tool | Callable[..., object]] | dict[str, Tool] | None) -> dict[str, Tool]:
    """Normalize a list of functions/Tools (or a dict) to {name: Tool}.

    Raises:
        ValueError: two tools share a name.
    """
    if tools is None:
        return {}
    if isinstance(tools, dict):
        return dict(tools)
    box: dict[str, Tool] = {}
    for t in tools:
        if isinstance(t, Tool):
            tool = t
        else:  # schema extraction parses docstrings: do it once per function
            tool = _FROM_FUNCTION.get(t) or _FROM_FUNCTION.setdefault(t, Tool.from_function(t))
        if tool.name in box:
            raise ValueError(f"two tools are named {tool.name!r}; tool names must be unique")
        box[tool.name] = tool
    return box


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split model text into (content outside tool-call blocks, tool calls).

    Each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block becomes a ToolCall;
    bad JSON, a missing name, non-object arguments or an unclosed block give a ToolCall with
    `error` set. `arguments` may also be a JSON string holding an object (some models emit that).
    """
    if "<tool_call>" not in text:
        return text, []
    calls: list[ToolCall] = []
    for i, m in enumerate(_CALL_RE.finditer(text)):
        raw = m.group(1).strip()
        cid = f"call_{i}"
        if not m.group(2):
            calls.append(ToolCall(name="", raw=raw, id=cid, error="unclosed <tool_call> block: end "
                                  "it with </tool_call>"))
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            calls.append(ToolCall(name="", raw=raw, id=cid, error=f"tool call is not valid JSON "
                                  f"({exc.msg} at char {exc.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            calls.append(ToolCall(name="", raw=raw, id=cid, error='tool call must be a JSON object '
                                  'with a string "name" and an object "arguments"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            calls.append(ToolCall(name=obj["name"], raw=raw, id=cid,
                                  error='"arguments" must be a JSON object'))
            continue
        calls.append(ToolCall(name=obj["name"], arguments=args, raw=raw, id=cid))
    content = _CALL_RE.sub("", text).strip()
    return content, calls


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


def _type_ok(value: JSONValue, spec: dict[str, object]) -> bool:
    types = spec.get("type")
    if types is None:
        return "enum" not in spec or value in spec["enum"]  # type: ignore[operator]
    names = types if isinstance(types, list) else [types]
    for name in names:
        py = _JSON_TYPES.get(str(name), (object,))
        if isinstance(value, bool) and name in ("integer", "number"):
            continue
        if isinstance(value, py):
            return "enum" not in spec or value in spec["enum"]  # type: ignore[operator]
    return False


def check_arguments(tool: Tool, arguments: dict[str, JSONValue]) -> str | None:
    """Return why `arguments` do not fit `tool`'s schema (unknown, missing, wrong type), or None."""
    params = tool.schema["function"]["parameters"]  # type: ignore[index]
    props: dict[str, dict[str, object]] = params.get("properties", {})  # type: ignore[union-attr]
    for key in arguments:
        if key not in props:
            return f"{tool.name}() got an unexpected argument {key!r}; it takes {sorted(props)}"
    for key in params.get("required", []):  # type: ignore[union-attr]
        if key not in arguments:
            return f"{tool.name}() is missing the required argument {key!r}"
    for key, value in arguments.items():
        if not _type_ok(value, props[key]):
            return (f"{tool.name}() argument {key!r} must be of type {props[key].get('type')}, "
                    f"got {type(value).__name__}")
    return None


@dataclass(kw_only=True, slots=True)
class ToolResult:
    """Outcome of running one tool call.

    Attributes:
        ok: the tool returned normally.
        output: its text (or the error text when not ok).
        error: short error kind when not ok ("timeout", "exception", "crashed", ...).
        queued_s: time waiting for a worker.
        run_s: time running on a worker.
    """

    ok: bool
    output: str
    error: str | None = None
    queued_s: float = 0.0
    run_s: float = 0.0


class ToolRunner(Protocol):
    """Where tool calls run: `earl.runtime.tools.ToolExecutor` implements this."""

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult: ...


def to_text(value: object) -> str:
    """A tool's return value as text: str as is, other JSON values dumped, else TypeError."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tool returned {type(value).__name__}, which is not a string or JSON "
                        "value; return a str") from exc
