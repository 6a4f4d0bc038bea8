"""Every TCP endpoint authenticates (loopback included), before it allocates; refs and paths
that arrive over a socket only reach what the run registered."""

from __future__ import annotations

import asyncio
import os
import stat
import sys
import textwrap

import msgpack
import numpy as np
import psutil
import pytest
import pytest_asyncio

from earl.runtime import Actor, ActorError, Runtime, RuntimeConfig, endpoint, registry
from earl.runtime import server as server_mod
from earl.runtime.conn import connect
from earl.runtime.frames import HEADER, MAGIC, Kind

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]
SECRET = "correct horse battery staple"


class Vault(Actor):
    def __init__(self) -> None:
        self.calls = 0

    @endpoint
    async def double(self, a: np.ndarray) -> np.ndarray:
        return a * 2

    @endpoint
    async def ping(self) -> str:
        self.calls += 1
        return "pong"

    @endpoint
    async def count(self) -> int:
        return self.calls


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
    """Loopback TCP with no secret configured: the runtime makes one for the run."""
    async with Runtime(RuntimeConfig(tcp=True)) as rt:
        assert rt.secret is not None and len(rt.secret) == 32
        yield rt, await rt.spawn("vault", Vault)


def _tcp(address: str) -> tuple[str, int]:
    host, _, port = address.removeprefix("tcp:").rpartition(":")
    return host, int(port)


async def test_loopback_tcp_is_authenticated_with_a_per_run_secret(vault):
    rt, g = vault
    assert g.addresses[0].startswith("tcp:127.0.0.1:")
    out = await g.double.call_one(np.arange(100_000, dtype=np.float32))  # > 64 KiB: after AUTH
    np.testing.assert_array_equal(out, np.arange(100_000, dtype=np.float32) * 2)
    with pytest.raises(ValueError, match="requires a shared secret"):
        await connect(g.addresses[0], "vault[0]", max_bytes=1 << 20, secret=None)
    with pytest.raises(ValueError, match="authentication handshake"):
        await connect(g.addresses[0], "vault[0]", max_bytes=1 << 20, secret=b"w" * 32)
    with pytest.raises(ValueError, match="authentication handshake"):  # the directory too
        await connect(rt.directory_address, "directory", max_bytes=1 << 20, secret=b"w" * 32)


async def test_unauthenticated_frames_close_the_connection_and_run_nothing(vault):
    _, g = vault
    before = await g.count.call_one()
    reader, writer = await asyncio.open_connection(*_tcp(g.addresses[0]))
    await reader.readexactly(20 + 16)  # HELLO with a 16-byte nonce (then the server's AUTH)
    body = msgpack.packb(["ping", [], {}])
    writer.write(HEADER.pack(16 + len(body), MAGIC, Kind.CALL, 0, 1, len(body)) + body)
    rest = await asyncio.wait_for(reader.read(), 10)  # the server's AUTH frame, then EOF
    assert len(rest) == 20 + 32 and HEADER.unpack(rest[:20])[2] == Kind.AUTH
    writer.close()
    assert await g.count.call_one() == before  # never executed
    assert await g.ping.call_one() == "pong"


async def test_unauthenticated_peer_cannot_make_the_actor_allocate(vault):
    _, g = vault
    conns = []
    for _ in range(6):  # the probe: six connections each declaring a 256 MiB frame
        reader, writer = await asyncio.open_connection(*_tcp(g.addresses[0]))
        writer.write(HEADER.pack((256 << 20) - 4, MAGIC, Kind.CALL, 0, 1, 10) + b"x" * 1000)
        conns.append((reader, writer))
    for reader, writer in conns:
        try:  # closed at the header (HELLO and AUTH at most came back), nothing buffered
            assert len(await asyncio.wait_for(reader.read(), 10)) <= 20 + 16 + 20 + 32
        except ConnectionResetError:
            pass
        writer.close()
    assert await g.ping.call_one() == "pong"


async def test_unauthenticated_connections_are_capped_and_time_out(monkeypatch):
    monkeypatch.setattr(server_mod, "MAX_UNAUTHENTICATED", 4)
    monkeypatch.setattr(server_mod, "AUTH_TIMEOUT_S", 0.5)
    async with asyncio.TaskGroup() as tg:
        srv = server_mod.Server(Vault(), "vault", spawn=tg.create_task, max_bytes=1 << 20,
                                secret=SECRET.encode())
        address = await srv.start("tcp:127.0.0.1:0")
        idle = []
        for _ in range(5):
            idle.append(await asyncio.open_connection(*_tcp(address)))
            await idle[-1][0].readexactly(20 + 16)  # HELLO: the server has counted it
        reader, writer = idle.pop(0)  # the fifth evicted the oldest
        assert len(await asyncio.wait_for(reader.read(), 5)) == 20 + 32  # AUTH, then EOF
        writer.close()
        assert len(srv.unauthenticated) == 4
        for reader, writer in idle:  # the other four time out
            await asyncio.wait_for(reader.read(), 5)
            writer.close()
        conn = await connect(address, "vault", max_bytes=1 << 20, secret=SECRET.encode())
        body, _ = msgpack.packb(["ping", [], {}]), None
        assert await conn.request(Kind.CALL, body, []) == "pong"
        assert not srv.unauthenticated
        conn.transport.close()
        srv.close()


async def test_unix_sockets_are_private_to_the_user():
    async with Runtime() as rt:
        g = await rt.spawn("private", Vault)
        path = g.addresses[0].removeprefix("unix:")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(rt.run_dir).st_mode) == 0o700
        assert await g.ping.call_one() == "pong"


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


async def _declare_big_frames(address: str, n: int = 8) -> list[asyncio.StreamWriter]:
    """The probe: n connections each announcing a 256 MiB frame and sending 1 kB of it."""
    writers = []
    for _ in range(n):
        _, writer = await asyncio.open_unix_connection(address.removeprefix("unix:"))
        writer.write(HEADER.pack((256 << 20) - 4, MAGIC, Kind.CALL, 0, 1, 10) + b"x" * 1000)
        await writer.drain()
        writers.append(writer)
    await asyncio.sleep(0.5)  # let the server read what was sent
    return writers


async def test_a_unix_socket_peer_cannot_make_the_actor_allocate():
    async with Runtime() as rt:  # unix sockets, no secret
        g = await rt.spawn("vault", Vault)
        pid = (await rt.dir_call("lookup", "vault")).pids[0]
        before = _rss_mb(pid)
        writers = await _declare_big_frames(g.addresses[0])
        grown = _rss_mb(pid) - before
        for w in writers:
            w.close()
        assert grown < 64, f"the actor grew by {grown:.0f} MB on headers alone"
        assert await g.ping.call_one() == "pong"


async def test_a_server_without_a_secret_commits_memory_only_as_bytes_arrive(tmp_path):
    async with asyncio.TaskGroup() as tg:
        srv = server_mod.Server(Vault(), "bare", spawn=tg.create_task, max_bytes=512 << 20,
                                secret=None)
        address = await srv.start(f"unix:{tmp_path}/bare.sock")
        before = _rss_mb(os.getpid())
        writers = await _declare_big_frames(address)
        grown = _rss_mb(os.getpid()) - before
        for w in writers:
            w.close()
        srv.close()
    assert grown < 64, f"the server grew by {grown:.0f} MB on headers alone"


_ATTACK = textwrap.dedent("""
    import os, socket, struct, sys
    import msgpack
    os.setgid(65534); os.setuid(65534)  # everything is imported: root's files are unreadable now
    host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    s = socket.socket()
    s.settimeout(10)
    s.connect((host, port))
    data = b""
    while len(data) < 36:  # HELLO + nonce
        data += s.recv(36 - len(data))
    body = msgpack.packb(["rule", ["os:system", [{"command": "touch " + marker}]], {}])
    s.sendall(struct.pack("<IBBHQI", 16 + len(body), 0xE7, 2, 0, 1, len(body)) + body)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    print(data.hex())
""")


@pytest.fixture
def clean_registry(monkeypatch):
    """Registrations made by the test vanish after it (in this process and its env)."""
    monkeypatch.setattr(registry, "_refs", {})
    monkeypatch.setenv(registry.ENV_REFS, "")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to uid 65534")
async def test_another_user_cannot_run_a_command_through_the_reward_rule(tmp_path,
                                                                       clean_registry):
    from earl.stages.reward import RewardActor

    marker = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)  # so that uid 65534 *could* create it, were the call to run
    async with Runtime(RuntimeConfig(tcp=True)) as rt:
        rw = await rt.spawn("reward", RewardActor)
        host, port = _tcp(rw.addresses[0])
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _ATTACK, host, str(port), str(marker),
            stdout=asyncio.subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode == 0
        data = bytes.fromhex(out.decode().strip())  # at most the AUTH frame, then closed
        assert len(data) in (0, 20 + 32) and (not data or HEADER.unpack(data[:20])[2] == Kind.AUTH)
        assert not marker.exists()
        # even with the run's secret, "os:system" never resolves, nor does an unregistered rule
        with pytest.raises(ActorError, match="PermissionError.*never allowed"):
            await rw[0].rule.call_one("os:system", [{"command": f"touch {marker}"}])
        with pytest.raises(ActorError, match="not registered in this run"):
            await rw[0].rule.call_one("earl.envs.arithmetic:score", [])
        with pytest.raises(ActorError, match="not registered in this run"):
            await rw[0].rule.call_one("earl.envs.arithmetic:os.system", [{"command": "true"}])
        assert not marker.exists()


async def test_registered_rules_and_roots_travel_to_actors(tmp_path, clean_registry):
    from earl.stages.reward import RewardActor
    from earl.stages.trainer import TrainerActor

    registry.register("earl.envs.arithmetic:score")
    async with Runtime() as rt:
        rw = await rt.spawn("reward", RewardActor)
        got = await rw[0].rule.call_one("earl.envs.arithmetic:score",
                                        [{"text": "= 12", "answer": 12}])
        assert got == [1.0]
    trainer = TrainerActor.__new__(TrainerActor)  # the path check runs before any model work
    for bad in ("/root/.ssh/x", "/etc/cron.d/x", "/tmp/../etc/x"):
        with pytest.raises(PermissionError, match="outside the run's allowed roots"):
            await trainer.save_hf(bad)
        with pytest.raises(PermissionError, match="allowed roots"):
            await trainer.load_checkpoint(bad)


async def test_the_tool_worker_never_resolves_denied_modules(tmp_path):
    from earl.runtime.tools import ExecutorConfig, ToolExecutor
    from earl.runtime.types import Tool

    marker = tmp_path / "pwned"
    async with ToolExecutor(ExecutorConfig(max_workers=1)) as ex:
        for ref in ("os:system", "subprocess:getoutput", "earl.envs.sim_tools:os.system"):
            tool = Tool(name="t", fn=print, schema={}, ref=ref)
            r = await ex.run(tool, {"command": f"touch {marker}"}, timeout_s=20)
            assert not r.ok and "cannot import tool" in r.output, r
        assert not marker.exists()
