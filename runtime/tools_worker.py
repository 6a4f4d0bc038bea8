"""The worker process of the tool executor: runs one tool call at a time, forever.

Frames on the pipes are a 4-byte big-endian length plus JSON. Request: {"ref": "mod:qualname",
"args": {...}}; reply: {"ok", "output", "error", "run_s"}. The protocol uses private copies of
fds 0 and 1, so whatever a tool prints goes to stderr, never into the protocol. This process does
no isolation of its own: untrusted code goes through `earl.runtime.sandbox`. Started by
`earl.runtime.tools.ToolExecutor`; not meant to be run by hand.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import struct
import sys
import time
from collections.abc import Callable

_HEADER = struct.Struct(">I")


def _resolve(ref: str, cache: dict[str, Callable[..., object]]) -> Callable[..., object]:
    """The tool function `ref` names. Refs come only from the parent's `Tool` objects over this
    private pipe, so registration is not required, but the registry's other checks apply:
    never a denied module (os, subprocess, builtins, ...), only a public function defined in
    the module the ref names."""
    fn = cache.get(ref)
    if fn is None:
        from earl.runtime import registry

        fn = cache[ref] = registry.resolve(ref, what="tool", require_registration=False)
    return fn


def _call(fn: Callable[..., object], args: dict[str, object]) -> dict[str, object]:
    from earl.runtime.types import to_text

    t0 = time.perf_counter()
    try:
        value = fn(**args)
        if inspect.isawaitable(value):
            value = asyncio.run(_await(value))
        return {"ok": True, "output": to_text(value), "error": None,
                "run_s": time.perf_counter() - t0}
    except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
        return {"ok": False, "output": f"{type(exc).__name__}: {exc}", "error": "exception",
                "run_s": time.perf_counter() - t0}


async def _await(value: object) -> object:
    return await value  # type: ignore[misc]


def main() -> None:
    if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
        sys.path.pop(0)  # run as a script: runtime/ must not shadow top-level modules
    extra = os.environ.get("EARL_TOOL_PATH")
    if extra:
        sys.path[:0] = [p for p in extra.split(os.pathsep) if p and p not in sys.path]
    proto_in = os.fdopen(os.dup(0), "rb", buffering=0)
    proto_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    cache: dict[str, Callable[..., object]] = {}
    proto_out.write(_HEADER.pack(2) + b"{}")  # ready handshake
    while True:
        head = proto_in.read(4)
        if len(head) < 4:
            return
        (n,) = _HEADER.unpack(head)
        body = b""
        while len(body) < n:
            chunk = proto_in.read(n - len(body))
            if not chunk:
                return
            body += chunk
        req = json.loads(body)
        try:
            fn = _resolve(req["ref"], cache)
        except (ImportError, AttributeError, ValueError, PermissionError) as exc:
            reply = {"ok": False, "output": f"cannot import tool {req['ref']!r}: {exc}",
                     "error": "import", "run_s": 0.0}
        else:
            reply = _call(fn, req["args"])
        data = json.dumps(reply).encode()  # ASCII escapes: lone surrogates survive
        proto_out.write(_HEADER.pack(len(data)) + data)


if __name__ == "__main__":
    main()
