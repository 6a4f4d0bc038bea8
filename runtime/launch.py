"""Launcher interface and the bootstrap handshake every launcher uses.

A launcher starts one actor process from an `ActorSpec` and returns a `ProcessHandle`. The
process is always `python -m earl.runtime.host FD` with FD one end of a socket pair: the
launcher sends the spec over it, the host answers READY (address, pid) or FAILED (traceback),
and from then on the pair is the liveness line: closing it asks the actor to stop, and the actor
exits if its parent goes away. The launchers, "local" (`launch_local`) and "ray"
(`launch_ray`), build on this module, which imports neither; `Runtime` picks one by name
(`make_launcher` in `earl.runtime.runtime`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from earl.runtime.slots import Slot
from earl.runtime.wire import decode, encode, message

_LEN = struct.Struct("<I")


@message
@dataclass(kw_only=True, slots=True)
class ActorSpec:
    """Everything an actor process needs to start (sent over the bootstrap socket)."""

    name: str
    rank: int
    world_size: int
    cls_module: str
    cls_qualname: str
    main_file: str | None
    call: bytes  # `[args, kwargs]` packed by `pack_call`; decoded after the class is imported
    bind: str  # "unix:/path" or "tcp:host:0"
    directory: str  # address of the root directory
    run_dir: str
    host: str
    tcp: bool
    secret: bytes | None
    max_message_bytes: int
    sys_path: list[str] = field(default_factory=list)
    refs: list[str] = field(default_factory=list)  # earl.runtime.registry: callables it may name
    roots: list[str] = field(default_factory=list)  # ... and paths it may write under
    slot: Slot | None = None  # where the launcher places the process (runtime/slots.py)
    env: dict[str, str] = field(default_factory=dict)  # set in the process before the class loads


def _pack(obj: Any) -> bytes:
    body, bufs = encode(obj)
    return msgpack.packb([body, [bytes(memoryview(b)) for b in bufs]], use_bin_type=True)


def pack_msg(obj: Any) -> bytes:
    data = _pack(obj)
    return _LEN.pack(len(data)) + data


def pack_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Constructor arguments, packed so the actor process decodes them (`unpack_msg`) only after
    importing its class's module, which registers the `@message` dataclasses they may contain."""
    return _pack([list(args), kwargs])


def unpack_msg(data: bytes) -> Any:
    body, bufs = msgpack.unpackb(data, raw=False)
    return decode(body, [bytearray(b) for b in bufs])


def recv_msg_blocking(sock: socket.socket) -> Any:
    """Read one bootstrap message (used by the host before its event loop starts)."""
    head = _recv_exact(sock, _LEN.size)
    return unpack_msg(_recv_exact(sock, _LEN.unpack(head)[0]))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("bootstrap socket closed")
        buf += chunk
    return bytes(buf)


async def recv_msg(sock: socket.socket) -> Any:
    """Read one bootstrap message from a non-blocking socket.

    Raises:
        EOFError: the peer closed the socket (the process died before answering).
    """
    loop = asyncio.get_running_loop()

    async def exact(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = await loop.sock_recv(sock, n - len(buf))
            if not chunk:
                raise EOFError("bootstrap socket closed")
            buf += chunk
        return bytes(buf)

    (n,) = _LEN.unpack(await exact(_LEN.size))
    return unpack_msg(await exact(n))


class ProcessHandle(Protocol):
    """One launched actor process."""

    pid: int
    address: str

    async def wait_exit(self) -> str:
        """Wait until the process is gone; return why (e.g. "exit code -9")."""
        ...

    def stop(self) -> None:
        """Ask the process to exit (closes the liveness line)."""
        ...

    def kill(self) -> None:
        """Kill the process now."""
        ...


class Launcher(Protocol):
    async def launch(self, spec: ActorSpec, env: dict[str, str] | None) -> ProcessHandle: ...

    async def close(self) -> None: ...

