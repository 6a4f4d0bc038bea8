"""Server side of the RPC: serves one object's `@endpoint` methods on a listening socket.

Each request is decoded and checked synchronously in the protocol callback; a plain `def`
endpoint runs inline, an `async def` one runs as a task in the server's task group (which the
caller owns), a generator endpoint streams ITEM frames (at most STREAM_WINDOW ahead of the
consumer's CREDIT frames) and honours CANCEL. Bad requests (unknown endpoint, wrong arguments,
undecodable body, oversized frame) are answered with REJECT and logged; the server keeps
serving. An endpoint that raises is answered with ERR: the type, message and traceback for
people, and the failure as data (`earl.runtime.errors.error_record`: this actor's class, the
endpoint, and every actor death behind the error). With a secret, at most
`MAX_UNAUTHENTICATED` connections may be waiting to authenticate (a new one evicts the oldest),
each for at most `AUTH_TIMEOUT_S`. Used by actor processes and by the root runtime's directory.
"""

from __future__ import annotations

import asyncio
import os
import socket
import traceback
from collections.abc import Callable, Coroutine
from typing import Any

from earl.runtime.conn import split_address
from earl.runtime.endpoint import Endpoint, endpoints_of
from earl.runtime.errors import error_record
from earl.runtime.frames import STREAM_WINDOW, FrameProtocol, FrameTooLarge, Kind, log
from earl.runtime.wire import WireError, decode, encode

_REQUESTS = (Kind.CALL, Kind.ONEWAY, Kind.STREAM)
MAX_UNAUTHENTICATED = 128  # connections per server that have not proved the secret yet
AUTH_TIMEOUT_S = 10.0  # ... and how long each may take to do so


def _error_body(e: BaseException, kind: str, call: str | None,
                with_traceback: bool = True) -> bytes:
    msg = str(e)
    msg = msg if len(msg) <= 2000 else msg[:2000] + "... (truncated)"
    tb = "".join(traceback.format_exception(e)) if with_traceback else ""
    tb = tb if len(tb) <= 16000 else "... (truncated)\n" + tb[-16000:]
    return encode([f"{type(e).__module__}.{type(e).__qualname__}", msg, tb,
                   error_record(e, kind=kind, call=call)])[0]


class _Resume:
    """Awaitable that continues a coroutine already stepped once (which yielded `yielded`)."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro: Any, yielded: Any) -> None:
        self.coro, self.yielded = coro, yielded

    def __await__(self) -> Any:
        coro, out = self.coro, self.yielded
        while True:
            try:
                value = yield out
            except BaseException as e:  # noqa: BLE001 (forwarded, e.g. cancellation)
                try:
                    out = coro.throw(e)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    out = coro.send(value)
                except StopIteration as stop:
                    return stop.value


class _ServerConnection(FrameProtocol):
    send_dir = b"S"

    def __init__(self, server: Server) -> None:
        super().__init__(max_bytes=server.max_bytes, secret=server.secret)
        self.server = server
        self.streams: dict[int, asyncio.Task[None]] = {}
        self.credits: dict[int, list[Any]] = {}  # rid -> [items allowed, Event]
        self._auth_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        srv = self.server
        if not self.authenticated:
            if len(srv.unauthenticated) >= MAX_UNAUTHENTICATED:  # evict the oldest: a slow
                # attacker cannot hold every slot, and honest peers authenticate within an RTT
                oldest = next(iter(srv.unauthenticated))
                oldest.drop(f"{MAX_UNAUTHENTICATED} connections waiting to authenticate; "
                            "closing the oldest")
                oldest.on_authenticated()
            srv.unauthenticated[self] = None
            self._auth_timer = asyncio.get_running_loop().call_later(
                AUTH_TIMEOUT_S, self.drop, f"no authenticated frame within {AUTH_TIMEOUT_S:g} s")
        srv.conns.add(self)
        self.send_hello()

    def on_authenticated(self) -> None:
        self.server.unauthenticated.pop(self, None)
        if self._auth_timer is not None:
            self._auth_timer.cancel()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_authenticated()  # frees its unauthenticated slot, if it held one
        self.server.conns.discard(self)
        for task in self.streams.values():
            task.cancel()
        self.streams.clear()

    def reply(self, kind: int, rid: int, body: bytes, bufs: Any = ()) -> None:
        try:
            self.send(kind, rid, body, bufs)
        except ConnectionError:
            pass  # the caller went away mid-call; nothing to tell it
        except FrameTooLarge as e:  # too big to send (or even its traceback): say so briefly
            try:
                self.send(Kind.ERR, rid, _error_body(e, self.server.cls_name, None,
                                                     with_traceback=False))
            except (FrameTooLarge, ConnectionError):
                log.error("%s: cannot send the error for request %d", self.server.label, rid)

    def reject(self, rid: int, reason: str) -> None:
        log.warning("%s: rejected request %d: %s", self.server.label, rid, reason)
        self.reply(Kind.REJECT, rid, encode(reason)[0])

    def frame_refused(self, kind: int, rid: int, reason: str) -> None:
        if kind in _REQUESTS and kind != Kind.ONEWAY:
            self.reject(rid, reason)

    def frame_received(self, kind: int, rid: int, body: memoryview, bufs: list[Any]) -> None:
        if kind == Kind.CREDIT:
            credit = self.credits.get(rid)
            if credit is not None:
                try:
                    credit[0] += int(decode(body))
                except (WireError, TypeError, ValueError):
                    return self.reject(rid, "malformed CREDIT frame")
                credit[1].set()
            return
        if kind == Kind.CANCEL:
            task = self.streams.pop(rid, None)
            if task is not None:
                task.cancel()
            return
        if kind == Kind.AUTH:  # the client's proof of the secret; nothing to answer
            return
        if kind not in _REQUESTS:
            log.warning("%s: ignoring frame of kind %d", self.server.label, kind)
            return
        srv = self.server
        try:
            method, args, kwargs = decode(body, bufs)
            if not (isinstance(method, str) and isinstance(args, list)
                    and isinstance(kwargs, dict)):
                raise WireError("request is not [method, args, kwargs]")
        except (WireError, ValueError, TypeError) as e:
            return self.reject(rid, f"malformed request: {e}")
        ep = srv.endpoints.get(method)
        if ep is None:
            return self.reject(rid, f"{srv.cls_name} has no endpoint {method!r}; endpoints: "
                                    f"{', '.join(sorted(srv.endpoints)) or '(none)'}")
        if ep.is_stream != (kind == Kind.STREAM):
            want = ".stream()" if ep.is_stream else ".call_one()/.call()/.choose()/.broadcast()"
            return self.reject(rid, f"{srv.cls_name}.{method} must be called with {want}")
        try:
            ep.check(srv.cls_name, args, kwargs)
            result = ep.fn(srv.target, *args, **kwargs)
        except TypeError as e:
            if not ep.is_async and not ep.is_stream and e.__traceback__ is not None \
                    and e.__traceback__.tb_next is not None:
                return self._fail(kind, rid, method, e)  # raised in a plain-def endpoint's body
            return self.reject(rid, f"bad arguments for {srv.cls_name}.{ep.signature()}: {e}")
        except Exception as e:  # noqa: BLE001
            return self._fail(kind, rid, method, e)
        if kind == Kind.STREAM:
            self.credits[rid] = [STREAM_WINDOW, asyncio.Event()]
            self.streams[rid] = srv.spawn(self._stream(rid, method, result))
        elif ep.never_suspends:  # runs to completion in one step: no task needed
            try:
                yielded = result.send(None)
            except StopIteration as stop:
                value = stop.value
            except Exception as e:  # noqa: BLE001
                return self._fail(kind, rid, method, e)
            else:  # it did suspend
                srv.spawn(self._finish(kind, rid, method, _Resume(result, yielded)))
                return
            if kind == Kind.CALL:  # outside the except: no StopIteration in later tracebacks
                self._ok(rid, method, value)
        elif ep.is_async:
            srv.spawn(self._finish(kind, rid, method, result))
        elif kind == Kind.CALL:
            self._ok(rid, method, result)

    def _fail(self, kind: int, rid: int, method: str, e: Exception) -> None:
        if kind == Kind.ONEWAY:
            log.error("%s: broadcast call failed", self.server.label, exc_info=e)
        else:
            self.reply(Kind.ERR, rid, _error_body(e, self.server.cls_name, method))

    def _ok(self, rid: int, method: str, result: Any) -> None:
        try:
            body, bufs = encode(result)
        except WireError as e:
            return self.reply(Kind.ERR, rid, _error_body(e, self.server.cls_name, method))
        self.reply(Kind.OK, rid, body, bufs)

    async def _finish(self, kind: int, rid: int, method: str, coro: Any) -> None:
        try:
            result = await coro
        except Exception as e:  # noqa: BLE001
            return self._fail(kind, rid, method, e)
        if kind == Kind.CALL:
            self._ok(rid, method, result)

    async def _stream(self, rid: int, method: str, agen: Any) -> None:
        credit = self.credits[rid]
        try:
            n = 0
            async for item in agen:
                body, bufs = encode(item)
                self.reply(Kind.ITEM, rid, body, bufs)
                credit[0] -= 1
                n += 1
                while credit[0] <= 0:  # the consumer is behind: wait for its CREDIT
                    credit[1].clear()
                    await credit[1].wait()
                if self._paused:
                    await self.wait_writable()
                elif n % 32 == 0:  # a generator that never awaits must not starve the loop
                    await asyncio.sleep(0)
            self.reply(Kind.END, rid, b"")
        except Exception as e:  # noqa: BLE001
            self.reply(Kind.ERR, rid, _error_body(e, self.server.cls_name, method))
        finally:
            self.streams.pop(rid, None)
            self.credits.pop(rid, None)
            await agen.aclose()


def _advertised(host: str) -> str:
    """The address peers should dial for a server bound to `host` (wildcards: this node)."""
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Server:
    """Serves `target`'s endpoints; request tasks are started by `spawn` (the caller's task
    group, so the caller owns their lifetime)."""

    def __init__(self, target: object, label: str, *,
                 spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
                 max_bytes: int, secret: bytes | None) -> None:
        self.target = target
        self.label = label
        self.cls_name = type(target).__qualname__
        self.endpoints: dict[str, Endpoint[Any, Any]] = endpoints_of(type(target))
        self.spawn = spawn
        self.max_bytes = max_bytes
        self.secret = secret
        self.conns: set[_ServerConnection] = set()
        self.unauthenticated: dict[_ServerConnection, None] = {}  # oldest first
        self._server: asyncio.AbstractServer | None = None

    async def start(self, bind: str) -> str:
        """Listen on `unix:/path` or `tcp:host:port` (port 0 = any); return the address."""
        loop = asyncio.get_running_loop()
        scheme, where, port = split_address(bind)
        if scheme == "unix":
            self._server = await loop.create_unix_server(lambda: _ServerConnection(self), where,
                                                         backlog=1024)
            os.chmod(where, 0o600)  # only this user may connect
            return bind
        self._server = await loop.create_server(lambda: _ServerConnection(self), where,
                                                port, backlog=1024, reuse_address=True)
        bound = self._server.sockets[0].getsockname()
        return f"tcp:{_advertised(where)}:{bound[1]}"

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.conns):
            if conn.transport is not None:
                conn.transport.close()
