"""Several "hosts" on this one machine, made from Linux namespaces, for tests and benches.

Each host has its own network namespace (`ip netns add`), joined to the others by a veth pair to
a bridge in the root namespace, with its own private address (10.213.0.1, .2, ... /24; `lo` up;
no default route, no NAT: nothing it binds is reachable from outside the bridge), and its own
mount namespace with a private tmpfs on `/dev/shm` and on `/tmp`. A holder process
(`unshare --mount --propagation private` ... `sleep infinity`) keeps that mount namespace alive,
so every process started on the host (`Host.popen`, `Host.run`: `nsenter --target HOLDER
--mount --net`) sees the same `/dev/shm` and `/tmp`, and no other host's. Paths outside `/tmp`
are the machine's own and shared by all hosts; paths under `/tmp` named in `share` are
bind-mounted into every host at the same path (e.g. pytest's `tmp_path`), and so are those a
process on a host needs to run this Python and import this checkout (`own_paths()`: the
checkout, the virtual environment, the interpreter, the working directory and `sys.path`), so a
checkout and its venv may live under `/tmp` too.

    with hosts(2) as (a, b):
        b.run(["python", "-c", "..."], env=...)   # runs in host b's namespaces

`ray_cluster(hosts)` starts a real Ray cluster over them: the head on the first host, a worker
node on each other, each node with a custom resource naming its host (`Host.resource`).

Everything is removed on exit, the body raising or not: the processes in each namespace are
killed, the namespaces, veths and the bridge deleted. Names carry the creating process' pid, so
concurrent runs do not collide and a later run removes what a killed one left (`sweep`).
Needs root, `ip`, `unshare` and `nsenter`; `unavailable()` says why not where they are missing.

Not here: cgroup shares of the cores (see `earl.runtime.slots`), anything about earl itself.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

from earl.runtime.cleanup import pid_alive

__all__ = ["Host", "RayCluster", "hosts", "own_paths", "ray_cluster", "sweep", "unavailable"]

SUBNET = "10.213.0"  # host i (from 0) gets SUBNET.{i+1}/24
RAY_PORT = 6379  # the head's GCS port, in the head host's own network namespace
_MAX_PREFIX = 4  # interface names are at most 15 bytes: PREFIX + pid + 'g' + seq + kind + i
_seq = count()

# The holder: a fresh tmpfs is mounted on /dev/shm first, the shared paths of the old /tmp are
# bound into it, it is moved onto /tmp, then /dev/shm gets its own tmpfs. So no staging
# directory of the real file system is touched.
_HOLDER = """set -e
mount -t tmpfs -o mode=1777 earl-host-tmp /dev/shm
for p in "$@"; do mkdir -p "/dev/shm/${p#/tmp/}"; mount --bind "$p" "/dev/shm/${p#/tmp/}"; done
mount --move /dev/shm /tmp
mount -t tmpfs -o mode=1777 earl-host-shm /dev/shm
echo ready
exec sleep infinity
"""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({p.returncode}): {p.stderr.strip()}")
    return p


@functools.cache
def unavailable() -> str | None:
    """Why hosts cannot be made here (a reason for `pytest.skip`), or None when they can."""
    if sys.platform != "linux":
        return f"namespace hosts need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return "namespace hosts need root (ip netns, unshare --mount, nsenter)"
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"namespace hosts need `{tool}` on PATH"
    probe = f"ehprobe{os.getpid():x}"
    p = _ip("netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"`ip netns add` refused: {p.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"],
                       capture_output=True, text=True, timeout=30, check=False)
    if p.returncode != 0:
        return f"`unshare --mount` refused: {p.stderr.strip()}"
    return None


@dataclass(eq=False)
class Host:
    """One namespace host: its name ("a", "b", ...), its address, and how to run on it."""

    name: str
    address: str
    netns: str
    holder: subprocess.Popen[str]
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def resource(self) -> str:
        """The Ray custom resource `ray_cluster` gives this host's node (`earl_host_a`)."""
        return f"earl_host_{self.name}"

    def argv(self, argv: Sequence[str], cwd: str | None = None) -> list[str]:
        """`argv` wrapped to run in this host's namespaces (working directory `cwd`, default
        this process' own: nsenter would otherwise start in /)."""
        return ["nsenter", f"--target={self.holder.pid}", "--mount", "--net",
                f"--wd={cwd or os.getcwd()}", "--", *argv]

    def popen(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: str | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` on this host (killed, if still running, when the hosts are removed).
        `kwargs` go to `subprocess.Popen`."""
        p = subprocess.Popen(self.argv(argv, cwd), env=dict(env or os.environ), **kwargs)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            cwd: str | None = None, timeout: float = 120.0,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to completion; text output captured.

        Raises:
            subprocess.TimeoutExpired: it ran longer than `timeout` s (it is killed).
            subprocess.CalledProcessError: `check` and a non-zero exit.
        """
        return subprocess.run(self.argv(argv, cwd), env=dict(env or os.environ),
                              capture_output=True, text=True, timeout=timeout, check=check)


def own_paths() -> list[str]:
    """The directories under /tmp that a process on a host needs to run this interpreter and
    import this checkout: the checkout (this file's repository), the virtual environment and the
    interpreter it was made from, the working directory and the folders on `sys.path`; each
    resolved, without one that another contains. Usually empty (nothing of it under /tmp)."""
    wanted = [Path(__file__).resolve().parents[1], Path(sys.prefix), Path(sys.base_prefix),
              Path(sys.executable).resolve().parent, Path.cwd(), *map(Path, sys.path)]
    under = sorted({str(p.resolve()) for p in wanted
                    if str(p.resolve()).startswith("/tmp/") and p.is_dir()})
    return [p for p in under if not any(p.startswith(q + "/") for q in under)]


def _names(prefix: str) -> str:
    if not re.fullmatch(r"[a-z]{1,4}", prefix):
        raise ValueError(f"hosts(prefix={prefix!r}): use 1 to {_MAX_PREFIX} lowercase letters "
                         "(interface names are limited to 15 bytes)")
    return f"{prefix}{os.getpid():x}g{next(_seq) % 10}"


def _keep(h: Host) -> set[int]:
    """The holder and the processes the caller started on `h` (and their children)."""
    import psutil

    keep = {h.holder.pid}
    for p in h.procs:
        keep.add(p.pid)
        try:
            keep.update(c.pid for c in psutil.Process(p.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass
    return keep


def _kill_netns(netns: str, keep: Collection[int] = ()) -> None:
    """SIGKILL every process in network namespace `netns` (but `keep`) and wait until they are
    gone."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = [int(x) for x in _ip("netns", "pids", netns, check=False).stdout.split()]
        alive = [p for p in pids if p not in keep and _state(p) != "Z"]
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "Z"


def sweep(prefix: str = "eh") -> list[str]:
    """Remove namespaces, veths and bridges of `prefix` whose creating process is gone (left by
    a killed run). Returns the names removed."""
    pat = re.compile(rf"^{re.escape(prefix)}([0-9a-f]+)g\d[nvb]\d*$")
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        m = pat.match(name)
        if m and not pid_alive(int(m.group(1), 16)):
            _kill_netns(name)
            _ip("netns", "del", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
        m = pat.match(name)
        if m and not pid_alive(int(m.group(1), 16)):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _make_host(i: int, base: str, bridge: str, share: Sequence[str]) -> Host:
    netns, veth, address = f"{base}n{i}", f"{base}v{i}", f"{SUBNET}.{i + 1}"
    _ip("netns", "add", netns)
    _ip("link", "add", veth, "type", "veth", "peer", "name", f"{base}p{i}")
    _ip("link", "set", f"{base}p{i}", "netns", netns)
    _ip("-n", netns, "link", "set", f"{base}p{i}", "name", "eth0")
    _ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
    _ip("-n", netns, "link", "set", "eth0", "up")
    _ip("-n", netns, "link", "set", "lo", "up")
    _ip("link", "set", veth, "master", bridge)
    _ip("link", "set", veth, "up")
    holder = subprocess.Popen(
        ["ip", "netns", "exec", netns, "unshare", "--mount", "--propagation", "private", "--",
         "sh", "-c", _HOLDER, "holder", *share],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "ready":
        holder.kill()
        _, err = holder.communicate(timeout=10)
        raise RuntimeError(f"host {netns}: its mount namespace could not be set up: {err}")
    return Host(name=chr(ord("a") + i), address=address, netns=netns, holder=holder)


def _remove_host(h: Host) -> None:
    for p in h.procs:
        if p.poll() is None:
            p.kill()
    _kill_netns(h.netns)
    h.holder.kill()
    for p in [*h.procs, h.holder]:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass
    _ip("netns", "del", h.netns, check=False)


@contextmanager
def hosts(n: int = 2, prefix: str = "eh", *, share: Sequence[str | Path] = ()) -> Iterator[
        list[Host]]:
    """Make `n` namespace hosts ("a", "b", ... at 10.213.0.1, .2, ...); remove them on exit.

    Args:
        n: how many (1 to 99).
        prefix: 1-4 lowercase letters starting every namespace and interface name; stale ones
            of the same prefix (their creating process is gone) are removed first.
        share: directories under /tmp to bind into every host at the same path (the rest of
            each host's /tmp is its own). Paths outside /tmp are shared anyway, and so are
            `own_paths()` (the checkout, its venv, the working directory).

    Raises:
        RuntimeError: hosts cannot be made here (`unavailable()` says why) or a step failed.
    """
    why = unavailable()
    if why is not None:
        raise RuntimeError(why)
    if not 1 <= n <= 99:
        raise ValueError(f"hosts(n={n}): make 1 to 99 hosts")
    shared = [str(Path(p).resolve()) for p in share]
    for p in shared:
        if not p.startswith("/tmp/") or not os.path.isdir(p):
            raise ValueError(f"hosts(share=...): {p!r} is not a directory under /tmp; paths "
                             "outside /tmp are shared by all hosts already")
    # a folder inside another is bound with it (binding it again would mkdir in the real one)
    shared = sorted(set(shared) | set(own_paths()))
    shared = [p for p in shared if not any(p.startswith(q + "/") for q in shared)]
    base = _names(prefix)
    sweep(prefix)
    bridge = f"{base}b"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(n):
            made.append(_make_host(i, base, bridge, shared))
        yield made
    finally:
        for h in made:
            _remove_host(h)
        for i in range(n):  # a host that failed half-way
            _ip("netns", "del", f"{base}n{i}", check=False)
            _ip("link", "del", f"{base}v{i}", check=False)
        _ip("link", "del", bridge, check=False)


# ---- Ray over the hosts -------------------------------------------------------------------
@dataclass(frozen=True)
class RayCluster:
    """A running Ray cluster over namespace hosts: the head on `hosts[0]`."""

    hosts: list[Host]
    address: str  # "HEAD:PORT", for RAY_ADDRESS / `ray start --address`
    env: dict[str, str]  # what a driver on a host needs (RAY_ADDRESS, HOME, usage stats off)


def _ray_exe() -> str:
    return str(Path(sys.executable).with_name("ray"))


def _ray_env(base: Mapping[str, str] | None) -> dict[str, str]:
    # HOME and Ray's temp dir fall in the host's own /tmp: private to the host, and gone with it
    env = {**(base or os.environ), "HOME": "/tmp/earl-ray-home", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    return env


def _ray(h: Host, args: Sequence[str], env: dict[str, str]) -> None:
    p = h.run([_ray_exe(), *args], env=env, timeout=180)
    if p.returncode != 0:
        raise RuntimeError(f"`ray {' '.join(args)}` on host {h.name} failed ({p.returncode}):\n"
                           f"{p.stdout[-2000:]}\n{p.stderr[-2000:]}")


@contextmanager
def ray_cluster(on: Sequence[Host], *, num_cpus: int = 4, port: int = RAY_PORT,
                env: Mapping[str, str] | None = None) -> Iterator[RayCluster]:
    """Start a real Ray cluster: `ray start --head` on `on[0]`, a worker node on each other
    host, each node at its host's address with `{Host.resource: 100}` and `num_cpus` CPUs;
    `ray stop --force` on every host at exit.

    Run a driver on a host with `host.popen(argv, env=cluster.env)` (RAY_ADDRESS set).
    """
    renv = _ray_env(env)
    head = on[0]
    address = f"{head.address}:{port}"
    common = [f"--num-cpus={num_cpus}", "--disable-usage-stats"]
    started: list[Host] = []
    try:
        started.append(head)
        _ray(head, ["start", "--head", f"--port={port}", f"--node-ip-address={head.address}",
                    "--include-dashboard=false", f"--resources={json.dumps({head.resource: 100})}",
                    *common], renv)
        for h in on[1:]:
            started.append(h)
            _ray(h, ["start", f"--address={address}", f"--node-ip-address={h.address}",
                     f"--resources={json.dumps({h.resource: 100})}", *common], renv)
        yield RayCluster(hosts=list(on), address=address, env={**renv, "RAY_ADDRESS": address})
    finally:
        # Not `ray stop --force`: the hosts share the machine's pid namespace, so it would stop
        # every Ray on the machine (other runs' too). Ray's processes on a host are exactly the
        # processes in its network namespace, bar the holder and what the caller started.
        for h in reversed(started):
            _kill_netns(h.netns, keep=_keep(h))
