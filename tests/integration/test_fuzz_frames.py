"""Fuzzed frames against an actor and the driver's directory: nothing crashes, valid calls mixed
in are answered.

Each batch opens a raw connection, sends one valid call, then random and mutated frames (random
bytes, bit flips, truncations, length lies, bogus kinds, 100-300 nested tuples, 5,000 nested
lists, huge declared msgpack lengths, bogus arrays, tensors and messages; over TCP also frames
with bad MACs), half-closes, and reads until the server is done with it. Between batches the
real client calls both targets. The default run sends >= 10,000 frames in ~10 s; the slow one
sends 10x more.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
import random
import struct

import msgpack
import pytest

from earl.runtime import Actor, Runtime, RuntimeConfig, endpoint
from earl.runtime.conn import connect, open_stream
from earl.runtime.frames import HEADER, MAC_LEN, MAGIC, Kind, derive_key
from earl.runtime.wire import encode

pytestmark = pytest.mark.asyncio(loop_scope="function")
LIMIT = 1 << 20


class Target(Actor):
    @endpoint
    async def add(self, a: int, b: float = 0.0) -> float:
        return a + b

    @endpoint
    def echo(self, x: object) -> object:
        return x


def _frame(kind: int, rid: int, body: bytes, bufs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    lens = struct.pack(f"<{len(bufs)}I", *(len(b) for b in bufs))
    flen = 16 + len(lens) + len(body) + sum(map(len, bufs))
    return HEADER.pack(flen, MAGIC, kind, len(bufs), rid, len(body)) + lens + body + b"".join(bufs)


def _nested_tuples(depth: int) -> bytes:
    data = msgpack.packb([1])
    for _ in range(depth):
        data = msgpack.packb([msgpack.ExtType(4, data)])
    return data


def _bodies(rng: random.Random) -> list[bytes]:
    """Request bodies that decode to something hostile (or fail to decode)."""
    ext = msgpack.ExtType
    deep = _nested_tuples(rng.randrange(100, 300))
    return [
        msgpack.packb(["add", [ext(4, deep)], {}]),
        msgpack.packb(["echo", [ext(4, deep)], {}]),
        b"\x93\xa3add" + b"\x91" * 5000 + b"\x01\x80",  # 5,000 nested lists
        b"\x93\xa3add\xdd\xff\xff\xff\xff",  # array32 declaring 4G items
        b"\x93\xa3add\x91\xdb\xff\xff\xff\xff",  # str32 declaring 4 GiB
        b"\x93\xa3add\x91\xc6\x7f\xff\xff\xff",  # bin32 declaring 2 GiB
        b"\x93\xa3add\x91\xc9\xff\xff\xff\xff\x04",  # ext32 declaring 4 GiB
        msgpack.packb(["echo", [ext(1, msgpack.packb(["|O", [3], 0]))], {}]),  # object dtype
        msgpack.packb(["echo", [ext(1, msgpack.packb(["<f4", [1 << 40], 0]))], {}]),
        msgpack.packb(["echo", [ext(2, msgpack.packb(["float32", [1 << 20, 1 << 20], 0]))], {}]),
        msgpack.packb(["echo", [ext(3, msgpack.packb(["os:system", [["id"]]]))], {}]),
        msgpack.packb(["publish", [ext(3, msgpack.packb(
            ["earl.runtime.directory:GroupRecord", [1, 2, 3]]))], {}]),
        msgpack.packb(["update", ["x", 1 << 62, "up"], {}]),
        msgpack.packb(["lookup", [rng.randbytes(8)], {"timeout": 1e308}]),
        msgpack.packb(["wait_status", ["nope", -1, "up", float("nan")], {}]),
        msgpack.packb([rng.randbytes(4), rng.random(), None]),
        rng.randbytes(rng.randrange(0, 64)),
    ]


def _fuzz_frames(rng: random.Random, n: int) -> list[bytes]:
    good = _frame(Kind.CALL, 7, msgpack.packb(["add", [1, 2.0], {}]))
    out = []
    bodies = _bodies(rng)
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            f = _frame(rng.choice([Kind.CALL, Kind.STREAM, Kind.ONEWAY]), rng.randrange(1 << 32),
                       rng.choice(bodies))
        elif r < 0.45:  # bit flips in a valid frame (header included)
            f = bytearray(good)
            for _ in range(rng.randrange(1, 4)):
                f[rng.randrange(len(f))] ^= 1 << rng.randrange(8)
            f = bytes(f)
        elif r < 0.55:  # length lies: frame, body or buffer lengths
            body = rng.choice(bodies)
            nb = rng.randrange(0, 4)
            lens = [rng.randrange(0, 1 << 32) for _ in range(nb)]
            f = HEADER.pack(rng.choice([16 + len(body) + rng.randrange(-20, 20), 16 + len(body)]),
                            MAGIC, Kind.CALL, nb, 1, rng.randrange(0, 1 << 32))
            f += struct.pack(f"<{nb}I", *lens) + body
        elif r < 0.6:  # a declared length past max_message_bytes
            f = HEADER.pack(rng.randrange(LIMIT, 1 << 32), MAGIC, Kind.CALL, 0, 3, 10) + b"x" * 10
        elif r < 0.7:  # truncated
            f = good[: rng.randrange(len(good))]
        elif r < 0.8:  # any kind, random body
            f = _frame(rng.randrange(256), rng.randrange(1 << 64), rng.randbytes(rng.randrange(40)))
        elif r < 0.85:  # buffers whose counts or lengths disagree with the body
            f = _frame(Kind.CALL, 2, rng.choice(bodies), [rng.randbytes(rng.randrange(9))
                                                          for _ in range(rng.randrange(1, 5))])
        elif r < 0.9:  # short frame lengths
            f = HEADER.pack(rng.randrange(16), MAGIC, Kind.CALL, 0, 1, 0)
        else:
            f = rng.randbytes(rng.randrange(1, 80))
        out.append(f)
    return out


class Raw:
    """A raw connection that can MAC frames (or not) once it knows the run's secret."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 secret: bytes | None) -> None:
        self.r, self.w, self.secret = reader, writer, secret
        self.key: bytes | None = None
        self.seq = 0

    @classmethod
    async def open(cls, address: str, secret: bytes | None) -> Raw:
        r, w = await open_stream(address)
        raw = cls(r, w, secret)
        head = await asyncio.wait_for(r.readexactly(20), 10)
        nonce = await r.readexactly(HEADER.unpack(head)[5])
        if nonce and secret is not None:
            raw.key = derive_key(secret, nonce)
            raw.write(_frame(Kind.AUTH, 0, b""), mac_len=True)
        return raw

    def write(self, frame: bytes, mac_len: bool = False, good_mac: bool = True) -> None:
        if self.key is None:
            self.w.write(frame)
            return
        if mac_len and len(frame) >= 20:  # count the MAC in the frame length
            frame = struct.pack("<I", struct.unpack_from("<I", frame)[0] + MAC_LEN) + frame[4:]
        mac = hmac.new(self.key, b"C" + self.seq.to_bytes(8, "little") + frame,
                       hashlib.sha256).digest()
        self.seq += 1
        self.w.write(frame + (mac if good_mac else bytes(b ^ 1 for b in mac)))

    async def replies(self) -> dict[int, tuple[int, bytes]]:
        """Read frames until the server closes: {rid: (kind, body)} (MACs not checked)."""
        out: dict[int, tuple[int, bytes]] = {}
        try:
            while True:
                head = await asyncio.wait_for(self.r.readexactly(20), 10)
                flen, _, kind, nb, rid, blen = HEADER.unpack(head)
                rest = await self.r.readexactly(flen - 16)
                out[rid] = (kind, rest[4 * nb:4 * nb + blen])
        except (asyncio.IncompleteReadError, ConnectionError):
            return out


async def _batch(address: str, secret: bytes | None, frames: list[bytes], rng: random.Random,
                 rid: int, request: list[object]) -> None:
    raw = await Raw.open(address, secret)
    raw.write(_frame(Kind.CALL, rid, msgpack.packb(request)), mac_len=True)
    head = await asyncio.wait_for(raw.r.readexactly(20), 10)
    if HEADER.unpack(head)[2] == Kind.AUTH:  # the server's AUTH frame comes first over TCP
        await raw.r.readexactly(HEADER.unpack(head)[0] - 16)
        head = await asyncio.wait_for(raw.r.readexactly(20), 10)
    flen, _, kind, _, got, _ = HEADER.unpack(head)
    await raw.r.readexactly(flen - 16)
    assert (kind, got) == (Kind.OK, rid)  # the valid call is answered
    for f in frames:
        raw.write(f, mac_len=rng.random() < 0.9, good_mac=rng.random() < 0.8)
    if raw.w.can_write_eof():
        with contextlib.suppress(OSError):  # the server may have closed on us already (ENOTCONN)
            raw.w.write_eof()
    await raw.replies()  # whatever comes back, until the server is done with us
    raw.w.close()


async def _fuzz(config: RuntimeConfig, n_frames: int, seed: int) -> None:
    rng = random.Random(seed)
    async with Runtime(config) as rt:
        g = await rt.spawn("target", Target)
        pid = (await rt.dir_call("lookup", "target")).pids[0]
        directory = await connect(rt.directory_address, "directory", max_bytes=LIMIT,
                                  secret=rt.secret)
        per_batch = 25
        sent = 0
        for i in range(n_frames // per_batch // 2):
            frames = _fuzz_frames(rng, per_batch)
            await _batch(g.addresses[0], rt.secret, frames, rng, 1000 + i, ["add", [i, 1.0], {}])
            await _batch(rt.directory_address, rt.secret, frames, rng, 1000 + i, ["names", [], {}])
            sent += 2 * per_batch
            # valid calls through the real client, to both targets, answered every time
            assert await asyncio.wait_for(g.add.call_one(i, 0.5), 10) == i + 0.5
            names = await asyncio.wait_for(directory.request(
                Kind.CALL, encode(["names", [], {}])[0], []), 10)
            assert names == ["target"]
        assert sent >= n_frames
        os.kill(pid, 0)  # the actor process is alive (and the driver, running this test)
        assert await g.echo.call_one((1, (2, (3,)))) == (1, (2, (3,)))


@pytest.mark.timeout(60)
async def test_fuzzed_frames_unix_sockets() -> None:
    await _fuzz(RuntimeConfig(max_message_bytes=LIMIT), 10_000, seed=1)


@pytest.mark.timeout(60)
async def test_fuzzed_frames_authenticated_tcp() -> None:
    await _fuzz(RuntimeConfig(tcp=True, max_message_bytes=LIMIT), 2_000, seed=2)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_fuzzed_frames_many() -> None:
    await _fuzz(RuntimeConfig(max_message_bytes=LIMIT), 100_000, seed=3)
    await _fuzz(RuntimeConfig(tcp=True, max_message_bytes=LIMIT), 20_000, seed=4)
