"""The HTTP server under the OpenAI endpoint: aiohttp's low-level server, guarded against the
other local users who can reach its loopback port but do not hold its key.

A connection is *trusted* once a request on it arrives with the right `Authorization` header
(checked as soon as the request's headers are parsed, before its body is read). Until then it has
`read_timeout_s` from its opening to get there, then it is closed: a client that never finishes
its headers (slowloris) holds a file descriptor for seconds, not for aiohttp's hour-long
keep-alive. At most `max_connections` connections are kept open: each one past the cap closes
the oldest untrusted connection (never a trusted one, never the newest), so a flood of
half-open connections cannot use up the process's open-file limit or keep its agents out.
Trusted connections belong to the process's own clients and keep aiohttp's keep-alive timeout.
The event loop accepts at most a quarter of the cap in one go, so the connections accepted
after a client's cannot push it out before its headers are read; the kernel's accept queue is
longer (`listen(4096)`, up to `net.core.somaxconn`), so that it takes a flood of more connections
than that to overflow it, which makes the kernel drop (or, with SYN cookies, reset) the key
holder's new connections too.

This module does not route or answer requests (`earl.agents.openai_server`).
"""

from __future__ import annotations

import asyncio
import hmac
import resource
import socket
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler

__all__ = ["ConnectionStatistics", "GuardedServer", "connection_cap", "serve"]

_MAX_DEFAULT_CAP = 4096
_LISTEN_QUEUE = 4096


def connection_cap(requested: int | None) -> int:
    """The connection cap of the process's endpoint: `requested`, or by default half the
    process's open-file limit (RLIMIT_NOFILE), at most 4096; the other half is left to the rest
    of the process (actor sockets, shared memory, sandboxes).

    Raises:
        ValueError: `requested` is over half the open-file limit.
    """
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    room = (1 << 30) if soft == resource.RLIM_INFINITY else soft // 2
    if requested is None:
        return max(1, min(_MAX_DEFAULT_CAP, room))
    if requested > room:
        raise ValueError(f"EndpointConfig.max_connections={requested} is over half of this "
                         f"process's open-file limit ({soft}, RLIMIT_NOFILE), which would leave "
                         f"too few files for the rest of it; use at most {room} or raise the "
                         f"limit (`ulimit -n`)")
    return requested


@dataclass(frozen=True, slots=True)
class ConnectionStatistics:
    """Connections of a `GuardedServer`.

    Attributes:
        open: connections open now.
        untrusted: of which no request has yet carried the key.
        closed_untrusted: untrusted connections closed so far for the read timeout or the cap.
    """

    open: int
    untrusted: int
    closed_untrusted: int


class GuardedServer(web.Server):
    """`aiohttp.web.Server` with the key check, read timeout and connection cap described above.

    Args:
        handler: answers each request (it still checks the key itself: this class only decides
            which connections to keep).
        auth: the exact `Authorization` header value of the key.
        max_connections: the cap (see `connection_cap`).
        read_timeout_s: how long an untrusted connection may stay open.
        max_body: `client_max_size` of each request.
    """

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]], *,
                 auth: bytes, max_connections: int, read_timeout_s: float,
                 max_body: int) -> None:
        # lingering: how long the rest of a refused request's body is read and dropped, so that
        # its client sees the response rather than a reset (on loopback, ms for 32 MiB)
        super().__init__(handler, request_factory=self._request, access_log=None,
                         lingering_time=1.0)
        self._auth, self._cap, self._timeout, self._max_body = (
            auth, max_connections, read_timeout_s, max_body)
        self._untrusted: dict[RequestHandler, asyncio.TimerHandle] = {}  # oldest first
        self._trusted: set[RequestHandler] = set()
        self._closed = 0

    @property
    def accept_burst(self) -> int:
        """The most connections the event loop accepts in one go (see the module docstring)."""
        return max(8, min(1024, self._cap // 4))

    def authorized(self, headers: Mapping[str, str]) -> bool:
        """Whether `headers` carry the key."""
        return hmac.compare_digest(headers.get("Authorization", "").encode(), self._auth)

    def statistics(self) -> ConnectionStatistics:
        return ConnectionStatistics(open=len(self._untrusted) + len(self._trusted),
                                    untrusted=len(self._untrusted), closed_untrusted=self._closed)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._untrusted[handler] = self._loop.call_later(self._timeout, self._expire, handler)
        excess = len(self._untrusted) + len(self._trusted) - self._cap
        while excess > 0 and len(self._untrusted) > 1:  # the newest (this one) is last
            self._close(next(iter(self._untrusted)))
            excess -= 1

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        timer = self._untrusted.pop(handler, None)
        if timer is not None:
            timer.cancel()
        else:
            self._trusted.discard(handler)

    def _request(self, message: RawRequestMessage, payload: StreamReader,
                 protocol: RequestHandler, writer: AbstractStreamWriter,
                 task: asyncio.Task[None]) -> web.BaseRequest:
        """aiohttp's request factory: runs once a request's headers are parsed, before its
        handler runs and reads the body."""
        if protocol in self._untrusted and self.authorized(message.headers):
            self._untrusted.pop(protocol).cancel()
            self._trusted.add(protocol)
        return web.BaseRequest(message, payload, protocol, writer, task, self._loop,
                               client_max_size=self._max_body)

    def _expire(self, handler: RequestHandler) -> None:
        if handler in self._untrusted:
            self._close(handler)

    def _close(self, handler: RequestHandler) -> None:
        self._untrusted.pop(handler).cancel()
        self._closed += 1
        handler.force_close()


async def serve(server: GuardedServer, port: int) -> tuple[web.ServerRunner, int]:
    """Serve `server` on 127.0.0.1:`port` (0: a free one).

    Returns:
        The runner (`await runner.cleanup()` stops serving) and the port.
    """
    sock = socket.create_server(("127.0.0.1", port))
    runner = web.ServerRunner(server, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=server.accept_burst).start()
    sock.listen(_LISTEN_QUEUE)  # after the event loop's own listen(accept_burst)
    return runner, int(sock.getsockname()[1])
