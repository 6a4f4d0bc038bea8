"""Binding beyond loopback needs a secret; then every frame is authenticated (HMAC-SHA256)."""

from __future__ import annotations

import asyncio
import os
import stat

import msgpack
import numpy as np
import pytest
import pytest_asyncio

from earl.runtime import Actor, BadCall, Runtime, RuntimeConfig, endpoint
from earl.runtime.conn import connect
from earl.runtime.frames import HEADER, MAGIC, Kind

pytestmark = pytest.mark.asyncio(loop_scope="module")
SECRET = "correct horse battery staple"


class Vault(Actor):
    @endpoint
    async def double(self, a: np.ndarray) -> np.ndarray:
        return a * 2

    @endpoint
    async def ping(self) -> str:
        return "pong"


async def test_non_loopback_bind_requires_a_secret(monkeypatch):
    monkeypatch.delenv("EARL_RPC_SECRET", raising=False)
    with pytest.raises(ValueError, match="RuntimeConfig.secret"):
        RuntimeConfig(host="0.0.0.0")
    with pytest.raises(ValueError, match="at least 16"):
        RuntimeConfig(host="0.0.0.0", secret="short")
    assert RuntimeConfig(host="0.0.0.0", secret=SECRET).use_tcp is False
    with pytest.raises(ValueError, match="launcher"):
        RuntimeConfig(launcher="ssh")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def vault():
    async with Runtime(RuntimeConfig(host="0.0.0.0", tcp=True, secret=SECRET)) as rt:
        yield await rt.spawn("vault", Vault)


async def test_authenticated_calls_work_over_tcp(vault):
    assert vault.addresses[0].startswith("tcp:")
    out = await vault.double.call_one(np.arange(100_000, dtype=np.float32))
    np.testing.assert_array_equal(out, np.arange(100_000, dtype=np.float32) * 2)


async def test_wrong_or_missing_secret_is_refused_and_actor_serves_on(vault):
    address = vault.addresses[0]
    with pytest.raises(ValueError, match="requires a shared secret"):
        await connect(address, "vault[0]", max_bytes=1 << 20, secret=None)
    impostor = await connect(address, "vault[0]", max_bytes=1 << 20, secret=b"w" * 32)
    body = msgpack.packb(["ping", [], {}])
    with pytest.raises(BadCall, match="authentication"):
        await impostor.request(Kind.CALL, body, [])
    # an unauthenticated hand-made frame, as an attacker without the secret would send
    host, _, port = address.removeprefix("tcp:").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    await reader.readexactly(20 + 16)  # HELLO with a 16-byte nonce
    writer.write(HEADER.pack(16 + len(body), MAGIC, Kind.CALL, 0, 1, len(body)) + body)
    head = await asyncio.wait_for(reader.readexactly(20), 10)
    assert HEADER.unpack(head)[2] == Kind.REJECT  # dropped, never executed
    writer.close()
    assert await vault.ping.call_one() == "pong"


async def test_unix_sockets_are_private_to_the_user():
    async with Runtime() as rt:
        g = await rt.spawn("private", Vault)
        path = g.addresses[0].removeprefix("unix:")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert await g.ping.call_one() == "pong"
