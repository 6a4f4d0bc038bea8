"""What a client gets back from one generation: the cut at a stop string, the tool calls as the
chat-completions API reports them, and the tally of the tool calls an agent runs itself.

The model writes calls as Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks. `reply_calls` splits a reply's text into its content and the calls the endpoint returns:

- A well-formed call to a tool the request offered comes back in `tool_calls` with its
  arguments as a JSON object (`finish_reason` "tool_calls").
- A malformed call (the block is not JSON, has no string name, its arguments are not a JSON
  object, or it is not closed) comes back the way OpenAI reports arguments the model got wrong:
  as an entry of `tool_calls` whose `arguments` string is not valid JSON. OpenAI passes the
  model's arguments text through unchecked unless `strict` is set, and clients parse it
  themselves: LangChain's `ChatOpenAI` (`_convert_dict_to_message`) puts a call whose
  arguments fail `json.loads` into `AIMessage.invalid_tool_calls` with the error, the OpenAI
  Agents SDK tells the model "Invalid JSON input for tool ...", a hand-written agent's own
  `json.loads` fails. Its `arguments` is the model's whole `<tool_call>...` text as written (it
  starts with "<", so it never parses) and its name is the one the model wrote ("" if none can
  be read). Not the bare arguments text: valid JSON that is not an object ("5", "[1]",
  "\\"3+4\\"") makes `ChatOpenAI` raise a ValidationError for the whole reply instead
  (langchain-ai/langchain#35990). Sent back in a later request, such an entry is the model's
  text again (`is_raw_call`), so the history still continues the recorded tokens.
- A well-formed call to a tool the request did not offer stays in the content as text.
- `parallel_tool_calls: false` keeps the first call (OpenAI returns at most one); the text of
  the others is dropped from the reply.

A reply cut at the token cap (`finish_reason` "length") is never split: its whole text is the
content (`earl.agents.openai_server`), so no client runs a tool from a cut-off turn.

`ToolTally` counts, per session, the tool results (role "tool" messages) sent back for calls
the endpoint returned: the calls the agent ran, and those whose result reads "Error..." (the
convention of `rollout.call_tool`, LangGraph's `ToolNode` and `agents/openai_calc.py`). They
become the episode's `info.tool_calls` and `info.tool_errors`. A call the agent never answers
(LangGraph does not run `invalid_tool_calls`) is not counted.
This module does not talk HTTP or keep the token record (`earl.agents.openai_server`,
`earl.agents.openai_record`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from earl.agents.chat import ChatCodec
from earl.agents.tools import _CALL_RE, parse_tool_calls

__all__ = ["ToolTally", "is_raw_call", "reply_calls", "stop_at", "tokens_through"]

Body = dict[str, object]
Call = tuple[str, Body | str]  # (name, arguments object) or (name, the model's raw call text)
_NAME_RE = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


def is_raw_call(arguments: object) -> bool:
    """Whether `arguments` is a malformed call's raw text as `reply_calls` returns it."""
    return isinstance(arguments, str) and arguments.startswith("<tool_call>")


def reply_calls(text: str, names: set[str], *, parallel: bool = True) -> tuple[str, list[Call]]:
    """Split a reply into (content, calls) as described in the module docstring.

    Args:
        text: the reply's text.
        names: the tools the request offered.
        parallel: False keeps the first call only.
    """
    if "<tool_call>" not in text:
        return text, []
    _, parsed = parse_tool_calls(text)
    calls: list[Call] = []
    in_text: list[bool] = []  # per block: stays in the content
    for m, c in zip(_CALL_RE.finditer(text), parsed, strict=True):
        if c.error is None and c.name not in names:
            in_text.append(True)
            continue
        in_text.append(False)
        if parallel or not calls:
            calls.append((c.name, c.arguments) if c.error is None
                         else (c.name or _name_in(c.raw), m.group(0)))
    keep = iter(in_text)
    return _CALL_RE.sub(lambda m: m.group(0) if next(keep) else "", text).strip(), calls


def _name_in(raw: str) -> str:
    m = _NAME_RE.search(raw)
    if m is None:
        return ""
    try:
        name = json.loads(m.group(1))
    except ValueError:
        return ""
    return name if isinstance(name, str) else ""


class ToolTally:
    """The tool calls a session's agent ran itself (see the module docstring)."""

    __slots__ = ("_answered", "_returned")

    def __init__(self) -> None:
        self._returned: set[str] = set()
        self._answered: set[str] = set()

    def returned(self, ids: Iterable[str]) -> None:
        """Note the ids of the calls of a reply."""
        self._returned.update(ids)

    def answered(self, results: Iterable[tuple[str, str]]) -> tuple[int, int]:
        """Count the (tool_call_id, content) results of a request that answer a returned call
        not answered before.

        Returns:
            (calls, errors) newly counted.
        """
        calls = errors = 0
        for cid, content in results:
            if cid in self._returned and cid not in self._answered:
                self._answered.add(cid)
                calls += 1
                errors += content.lstrip().startswith("Error")
        return calls, errors


def stop_at(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(where the earliest stop string starts, where it ends) in `text`, or None."""
    best: tuple[int, int] | None = None
    for s in stops:
        p = text.find(s)
        if p >= 0 and (best is None or p < best[0]):
            best = (p, p + len(s))
    return best


def tokens_through(codec: ChatCodec, ids: list[int], end: int) -> int:
    """The fewest leading tokens of `ids` whose text reaches character `end`."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(codec.decode(ids[:mid])) >= end:
            hi = mid
        else:
            lo = mid + 1
    return lo
