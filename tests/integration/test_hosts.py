"""Namespace hosts (tests/hosts.py): two hosts reach each other only over their own addresses,
each has its own /dev/shm and /tmp (so `earl.runtime.locality.host_id()` tells them apart), and
nothing is left behind."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hosts import hosts, unavailable

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

PY = sys.executable
SERVE = """
import socket, sys
s = socket.socket(); s.bind((sys.argv[1], 0)); s.listen()
print(s.getsockname()[1], flush=True)
c, peer = s.accept(); c.sendall(c.recv(64) + b" from " + peer[0].encode()); c.close()
"""
DIAL = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
c.sendall(b"hello"); print(c.recv(128).decode())
"""
HOST_ID = "from earl.runtime.locality import host_id; print(host_id())"


def _talk(server, client) -> str:
    srv = server.popen([PY, "-c", SERVE, server.address], stdout=subprocess.PIPE, text=True)
    port = srv.stdout.readline().strip()
    out = client.run([PY, "-c", DIAL, server.address, port], check=True).stdout.strip()
    assert srv.wait(10) == 0
    return out


def _ok(h, argv: list[str]) -> str:
    p = h.run(argv)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def _names_left() -> tuple[str, str]:
    """The machine's network namespaces and links, as `ip` lists them."""
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout,
            subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                           check=True).stdout)


def test_two_hosts_are_two_machines(tmp_path: Path) -> None:
    (tmp_path / "shared.txt").write_text("both see this")
    with hosts(2, "eht", share=[tmp_path]) as (a, b):
        assert (a.address, b.address) == ("10.213.0.1", "10.213.0.2")
        # TCP both ways over the private addresses, each side seeing the other's address
        assert _talk(a, b) == f"hello from {b.address}"
        assert _talk(b, a) == f"hello from {a.address}"
        # no way out: no default route, the loopback of one host is not the other's
        assert "default" not in _ok(a, ["ip", "route"])
        lo = a.popen([PY, "-c", SERVE, "127.0.0.1"], stdout=subprocess.PIPE, text=True)
        refused = b.run([PY, "-c", DIAL, "127.0.0.1", lo.stdout.readline().strip()])
        assert refused.returncode != 0 and "ConnectionRefused" in refused.stderr
        lo.kill()
        # /dev/shm and /tmp are per host, shared by every process on that host
        _ok(a, ["sh", "-c", "echo a > /dev/shm/earl-hosts-probe; echo a > /tmp/earl-probe"])
        assert _ok(a, ["cat", "/dev/shm/earl-hosts-probe", "/tmp/earl-probe"]) == "a\na"
        for path in ("/dev/shm/earl-hosts-probe", "/tmp/earl-probe"):
            assert b.run(["cat", path]).returncode != 0
            assert not Path(path).exists()  # nor in the machine's own
        assert _ok(b, ["cat", str(tmp_path / "shared.txt")]) == "both see this"
        # so host_id tells the hosts apart, and is one id for every process of a host
        ids_a = {_ok(a, [PY, "-c", HOST_ID]) for _ in range(2)}
        id_b = _ok(b, [PY, "-c", HOST_ID])
        assert len(ids_a) == 1 and id_b not in ids_a
        left_running = a.popen(["sleep", "600"])  # killed by the cleanup
        names = [a.netns, b.netns]
    assert left_running.poll() is not None
    netns, links = _names_left()
    base = names[0][:-2]  # "eht<pid>g<seq>": every name of this run starts with it
    assert base not in netns and base not in links


def test_cleanup_when_the_body_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), hosts(1, "eht") as (a,):
        base = a.netns[:-2]
        a.popen(["sleep", "600"])
        raise RuntimeError("boom")
    netns, links = _names_left()
    assert base not in netns and base not in links
