"""Tools for agents: typed Python functions become JSON schemas; model text becomes tool calls.

`Tool.from_function(fn)` reads the signature and the Google docstring (via transformers'
`get_json_schema`, the same code `apply_chat_template(tools=[fn])` uses). `parse_tool_calls`
extracts Hermes/Qwen `<tool_call>{json}</tool_call>` blocks; a malformed block becomes a
`ToolCall` with `error` set, never an exception, so the model can be told what went wrong.
This module does not run tools: that is `earl.agents.rollout` (in-process) or
`earl.runtime.tools` (the shared worker pool).
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable

from earl.runtime.types import JSONValue, Tool, ToolCall, ToolResult, ToolRunner, to_text

__all__ = [
    "JSONValue", "Tool", "ToolCall", "ToolResult", "ToolRunner", "as_toolbox", "check_arguments",
    "parse_tool_calls", "to_text",
]

_CALL_RE = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


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
