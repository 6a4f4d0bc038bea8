"""Tools with synthetic behaviour for tests and `earl stress`: sleep, fail, crash, hang.

Each is a module-level function so executor workers can import it. They model tool latency
(`sleep_tool`), tool errors (`flaky_tool`) and dying workers (`crash_tool`); none does real work.
"""

from __future__ import annotations

import os
import time

__all__ = ["crash_tool", "echo_tool", "flaky_tool", "simulated", "sleep_tool"]


def sleep_tool(seconds: float) -> str:
    """Wait, then report how long.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(max(0.0, seconds))
    return f"slept {seconds:.3f}"


def flaky_tool(seconds: float, fail: bool) -> str:
    """Sleep, then fail when asked to.

    Args:
        seconds: How long to sleep.
        fail: Raise instead of returning.
    """
    time.sleep(max(0.0, seconds))
    if fail:
        raise RuntimeError("injected tool failure")
    return "ok"


def crash_tool(code: int) -> str:
    """Kill the worker process running this tool.

    Args:
        code: exit status.
    """
    os._exit(code)


def echo_tool(text: str) -> object:
    """Return the text; a dict when the text is "dict", an unserializable object for "object".

    Args:
        text: What to echo.
    """
    if text == "dict":
        return {"echo": text}
    if text == "object":
        return object()
    return text


def simulated(ref: str, arguments: dict, seconds: float, fail: bool) -> object:
    """Run the tool `ref` after a simulated latency, or fail on purpose (stress tests).

    Args:
        ref: "module:qualname" of the real tool.
        arguments: its keyword arguments.
        seconds: extra latency to add before running it.
        fail: raise an injected failure instead of running it.
    """
    import importlib

    time.sleep(max(0.0, seconds))
    if fail:
        raise RuntimeError("injected tool failure")
    module, _, qual = ref.partition(":")
    fn: object = importlib.import_module(module)
    for part in qual.split("."):
        fn = getattr(fn, part)
    return fn(**arguments)  # type: ignore[operator]
