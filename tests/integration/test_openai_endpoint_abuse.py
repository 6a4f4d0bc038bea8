"""The OpenAI endpoint under abuse, over real loopback sockets on SimEngine.

Its port is reachable by every local user, so the attacks that need no key run in a child
process that drops to uid/gid 65534 (nobody) before it opens a socket: a flood of half-sent
requests against an endpoint process with a low open-file limit, and one half-sent request.
The key holder's abuse is a request past the limits and a very large request, which must not
stop the other sessions' small requests from being answered.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import resource
import subprocess
import sys
from urllib.parse import urlsplit

import aiohttp
import pytest
from recording import Recorder

from earl.agents.calc import tool_sim_responder
from earl.agents.chat import ChatCodec
from earl.agents.openai_calc import MODEL, TOOLS
from earl.agents.openai_server import EndpointConfig, OpenAIEndpoint
from earl.agents.rollout import run_agent
from earl.engine import SimConfig, SimEngine
from earl.models.tiny import build_tokenizer

pytestmark = pytest.mark.timeout(120)

as_nobody = pytest.mark.skipif(os.geteuid() != 0, reason="attacks as another local user "
                               "(uid 65534), which needs root to switch to")

# Imports first, then drop to nobody (who cannot read the interpreter's files under /root).
# `hold N`: keep N half-sent requests open, redialling each one the server closes, until stdin
# closes; print "ready" once N are connected (or after 5 s), and the counts at the end.
# `once`: one half-sent request; print "closed" when the server closes it, "open" after 60 s.
ATTACKER = r"""
import json, os, selectors, socket, sys, time
port, mode, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.setgroups([]); os.setgid(65534); os.setuid(65534)
assert os.getuid() == 65534 and os.getgid() == 65534
HALF = b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n"
sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ)
counts = {"connected": 0, "closed_by_server": 0}

def dial():
    s = socket.socket()
    s.setblocking(False)
    s.connect_ex(("127.0.0.1", port))
    sel.register(s, selectors.EVENT_WRITE)

def hang_up(s):
    sel.unregister(s)
    s.close()
    if mode == "once":
        print("closed", flush=True)
        sys.exit(0)
    dial()

for _ in range(n):
    dial()
start, ready = time.monotonic(), False
while True:
    for key, _ in sel.select(1.0):
        s = key.fileobj
        if s == 0:
            if not os.read(0, 1):
                print(json.dumps(counts), flush=True)
                sys.exit(0)
            continue
        if key.events == selectors.EVENT_WRITE:
            try:
                if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                    raise OSError("connect failed")
                s.send(HALF)
            except OSError:
                sel.unregister(s); s.close(); dial()
                continue
            counts["connected"] += 1
            sel.modify(s, selectors.EVENT_READ)
        else:
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:
                counts["closed_by_server"] += 1
                hang_up(s)
    if mode == "once" and time.monotonic() - start > 60:
        print("open", flush=True)
        sys.exit(0)
    if mode == "hold" and not ready and (counts["connected"] >= n or time.monotonic() - start > 5):
        ready = True
        print("ready", flush=True)
"""

# An endpoint process with a low open-file limit (argv[1]) and default settings, serving one
# session until stdin closes; prints the session's base_url and key.
SERVER = r"""
import asyncio, json, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE,
                   (int(sys.argv[1]), resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from earl.agents.calc import tool_sim_responder
from earl.agents.chat import ChatCodec
from earl.agents.openai_server import OpenAIEndpoint
from earl.agents.rollout import run_agent
from earl.engine import SimConfig, SimEngine
from earl.models.tiny import build_tokenizer

async def main():
    codec = ChatCodec(build_tokenizer())
    engine = SimEngine(SimConfig(time_scale=0.0), responder=tool_sim_responder(codec))

    async def agent(rollout, sample):
        print(json.dumps({"base_url": rollout.base_url, "api_key": rollout.api_key}), flush=True)
        await asyncio.to_thread(sys.stdin.read)
        return 0.0

    async with OpenAIEndpoint() as ep:
        await run_agent(agent, None, engine=engine, codec=codec, endpoint=ep)

asyncio.run(main())
"""


def attacker(port: int, mode: str, n: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-I", "-c", ATTACKER, str(port), mode, str(n)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def small_body(text: str = "What is 2 times 3?") -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()


def post(conn: http.client.HTTPConnection, path: str, key: str, body: bytes) -> tuple[int, dict]:
    conn.request("POST", path, body, {"Authorization": f"Bearer {key}",
                                      "Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, json.loads(resp.read())


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def sim(codec: ChatCodec) -> Recorder:
    return Recorder(SimEngine(SimConfig(time_scale=0.0), responder=tool_sim_responder(codec)))


@as_nobody
@pytest.mark.timeout(240)
def test_a_flood_of_half_sent_requests_does_not_keep_the_key_holder_out() -> None:
    # The endpoint process may open 1024 files; the attacker holds 3000 half-sent requests.
    server = subprocess.Popen([sys.executable, "-c", SERVER, "1024"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    attack = None
    try:
        assert server.stdout is not None
        info = json.loads(server.stdout.readline())
        url = urlsplit(info["base_url"] + "/chat/completions")
        assert url.port is not None
        before = http.client.HTTPConnection("127.0.0.1", url.port, timeout=30)
        assert post(before, url.path, info["api_key"], small_body())[0] == 200
        attack = attacker(url.port, "hold", 3000)
        assert attack.stdout is not None and attack.stdout.readline() == "ready\n"
        for k in range(3):  # each on a new connection, made while the flood goes on
            fresh = http.client.HTTPConnection("127.0.0.1", url.port, timeout=30)
            status, body = post(fresh, url.path, info["api_key"], small_body(f"{k} times 4?"))
            fresh.close()
            assert status == 200, body
            assert body["choices"][0]["finish_reason"] in ("stop", "tool_calls")
        # a connection that had sent the key before the flood is never the one closed
        assert post(before, url.path, info["api_key"], small_body())[0] == 200
        before.close()
        assert attack.poll() is None  # the flood is still on
        out, _ = attack.communicate(timeout=30)
        counts = json.loads(out.splitlines()[-1])
        assert counts["connected"] >= 3000 and counts["closed_by_server"] > 0
    finally:
        for proc in (attack, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()


@as_nobody
async def test_half_sent_requests_are_closed_after_the_read_timeout(codec) -> None:
    statuses: list[str] = []
    stats = []

    async def agent(rollout, sample) -> float:
        url = urlsplit(rollout.base_url + "/chat/completions")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-c", ATTACKER, str(url.port), "once", "1",
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        out, _ = await asyncio.wait_for(proc.communicate(), 90)
        statuses.append(out.decode().strip())
        stats.append(ep.statistics())
        # the key holder's body that stops halfway: 408, then the connection closes
        reader, writer = await asyncio.open_connection("127.0.0.1", url.port)
        writer.write(f"POST {url.path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
                     f"{rollout.api_key}\r\nContent-Length: 100\r\n\r\n{{\"model\"".encode())
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        statuses.append(head.split()[1].decode())
        await asyncio.wait_for(reader.read(), 30)  # returns at EOF
        statuses.append("closed" if reader.at_eof() else "open")
        writer.close()
        return 0.0

    async with OpenAIEndpoint() as ep:  # read_timeout_s=5 by default
        t = await run_agent(agent, None, engine=sim(codec), codec=codec, endpoint=ep)
    assert statuses == ["closed", "408", "closed"]
    assert not t.failed, t.error
    assert stats[0].closed_untrusted == 1 and stats[0].untrusted == 0


async def test_requests_past_the_limits_get_a_400_naming_the_field(codec) -> None:
    errors: list[tuple[int, str, str]] = []
    tool = TOOLS[0]

    async def agent(rollout, sample) -> float:
        url = rollout.base_url + "/chat/completions"
        auth = {"Authorization": f"Bearer {rollout.api_key}"}
        one = [{"role": "user", "content": "What is 2 times 2?"}]
        bad = [
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 4097},
            {"model": MODEL, "messages": one, "tools": [
                {**tool, "function": {**tool["function"], "name": f"t{i}"}}  # type: ignore[dict-item]
                for i in range(129)]},
            {"model": MODEL, "messages": [{"role": "user", "content": "x" * (1 << 21)}] * 3},
            {"model": MODEL, "messages": one, "tools": [
                {**tool, "function": {**tool["function"], "description": "d" * (1 << 22)}}]},  # type: ignore[dict-item]
        ]
        async with aiohttp.ClientSession() as http:
            for body in bad:
                async with http.post(url, json=body, headers=auth) as resp:
                    err = (await resp.json())["error"]
                    errors.append((resp.status, err["param"], err["message"]))
            async with http.post(url, json={"model": MODEL, "messages": one, "tools": TOOLS},
                                 headers=auth) as resp:
                assert resp.status == 200, await resp.text()
        return 0.0

    async with OpenAIEndpoint(EndpointConfig(model=MODEL)) as ep:
        t = await run_agent(agent, None, engine=sim(codec), codec=codec, endpoint=ep)
    assert not t.failed, t.error
    assert [e[:2] for e in errors] == [(400, "messages"), (400, "tools"), (400, "messages"),
                                      (400, "tools")]
    assert "4097 entries" in errors[0][2] and "EndpointConfig.max_messages" in errors[0][2]
    assert "129 entries" in errors[1][2] and "EndpointConfig.max_tools" in errors[1][2]
    assert all("EndpointConfig.max_chars" in e[2] for e in errors[2:])
    assert t.info["requests"] == 1  # the refused requests left no trace


async def test_a_large_request_does_not_hold_up_other_sessions(codec) -> None:
    # A codec of its own, past its first texts: ChatCodec checks those against one whole-text
    # tokenizer call, which holds the GIL for as long as the text is long.
    codec = ChatCodec(build_tokenizer())
    for i in range(16):
        codec.encode_text(f"warm-up {i}")
    sent, done = asyncio.Event(), []
    # ~3.5 MB: 3500 messages within the limits, rendered and tokenized in the worker thread
    big = json.dumps({"model": MODEL, "messages": [
        {"role": "user", "content": f"{i}: " + "lorem ipsum " * 80} for i in range(3500)]})

    async def large(rollout, sample) -> float:
        url = urlsplit(rollout.base_url + "/chat/completions")
        reader, writer = await asyncio.open_connection("127.0.0.1", url.port)
        writer.write(f"POST {url.path} HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer "
                     f"{rollout.api_key}\r\nContent-Length: {len(big)}\r\n\r\n{big}".encode())
        await writer.drain()
        sent.set()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 90)
        done.append(("large", head.split()[1].decode()))
        writer.close()
        return 0.0

    async def small(rollout, sample) -> float:
        await asyncio.wait_for(sent.wait(), 30)
        await asyncio.sleep(0.5)  # so that the large request is being worked on
        async with aiohttp.ClientSession() as http, http.post(
                rollout.base_url + "/chat/completions", data=small_body(),
                headers={"Authorization": f"Bearer {rollout.api_key}"}) as resp:
            done.append(("small", str(resp.status)))
        return 0.0

    async with OpenAIEndpoint() as ep:
        trajs = await asyncio.gather(
            run_agent(large, None, engine=sim(codec), codec=codec, endpoint=ep, sample_id="l"),
            run_agent(small, None, engine=sim(codec), codec=codec, endpoint=ep, sample_id="s"))
    assert not any(t.failed for t in trajs), [t.error for t in trajs]
    # small answered first; large refused by the engine only after it was fully rendered
    assert done == [("small", "200"), ("large", "400")]


async def test_a_connection_cap_that_leaves_no_files_for_the_process_is_refused() -> None:
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no open-file limit to stay under")
    with pytest.raises(ValueError, match=r"EndpointConfig.max_connections=.*ulimit -n"):
        async with OpenAIEndpoint(EndpointConfig(max_connections=soft)):
            pass
    with pytest.raises(ValueError, match="EndpointConfig.read_timeout_s must be > 0"):
        EndpointConfig(read_timeout_s=0)
