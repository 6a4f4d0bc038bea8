"""`Actor` (the base class user actors derive from) and `ActorGroup` (the caller's handle).

An `ActorGroup` names a group of actor processes (`name`, ranks, addresses, endpoint names).
`group.<endpoint>` is an `EndpointRef` with the delivery adverbs: `call_one` (one actor),
`call` (every rank, gathered in rank order), `broadcast` (fire and forget), `choose` (the member
with the fewest outstanding calls) and `stream` (async iterator over a generator endpoint).
Requests are encoded and written before the adverb returns, so calls from one task arrive in
order. Groups are plain data: they can be passed as endpoint arguments and rebuilt in another
process, where they connect lazily through that process' runtime (`context()`).

This module holds no processes and no sockets of its own.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, Generic, ParamSpec, TypeVar

from earl.runtime.frames import STREAM_WINDOW, FrameTooLarge, Kind, check_size, log
from earl.runtime.wire import encode, register_ext

if TYPE_CHECKING:
    from earl.runtime.endpoint import Endpoint
    from earl.runtime.runtime import Runtime

P = ParamSpec("P")
R = TypeVar("R")
A = TypeVar("A", bound="Actor")
EXT_GROUP = 16

_current: list[Runtime] = []


def context() -> Runtime:
    """The runtime of this process: inside an actor, the one that hosts it; in a driver, the
    innermost `async with Runtime()`.

    Raises:
        RuntimeError: no runtime is active in this process.
    """
    if not _current:
        raise RuntimeError("no earl runtime is active: use `async with Runtime() as rt:`")
    return _current[-1]


class Actor:
    """Base class of actors. `__init__` and `setup` run in the actor's own process.

    Attributes set before `__init__` runs: `name` (group name), `rank` (index in the group),
    `world_size` (size of the group). `preload`: modules a warm host of this class imports
    ahead of its spawn (`Runtime.keep_warm`), besides the class's own module.
    """

    preload: ClassVar[tuple[str, ...]] = ()
    name: str = ""
    rank: int = 0
    world_size: int = 1

    async def setup(self) -> None:
        """Optional async initialisation, awaited after `__init__` and before serving."""


class EndpointRef(Generic[P, R]):
    """One endpoint of a group, with the delivery adverbs."""

    __slots__ = ("_group", "_name", "_stream")

    def __init__(self, group: ActorGroup[Any], name: str, is_stream: bool) -> None:
        self._group = group
        self._name = name
        self._stream = is_stream

    def _check(self, stream: bool) -> None:
        if stream != self._stream:
            how = ".stream()" if self._stream else ".call_one()/.call()/.choose()/.broadcast()"
            raise TypeError(f"{self._group.name}.{self._name} is called with {how}")

    def call_one(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        """Call the only actor of this group (use `group[i]` to pick one)."""
        self._check(False)
        g = self._group
        if len(g.ranks) != 1:
            raise ValueError(f"call_one needs a group of one actor; {g.name} has {len(g.ranks)}:"
                             " use group[i].ep.call_one(), .call() or .choose()")
        return g._request(0, Kind.CALL, self._name, args, kwargs)

    def call(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[list[R]]:
        """Call every actor of the group; the results come back in rank order."""
        self._check(False)
        g = self._group
        body, bufs = g._encode(self._name, args, kwargs)
        return asyncio.gather(*[g._send(i, Kind.CALL, body, bufs) for i in range(len(g.ranks))])

    def broadcast(self, *args: P.args, **kwargs: P.kwargs) -> None:
        """Send to every actor without waiting; failures are logged, not raised."""
        self._check(False)
        g = self._group
        body, bufs = g._encode(self._name, args, kwargs)
        for i in range(len(g.ranks)):
            fut = g._send(i, Kind.ONEWAY, body, bufs)
            if not fut.done() or fut.exception() is not None:
                fut.add_done_callback(_log_failure)

    def choose(self, *args: P.args, **kwargs: P.kwargs) -> Awaitable[R]:
        """Call the member with the fewest outstanding calls."""
        self._check(False)
        g = self._group
        return g._request(g._least_loaded(), Kind.CALL, self._name, args, kwargs)

    def stream(self, *args: P.args, **kwargs: P.kwargs) -> AsyncIterator[R]:
        """Iterate over what a generator endpoint of the only actor yields."""
        self._check(True)
        g = self._group
        if len(g.ranks) != 1:
            raise ValueError(f"stream needs a group of one actor; use {g.name}[i].ep.stream()")
        body, bufs = g._encode(self._name, args, kwargs)
        return _stream(g, body, bufs)


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("broadcast failed: %s", fut.exception())


async def _stream(g: ActorGroup[Any], body: bytes, bufs: list[Any]) -> AsyncIterator[Any]:
    conn = await context().resolve(g, 0)
    rid, q = conn.open_stream(body, bufs)
    done = False
    consumed = 0
    try:
        while True:
            kind, value = await q.get()
            if kind == Kind.ITEM:
                yield value
                consumed += 1
                if consumed == STREAM_WINDOW // 2:  # let the actor produce more
                    conn.grant(rid, consumed)
                    consumed = 0
                continue
            done = True
            if kind == Kind.END:
                return
            raise value
    finally:
        if not done:
            conn.cancel_stream(rid)
        else:
            conn.streams.pop(rid, None)


class ActorGroup(Generic[A]):
    """Handle to a group of actors; `group.<endpoint>` gives an `EndpointRef`."""

    def __init__(self, name: str, cls_name: str, endpoints: dict[str, bool],
                 addresses: list[str], ranks: list[int], world_size: int) -> None:
        self.name = name
        self.cls_name = cls_name
        self.endpoints = endpoints
        self.addresses = addresses
        self.ranks = ranks
        self.world_size = world_size
        self._conns: list[Any] = [None] * len(ranks)
        self._rr = itertools.count()
        self._refs: dict[str, EndpointRef[Any, Any]] = {}
        self._subs: dict[int, ActorGroup[A]] = {}

    def __getattr__(self, attr: str) -> EndpointRef[..., Any]:
        if attr.startswith("__") or attr not in self.__dict__.get("endpoints", ()):
            raise AttributeError(f"actor {self.__dict__.get('cls_name', '?')} has no endpoint "
                                 f"{attr!r}; endpoints: "
                                 f"{', '.join(sorted(self.__dict__.get('endpoints', ())))}")
        ref = self._refs.get(attr)
        if ref is None:
            ref = self._refs[attr] = EndpointRef(self, attr, self.endpoints[attr])
        return ref

    def ep(self, method: Endpoint[P, R]) -> EndpointRef[P, R]:
        """The statically typed form of `group.<name>`: pass the class attribute.

        `await g.ep(Counter.incr).call_one(1)` is the same call as `await g.incr.call_one(1)`,
        but a type checker knows its arguments and that it returns `int`.
        """
        return getattr(self, method.name)  # type: ignore[no-any-return]

    def __len__(self) -> int:
        return len(self.ranks)

    def __reduce__(self) -> tuple[Any, ...]:  # plain data, so pickling (e.g. by Ray) is safe
        return (_group_from_wire, (_group_to_wire(self),))

    def __getitem__(self, i: int) -> ActorGroup[A]:
        if not -len(self.ranks) <= i < len(self.ranks):
            raise IndexError(f"{self.name} has {len(self.ranks)} actors, no index {i}")
        i %= len(self.ranks)
        if len(self.ranks) == 1:
            return self
        sub = self._subs.get(i)
        if sub is None:
            sub = self._subs[i] = ActorGroup[A](self.name, self.cls_name, self.endpoints,
                                                [self.addresses[i]], [self.ranks[i]],
                                                self.world_size)
        if sub._conns[0] is None:
            sub._conns[0] = self._conns[i]
        return sub

    def __iter__(self) -> Iterator[ActorGroup[A]]:
        return (self[i] for i in range(len(self.ranks)))

    def __repr__(self) -> str:
        return f"ActorGroup({self.name!r}, {self.cls_name}, ranks={self.ranks})"

    def label(self, i: int) -> str:
        return f"{self.name}[{self.ranks[i]}]"

    # ---- request path -------------------------------------------------------------------
    def _encode(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> tuple[bytes, list[Any]]:
        return encode([method, list(args), kwargs])

    def _request(self, i: int, kind: int, method: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        body, bufs = encode([method, list(args), kwargs])
        return self._send(i, kind, body, bufs)

    def _send(self, i: int, kind: int, body: bytes, bufs: list[Any]) -> asyncio.Future[Any]:
        conn = self._conns[i]
        if conn is None or conn.dead is not None:
            conn = self._conns[i] = context().pool.get_nowait(self.addresses[i])
        if conn is not None:
            return conn.request(kind, body, bufs)  # raises FrameTooLarge synchronously
        rt = context()
        check_size(body, bufs, rt.config.max_message_bytes)
        return rt.send_later(self, i, kind, body, bufs)

    def _least_loaded(self) -> int:
        n = len(self.ranks)
        if n == 1:
            return 0
        start = next(self._rr) % n
        best, best_load = start, None
        for k in range(n):
            i = (start + k) % n
            c = self._conns[i]
            load = len(c.pending) if c is not None and c.dead is None else (
                0 if c is None else 1 << 30)
            if best_load is None or load < best_load:
                best, best_load = i, load
        return best


def _group_to_wire(g: ActorGroup[Any]) -> list[Any]:
    return [g.name, g.cls_name, g.endpoints, g.addresses, g.ranks, g.world_size]


def _group_from_wire(v: list[Any]) -> ActorGroup[Any]:
    name, cls_name, eps, addresses, ranks, world = v
    return ActorGroup(name, cls_name, dict(eps), list(addresses), list(ranks), world)


register_ext(ActorGroup, EXT_GROUP, _group_to_wire, _group_from_wire)
__all__ = ["Actor", "ActorGroup", "EndpointRef", "FrameTooLarge", "context"]
