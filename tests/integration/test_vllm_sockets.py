"""What a rollout actor's vLLM listens on (docs/security/vllm-sockets.md): a one-worker engine
opens no TCP port at all; tensor-parallel workers keep gloo's ports, on loopback only, their
ipc sockets sit in private directories, and connections from another user do not stop them."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator

import psutil
import pytest
import pytest_asyncio

from earl.engine import SamplingParams
from earl.models.tiny import default_model_dir
from earl.stages.compute import Compute

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"),
              pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
MODEL = {"init_std": 0.2, "seed": 0}
GLOO_PORTS_PER_WORKER = 13  # vLLM 0.32: the default group + a device and a CPU group x 6
# Runs as another user (nobody) when the test runs as root: connects to every port, sends
# 8 bytes (what gloo reads as a peer's sequence number) or nothing, and hangs up.
PROBE = r"""
import encodings.idna, os, socket, sys
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
for port in map(int, sys.argv[1:]):
    for payload in (b"", b"\xff" * 8, b"\x00" * 8):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(payload)
        s.close()
print(os.getuid())
"""


def tcp_listeners(pid: int) -> list[tuple[int, str, int]]:
    """(owner pid, address, port) of every listening TCP socket of `pid` and its children."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return sorted((p.pid, c.laddr.ip, c.laddr.port) for p in procs
                  for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN)


def assert_unix_sockets_private(pid: int) -> None:
    """Every named unix socket of the tree (the actor's RPC socket, vLLM's ipc message queues)
    sits in a directory that other users cannot enter."""
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    dirs = {os.path.dirname(c.laddr) for p in procs for c in p.net_connections("unix")
            if c.laddr and not c.laddr.startswith("\0")}
    for d in dirs:
        mode = stat.S_IMODE(os.stat(d).st_mode)
        assert mode & 0o077 == 0, f"{d} holds sockets and is open to other users: {oct(mode)}"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rt() -> AsyncIterator[object]:
    from earl.runtime import Runtime

    async with Runtime() as runtime:
        yield runtime


async def spawn(rt, name: str, tp: int) -> tuple[object, int]:
    from earl.stages.rollout import RolloutActor
    from earl.stages.vllm_engine import EngineConfig

    cfg = EngineConfig(model=str(default_model_dir(**MODEL)), compute=Compute(dtype="float32"),
                       max_model_len=256, kv_cache_gb=0.125, tensor_parallel_size=tp)
    g = await rt.spawn(name, RolloutActor, cfg, env={"OMP_NUM_THREADS": "1"})
    return g, (await rt.dir_call("lookup", name)).pids[0]


async def test_one_worker_opens_no_tcp_port(rt) -> None:
    g, pid = await spawn(rt, "solo", tp=1)
    first = await g[0].generate.call_one([1, 50, 51], GREEDY)
    await g[0].update_weights_from_path.call_one(str(default_model_dir(**MODEL)), 1)
    again = await g[0].generate.call_one([1, 50, 51], GREEDY)
    assert len(first.token_ids) == 8 and again.token_ids == first.token_ids
    assert again.versions == [1] * 8
    assert tcp_listeners(pid) == []  # was 13 gloo listeners any local user could exhaust
    assert_unix_sockets_private(pid)
    await rt.stop(g)


async def test_tensor_parallel_workers_listen_on_loopback_only(rt) -> None:
    g, pid = await spawn(rt, "tp2", tp=2)
    before = await g[0].generate.call_one([1, 50, 51], GREEDY)
    found = tcp_listeners(pid)
    workers = [p.pid for p in psutil.Process(pid).children(recursive=True)
               if p.name().startswith("VLLM::Worker")]
    assert len(workers) == 2  # and the actor process itself listens on nothing:
    assert Counter(owner for owner, _, _ in found) == dict.fromkeys(workers,
                                                                    GLOO_PORTS_PER_WORKER)
    assert {ip for _, ip, _ in found} == {"127.0.0.1"}
    assert_unix_sockets_private(pid)

    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-c", PROBE, *(str(p) for _, _, p in found)],
        capture_output=True, text=True, timeout=60, check=True)
    if os.geteuid() == 0:
        assert int(out.stdout) == 65534
    after = await g[0].generate.call_one([1, 50, 51], GREEDY)
    assert after.token_ids == before.token_ids
    assert tcp_listeners(pid) == found  # the workers are the same processes
    await rt.stop(g)
