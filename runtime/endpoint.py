"""`@endpoint`: marks an actor method as remotely callable, and checks incoming arguments.

The decorated method stays a normal method inside the actor (`self.incr(1)` still works). On
the calling side, `group.incr` is an `EndpointRef` (see `earl.runtime.actor`) with the delivery
adverbs `call_one`, `call`, `broadcast`, `choose` and `stream`.

An `async def` endpoint with no await point in its body is run inline by the server (it cannot
suspend, so a task would only add cost); inside it `asyncio.current_task()` is None.

Argument checking is cheap and happens in the actor before the method runs: arity comes from
Python's own call (a coroutine function raises TypeError before creating the coroutine) and each
argument whose annotation is a plain class, a union of them, or a generic like `list[int]`
(checked as `list`) is tested with one `isinstance`. Annotations we cannot check are skipped.
This module knows nothing about sockets.
"""

from __future__ import annotations

import dis
import inspect
import types
import typing
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, overload

P = ParamSpec("P")
R = TypeVar("R")

_SUSPEND_OPS = frozenset({"GET_AWAITABLE", "SEND", "YIELD_VALUE", "BEFORE_ASYNC_WITH",
                          "GET_AITER", "GET_ANEXT", "ASYNC_GEN_WRAP"})


def _can_suspend(fn: Callable[..., Any]) -> bool:
    code = getattr(inspect.unwrap(fn), "__code__", None)
    if code is None:
        return True
    return any(ins.opname in _SUSPEND_OPS for ins in dis.get_instructions(code))


def _allowed(hint: Any) -> tuple[type, ...] | None:
    """Classes an argument annotated `hint` may be, or None when we do not check it."""
    if hint is Any or isinstance(hint, TypeVar):
        return None
    if hint is None or hint is type(None):
        return (type(None),)
    if hint is float:
        return (float, int)
    if hint is complex:
        return (complex, float, int)
    if hint in (list, tuple):
        return (list, tuple)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        out: list[type] = []
        for member in typing.get_args(hint):
            sub = _allowed(member)
            if sub is None:
                return None
            out.extend(sub)
        return tuple(out)
    if origin is not None:
        return _allowed(origin) if isinstance(origin, type) else None
    if isinstance(hint, type) and not getattr(hint, "_is_protocol", False):
        return (hint,)
    return None


class Endpoint(Generic[P, R]):
    """A remotely callable actor method (see `endpoint`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        self.is_stream = inspect.isasyncgenfunction(fn)
        self.is_async = inspect.iscoroutinefunction(fn)
        # An `async def` whose body has no await point (no await / async for / async with)
        # finishes in its first step: the server runs it inline instead of paying for a task.
        self.never_suspends = self.is_async and not _can_suspend(fn)
        params = list(inspect.signature(fn).parameters.values())[1:]
        self._params = params
        self._positional: list[tuple[str, tuple[type, ...] | None]] | None = None
        self._by_name: dict[str, tuple[type, ...] | None] = {}
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Endpoint[P, R]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> Callable[P, Any]: ...
    def __get__(self, obj: object | None, owner: type) -> Any:
        if obj is None:
            return self
        return types.MethodType(self.fn, obj)

    def _compile(self) -> None:
        try:
            hints = typing.get_type_hints(self.fn)
        except Exception:  # unresolvable annotations: arity is still checked by Python  # noqa: BLE001
            hints = {}
        pos = []
        for p in self._params:
            allowed = _allowed(hints[p.name]) if p.name in hints else None
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                pos.append((p.name, allowed))
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                self._by_name[p.name] = allowed
        self._positional = pos

    def check(self, owner: str, args: list[Any], kwargs: dict[str, Any]) -> None:
        """Raise TypeError naming the argument if a value does not match its annotation."""
        if self._positional is None:
            self._compile()
        assert self._positional is not None
        for (name, allowed), value in zip(self._positional, args):
            if allowed is not None and not isinstance(value, allowed):
                self._fail(owner, name, allowed, value)
        for name, value in kwargs.items():
            allowed = self._by_name.get(name)
            if allowed is not None and not isinstance(value, allowed):
                self._fail(owner, name, allowed, value)

    def _fail(self, owner: str, name: str, allowed: tuple[type, ...], value: Any) -> None:
        want = " | ".join(sorted({t.__name__ for t in allowed}))
        raise TypeError(f"{owner}.{self.name}() argument {name!r} must be {want}, "
                        f"got {type(value).__name__}")

    def signature(self) -> str:
        return f"{self.name}{inspect.signature(self.fn)}"


@overload
def endpoint(fn: Callable[Concatenate[Any, P], AsyncIterator[R]]) -> Endpoint[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], Awaitable[R]]) -> Endpoint[P, R]: ...
@overload
def endpoint(fn: Callable[Concatenate[Any, P], R]) -> Endpoint[P, R]: ...
def endpoint(fn: Callable[..., Any]) -> Endpoint[Any, Any]:
    """Mark an actor method as an endpoint.

    `async def` methods are the norm; `async def` generators are streaming endpoints
    (`.stream()`); a plain `def` runs inline on the actor's event loop (fastest, must not block).

    Example:
        >>> class Counter(Actor):
        ...     @endpoint
        ...     async def incr(self, k: int) -> int: ...
    """
    if not callable(fn):
        raise TypeError(f"@endpoint decorates a method, got {fn!r}")
    return Endpoint(fn)


def endpoints_of(cls: type) -> dict[str, Endpoint[Any, Any]]:
    """Every endpoint of `cls`, including inherited ones (subclasses override)."""
    out: dict[str, Endpoint[Any, Any]] = {}
    for klass in reversed(cls.__mro__):
        for name, value in vars(klass).items():
            if isinstance(value, Endpoint):
                out[name] = value
            elif name in out:
                del out[name]
    return out
