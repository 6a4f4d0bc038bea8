"""Bad input never kills an actor: each case gives the caller a clear error, then it serves on."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import pytest_asyncio

from earl.runtime import (
    Actor,
    ActorError,
    BadCall,
    FrameTooLarge,
    Runtime,
    RuntimeConfig,
    WireError,
    endpoint,
)
from earl.runtime.frames import HEADER, MAGIC, Kind

pytestmark = pytest.mark.asyncio(loop_scope="module")
LIMIT = 1 << 16


class Svc(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    async def add(self, a: int, b: float = 0.0) -> float:
        self.calls += 1
        return a + b

    @endpoint
    async def blob(self, n: int) -> bytes:
        return b"x" * n

    @endpoint
    async def slow(self, s: float) -> str:
        await asyncio.sleep(s)
        return "done"

    @endpoint
    async def count(self) -> int:
        return self.calls


context_runtime: list[Runtime] = []


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def svc():
    async with Runtime(RuntimeConfig(max_message_bytes=LIMIT)) as rt:
        context_runtime[:] = [rt]
        yield await rt.spawn("svc", Svc)


async def still_serving(svc) -> None:
    assert await svc.add.call_one(2, 0.5) == 2.5


class Raw:
    """A hand-rolled client that can send anything."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer

    @classmethod
    async def open(cls, address: str) -> Raw:
        reader, writer = await asyncio.open_unix_connection(address.removeprefix("unix:"))
        raw = cls(reader, writer)
        kind, _, _ = await raw.recv()
        assert kind == Kind.HELLO
        return raw

    def send_frame(self, kind: int, rid: int, body: bytes) -> None:
        self.w.write(HEADER.pack(16 + len(body), MAGIC, kind, 0, rid, len(body)) + body)

    async def recv(self) -> tuple[int, int, object]:
        head = await asyncio.wait_for(self.r.readexactly(20), 10)
        flen, _magic, kind, nbufs, rid, blen = HEADER.unpack(head)
        rest = await self.r.readexactly(flen - 16)
        return kind, rid, msgpack.unpackb(rest[4 * nbufs:4 * nbufs + blen]) if blen else None

    def close(self) -> None:
        self.w.close()


async def test_unknown_endpoint(svc):
    with pytest.raises(AttributeError, match="no endpoint 'nope'; endpoints: add, blob"):
        svc.nope  # noqa: B018
    raw = await Raw.open(svc.addresses[0])
    raw.send_frame(Kind.CALL, 7, msgpack.packb(["nope", [], {}]))
    kind, rid, msg = await raw.recv()
    assert (kind, rid) == (Kind.REJECT, 7) and "has no endpoint 'nope'" in msg
    raw.close()
    await still_serving(svc)


async def test_wrong_argument_types_and_arity(svc):
    with pytest.raises(BadCall, match="argument 'a' must be int, got str"):
        await svc.add.call_one("1")
    with pytest.raises(TypeError, match="argument 'b' must be float | int, got list"):
        await svc.add.call_one(1, b=[2])
    with pytest.raises(BadCall, match="bad arguments for Svc.add"):
        await svc.add.call_one(1, 2, 3)
    with pytest.raises(BadCall, match="unexpected keyword"):
        await svc.add.call_one(1, c=3)
    with pytest.raises(TypeError, match="called with .call_one"):
        svc.add.stream(1)
    await still_serving(svc)


async def test_unsendable_argument_fails_at_the_caller(svc):
    with pytest.raises(WireError, match="cannot send"):
        svc.add.call_one(object())
    await still_serving(svc)


async def test_non_msgpack_and_malformed_frames(svc):
    raw = await Raw.open(svc.addresses[0])
    raw.send_frame(Kind.CALL, 1, b"\xc1\xc1 not msgpack")
    kind, rid, msg = await raw.recv()
    assert (kind, rid) == (Kind.REJECT, 1) and "malformed request" in msg
    raw.send_frame(Kind.CALL, 2, msgpack.packb({"not": "a request"}))
    kind, rid, msg = await raw.recv()
    assert (kind, rid) == (Kind.REJECT, 2)
    ext = msgpack.ExtType(3, msgpack.packb(["os:system", [["true"]]]))
    raw.send_frame(Kind.CALL, 3, msgpack.packb(["add", [ext], {}]))
    kind, rid, msg = await raw.recv()
    assert (kind, rid) == (Kind.REJECT, 3) and "unregistered message type" in msg
    raw.send_frame(Kind.CALL, 4, msgpack.packb(["add", [1, 2.0], {}]))  # same connection: fine
    assert await raw.recv() == (Kind.OK, 4, 3.0)
    raw.w.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")  # garbage: the actor drops the connection
    assert await asyncio.wait_for(raw.r.read(), 10) == b""
    await still_serving(svc)


async def test_oversized_frames_both_ways(svc):
    with pytest.raises(FrameTooLarge, match="max_message_bytes"):  # refused before sending
        svc.add.call_one(1, b=b"y" * LIMIT)
    with pytest.raises(ActorError, match="max_message_bytes"):
        await svc.blob.call_one(LIMIT)  # the reply is too big: the actor says so
    raw = await Raw.open(svc.addresses[0])
    raw.send_frame(Kind.CALL, 5, msgpack.packb(["add", [1], {"b": 1.0, "pad": "z" * LIMIT}]))
    kind, rid, msg = await raw.recv()
    assert (kind, rid) == (Kind.REJECT, 5) and "max_message_bytes" in msg
    raw.send_frame(Kind.CALL, 6, msgpack.packb(["add", [1, 1.0], {}]))  # stream still in sync
    assert await raw.recv() == (Kind.OK, 6, 2.0)
    raw.close()
    await still_serving(svc)


async def test_peer_disconnecting_mid_call(svc):
    before = await svc.count.call_one()
    for _ in range(3):
        raw = await Raw.open(svc.addresses[0])
        raw.send_frame(Kind.CALL, 1, msgpack.packb(["slow", [0.2], {}]))
        raw.send_frame(Kind.CALL, 2, msgpack.packb(["add", [1, 1.0], {}]))
        await raw.w.drain()
        raw.close()
    assert await svc.slow.call_one(0.3) == "done"  # the abandoned calls finished harmlessly
    assert await svc.count.call_one() == before + 3
    await still_serving(svc)


def _nested_tuples(depth: int) -> msgpack.ExtType:
    data = msgpack.packb([1])
    for _ in range(depth):
        data = msgpack.packb([msgpack.ExtType(4, data)])
    return msgpack.ExtType(4, data)


async def test_deeply_nested_values_are_rejected_by_actors_and_the_directory(svc):
    """The issue's probe: ~1 KB of 200 nested tuples segfaulted msgpack, killing the driver."""
    rt = context_runtime[0]
    for address, request in ((svc.addresses[0], ["add", [_nested_tuples(200)], {}]),
                             (rt.directory_address, ["lookup", [_nested_tuples(200)], {}])):
        body = msgpack.packb(request)
        assert 900 < len(body) + 20 < 1100
        raw = await Raw.open(address)
        raw.send_frame(Kind.CALL, 9, body)
        kind, rid, msg = await raw.recv()
        assert (kind, rid) == (Kind.REJECT, 9) and "MAX_DEPTH" in msg
        raw.close()
    with pytest.raises(WireError, match="MAX_DEPTH"):  # the encoder refuses to send it
        value: object = 1
        for _ in range(200):
            value = (value,)
        svc.add.call_one(value)
    await still_serving(svc)
    assert await rt.dir_call("names") == ["svc"]  # the driver's directory serves on
