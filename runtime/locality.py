"""Where a process runs: which host (for the transport rule) and which address peers dial.

`host_id()` names the host as shared memory sees it: two processes with the same id can map each
other's `/dev/shm` segments, so the shm transport works between them. It is the kernel's boot id
plus the network namespace and the `/dev/shm` file system a process sees, so two "hosts" made
from namespaces on one machine (tests/hosts.py) count as two hosts, as real machines would.

`node_address()` is the address this process' peers on other hosts dial: `$EARL_NODE_ADDRESS`
(the Ray launcher sets it to the node's IP for every actor it places), else 127.0.0.1.

`$EARL_HOST_ID`, when set, replaces the measured host id: for tests that make two "hosts" of
processes sharing one kernel view (no namespaces), and for setups where namespaces are not
visible (it must then differ between processes that cannot map each other's `/dev/shm`).

Not here: choosing a transport from them (earl.runtime.transport.choose).
"""

from __future__ import annotations

import functools
import os

__all__ = ["ENV_ADDRESS", "ENV_HOST_ID", "host_id", "node_address", "same_host"]

ENV_ADDRESS = "EARL_NODE_ADDRESS"
ENV_HOST_ID = "EARL_HOST_ID"


@functools.cache
def host_id() -> str:
    """This process' host as shared memory sees it (stable for the process' life)."""
    if forced := os.environ.get(ENV_HOST_ID):
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "-"
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    try:
        shm = os.stat("/dev/shm").st_dev
    except OSError:
        shm = 0
    return f"{boot}/{netns}/{shm}"


def node_address() -> str:
    """The address peers on other hosts dial to reach this process."""
    return os.environ.get(ENV_ADDRESS) or "127.0.0.1"


def same_host(a: str, b: str) -> bool:
    """Whether two `host_id()` values name one host (an empty id is never the same)."""
    return bool(a) and a == b
