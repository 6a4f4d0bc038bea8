"""Client side of the RPC: one `Connection` per actor address, and a `Pool` of them.

A `Connection` matches replies to requests by id and resolves futures straight from the
protocol callback (no task per call). When the socket closes, every pending call and open
stream fails at once with `ActorDied` (cause "connection_lost", or what the pool's owner was told:
an exit code, a signal, a stop); later calls on a dead address (its connection lost, or nothing
listening there) fail immediately too, until the pool learns a new address for that actor (a
restart). An ERR reply becomes an `ActorError` with
the failure's data (`earl.runtime.errors.error_from_wire`). This module knows nothing about
endpoints, groups or processes.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any

from earl.runtime.errors import ActorDied, BadCall, Cause, error_from_wire
from earl.runtime.frames import FrameProtocol, Kind, derive_key
from earl.runtime.wire import WireError, decode, encode

_STREAM_KINDS = (Kind.ITEM, Kind.END, Kind.ERR, Kind.REJECT)


class Connection(FrameProtocol):
    """One client connection to an actor (or the directory)."""

    def __init__(self, label: str, *, max_bytes: int, secret: bytes | None) -> None:
        super().__init__(max_bytes=max_bytes, secret=secret)
        self.label = label
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.streams: dict[int, asyncio.Queue[tuple[int, Any]]] = {}
        self.dead: ActorDied | None = None
        self.death: ActorDied | None = None  # why the line goes down, when known beforehand
        self.on_lost: Any = None  # called once with this connection when it dies
        self.calls_lost = 0  # calls and streams in flight when the connection was lost
        self._rid = itertools.count(1)
        self.loop = asyncio.get_running_loop()
        self.hello: asyncio.Future[None] = self.loop.create_future()

    def request(self, kind: int, body: bytes, bufs: list[Any]) -> asyncio.Future[Any]:
        """Send a CALL (or ONEWAY) frame; return the future of its reply."""
        fut = self.loop.create_future()
        if self.dead is not None:
            fut.set_exception(self.dead)
            return fut
        rid = next(self._rid)
        self.send(kind, rid, body, bufs)
        if kind == Kind.ONEWAY:
            fut.set_result(None)
        else:
            self.pending[rid] = fut
        return fut

    def open_stream(self, body: bytes, bufs: list[Any]) -> tuple[int, asyncio.Queue[Any]]:
        if self.dead is not None:
            raise self.dead
        rid = next(self._rid)
        q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.send(Kind.STREAM, rid, body, bufs)
        self.streams[rid] = q
        return rid, q

    def grant(self, rid: int, n: int) -> None:
        """Allow the stream `rid` to send `n` more items."""
        if rid in self.streams and self.dead is None:
            self.send(Kind.CREDIT, rid, encode(n)[0])

    def cancel_stream(self, rid: int) -> None:
        if self.streams.pop(rid, None) is not None and self.dead is None:
            try:
                self.send(Kind.CANCEL, rid)
            except ConnectionError:
                pass

    def frame_received(self, kind: int, rid: int, body: memoryview, bufs: list[Any]) -> None:
        if kind == Kind.HELLO:
            self._on_hello(bytes(body))
            return
        if kind == Kind.AUTH:  # its MAC verified: the actor holds our secret
            if self.key is not None and not self.hello.done():
                self.hello.set_result(None)
            return
        fut = self.pending.pop(rid, None)
        if fut is None:
            q = self.streams.get(rid)
            if q is not None and kind in _STREAM_KINDS:
                q.put_nowait((kind, self._outcome(kind, body, bufs)))
            return
        if fut.done():
            return
        out = self._outcome(kind, body, bufs)
        if isinstance(out, BaseException):
            fut.set_exception(out)
        else:
            fut.set_result(out)

    def _outcome(self, kind: int, body: memoryview, bufs: list[Any]) -> Any:
        try:
            if kind == Kind.OK or kind == Kind.ITEM:
                return decode(body, bufs)
            if kind == Kind.END:
                return None
            if kind == Kind.ERR:
                return error_from_wire(self.label, decode(body))
            if kind == Kind.REJECT:
                return BadCall(self.label, "BadCall", decode(body))
        except WireError as e:
            return BadCall(self.label, "WireError", f"cannot decode the reply: {e}")
        return BadCall(self.label, "BadCall", f"unexpected frame kind {kind}")

    def frame_refused(self, kind: int, rid: int, reason: str) -> None:
        fut = self.pending.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(BadCall(self.label, "BadCall", f"reply dropped: {reason}"))
        q = self.streams.get(rid)
        if q is not None:
            q.put_nowait((Kind.REJECT, BadCall(self.label, "BadCall", reason)))

    def _on_hello(self, nonce: bytes) -> None:
        if self.hello.done():
            return
        if nonce and self.secret is None:
            self.hello.set_exception(ValueError(
                f"actor {self.label} requires a shared secret: set RuntimeConfig.secret"))
        elif self.secret is not None and not nonce:
            self.hello.set_exception(ValueError(
                f"actor {self.label} does not authenticate frames but this process has a secret"))
        else:
            if not nonce:
                self.hello.set_result(None)
                return
            assert self.secret is not None
            self.key = derive_key(self.secret, nonce)
            self.send(Kind.AUTH, 0)  # the actor answers nothing big before this verifies
            # `hello` resolves when the actor's own AUTH frame verifies (frame_received)

    def drop(self, reason: str) -> None:
        if not self.hello.done():
            self.hello.set_exception(ValueError(
                f"actor {self.label} failed the authentication handshake ({reason}): "
                "this process and the actor do not share RuntimeConfig.secret"))
        self.death = self._died(f"connection dropped: {reason}", "connection_lost")
        super().drop(reason)

    def connection_lost(self, exc: Exception | None) -> None:
        # Replies still owed when the line went down are lost: the pool's owner may then treat
        # a process that still runs as dead (`Pool.on_broken`).
        self.calls_lost = len(self.pending) + len(self.streams)
        self.mark_dead(self.death or self._died(
            "connection lost" + (f" ({type(exc).__name__}: {exc})" if exc else ""),
            "connection_lost"))

    def _died(self, reason: str, cause: Cause) -> ActorDied:
        return ActorDied(self.label, reason, cause=cause)

    def mark_dead(self, death: ActorDied) -> None:
        """Fail every pending call and stream now with `death`; later calls fail immediately."""
        if self.dead is None:
            self.dead = death
        err = self.dead
        pending, self.pending = self.pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        for q in self.streams.values():
            q.put_nowait((Kind.ERR, err))
        if not self.hello.done():
            self.hello.set_exception(err)
        if self.transport is not None:
            self.transport.close()
        if self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost(self)


def split_address(address: str) -> tuple[str, str, int]:
    """`unix:/path` -> ("unix", "/path", 0); `tcp:host:port` (host may be `[v6]`) -> ("tcp",
    host, port). Raises ValueError for any other form."""
    scheme, _, rest = address.partition(":")
    if scheme == "unix":
        return scheme, rest, 0
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return scheme, host.strip("[]"), int(port)
    raise ValueError(f"bad actor address {address!r}: want unix:PATH or tcp:HOST:PORT")


async def open_stream(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw byte stream to an actor's address, no handshake (fault injection, fuzzing)."""
    scheme, where, port = split_address(address)
    if scheme == "unix":
        return await asyncio.open_unix_connection(where)
    return await asyncio.open_connection(where, port)


async def connect(address: str, label: str, *, max_bytes: int, secret: bytes | None,
                  timeout: float = 10.0) -> Connection:
    """Open a connection to `unix:/path` or `tcp:host:port` and wait for the HELLO handshake.

    Raises:
        ActorDied: nothing is listening there (the actor is gone).
        ValueError: secret mismatch, or a malformed address.
    """
    loop = asyncio.get_running_loop()

    def factory() -> Connection:
        return Connection(label, max_bytes=max_bytes, secret=secret)

    scheme, where, port = split_address(address)
    try:
        async with asyncio.timeout(timeout):
            if scheme == "unix":
                _, conn = await loop.create_unix_connection(factory, where)
            else:
                _, conn = await loop.create_connection(factory, where, port)
            try:
                await conn.hello
            except BaseException:
                conn.on_lost = None
                if conn.transport is not None:
                    conn.transport.close()
                raise
    except (OSError, TimeoutError) as e:
        raise ActorDied(label, f"cannot connect to {address}: {type(e).__name__}: {e}",
                        cause="unreachable") from None
    return conn


class Pool:
    """Connections by address, opened on demand and shared by every handle in the process."""

    def __init__(self, *, max_bytes: int, secret: bytes | None) -> None:
        self.max_bytes = max_bytes
        self.secret = secret
        self.conns: dict[str, Connection] = {}
        self.dead: dict[str, ActorDied] = {}
        self._opening: dict[str, asyncio.Future[Connection]] = {}
        # called with the address of a connection lost with calls in flight (set by the runtime)
        self.on_broken: Callable[[str], None] | None = None

    def get_nowait(self, address: str) -> Connection | None:
        conn = self.conns.get(address)
        return conn if conn is not None and conn.dead is None else None

    async def get(self, address: str, label: str) -> Connection:
        """The live connection to `address`, connecting once if needed.

        Raises:
            ActorDied: the actor at `address` is known dead, or cannot be reached.
        """
        conn = self.get_nowait(address)
        if conn is not None:
            return conn
        if address in self.dead:
            raise self.dead[address]
        opening = self._opening.get(address)
        if opening is not None:
            return await asyncio.shield(opening)
        fut: asyncio.Future[Connection] = asyncio.get_running_loop().create_future()
        self._opening[address] = fut
        try:
            conn = await connect(address, label, max_bytes=self.max_bytes, secret=self.secret)
            self.conns[address] = conn
            self.dead.pop(address, None)
            conn.on_lost = lambda c: self._lost(address, c)
            fut.set_result(conn)
            return conn
        except ActorDied as e:
            # Nothing listens there: dead, as after a lost connection, so a handle taken
            # while its actor restarted looks it up again (`Runtime.resolve`) instead of
            # trying the old address forever.
            self.dead[address] = e
            fut.set_exception(e)
            fut.exception()  # mark retrieved
            raise
        except BaseException as e:
            fut.set_exception(e)
            fut.exception()  # mark retrieved
            raise
        finally:
            del self._opening[address]

    def _lost(self, address: str, conn: Connection) -> None:
        if self.conns.get(address) is conn:
            del self.conns[address]
        assert conn.dead is not None
        self.dead.setdefault(address, conn.dead)
        if conn.calls_lost and self.on_broken is not None:
            self.on_broken(address)

    def mark_dead(self, address: str, death: ActorDied) -> None:
        """The owner learned the actor at `address` died (`death` says how): fail its calls
        now, remember it."""
        self.dead[address] = death
        conn = self.conns.pop(address, None)
        if conn is not None:
            conn.death = death
            conn.mark_dead(death)

    def close(self) -> None:
        for conn in list(self.conns.values()):
            conn.on_lost = None
            conn.death = ActorDied(conn.label, "runtime shut down", cause="shutdown")
            if conn.transport is not None:
                conn.transport.close()
        self.conns.clear()
