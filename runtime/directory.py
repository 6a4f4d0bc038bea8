"""The address directory: which actor groups exist, where each rank listens, and its state.

The root runtime (the driver's `Runtime`) holds the one `Directory` in memory and serves it on
its own socket; actor processes reach it over the same RPC (their `context().lookup(...)`).
It is a control path only: calls between actors never go through it. Supervisors write each
rank's state here (`up`, `restarting`, `dead`, restart count), so a handle whose actor was
restarted finds the new address on its next call.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field

from earl.runtime.endpoint import endpoint
from earl.runtime.wire import message

UP, RESTARTING, DEAD = "up", "restarting", "dead"


@message
@dataclass(kw_only=True, slots=True)
class GroupRecord:
    """One actor group as the directory knows it."""

    name: str
    cls_name: str
    endpoints: dict[str, bool]
    addresses: list[str]
    pids: list[int]
    status: list[str]
    restarts: list[int]
    reasons: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.addresses)
        if not (len(self.pids) == len(self.status) == len(self.restarts) == n):
            raise ValueError("GroupRecord fields addresses/pids/status/restarts differ in length")
        if not self.reasons:
            self.reasons = [""] * n


def _check_timeout(timeout: float) -> None:
    if math.isnan(timeout):  # a timer at NaN o'clock would corrupt the event loop's heap
        raise ValueError("timeout must be a number of seconds, got NaN")


class Directory:
    """In-memory directory, served over RPC by the root runtime."""

    def __init__(self) -> None:
        self.groups: dict[str, GroupRecord] = {}
        self._changed = asyncio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    @endpoint
    async def publish(self, record: GroupRecord) -> None:
        """Add a new group. Raises ValueError if a live group already has that name."""
        old = self.groups.get(record.name)
        if old is not None and any(s != DEAD for s in old.status):
            raise ValueError(f"an actor group named {record.name!r} already exists: stop it or"
                             " pick another name")
        self.groups[record.name] = record
        self._notify()

    @endpoint
    async def update(self, name: str, rank: int, status: str, address: str = "", pid: int = 0,
                     reason: str = "") -> None:
        """Record a rank's new state (and address/pid after a restart)."""
        rec = self.groups[name]
        rec.status[rank] = status
        rec.reasons[rank] = reason
        if status == UP:
            rec.addresses[rank] = address
            rec.pids[rank] = pid
        if status == RESTARTING:
            rec.restarts[rank] += 1
        self._notify()

    @endpoint
    async def resize(self, name: str, n: int, addresses: list[str], pids: list[int]) -> None:
        """A live group now has `n` ranks: those below the old count keep their record, the
        new ones are up at `addresses` / `pids` (one each)."""
        rec = self.groups[name]
        keep = min(n, len(rec.addresses))
        if len(addresses) != n - keep or len(pids) != n - keep:
            raise ValueError(f"resize {name!r} to {n}: {n - keep} new rank(s), got "
                             f"{len(addresses)} address(es) and {len(pids)} pid(s)")
        rec.addresses[keep:] = list(addresses)
        rec.pids[keep:] = list(pids)
        rec.status[keep:] = [UP] * (n - keep)
        rec.restarts[keep:] = [0] * (n - keep)
        rec.reasons[keep:] = [""] * (n - keep)
        self._notify()

    @endpoint
    async def remove(self, name: str) -> None:
        self.groups.pop(name, None)
        self._notify()

    @endpoint
    async def lookup(self, name: str, timeout: float = 0.0) -> GroupRecord | None:
        """The record for `name`, waiting up to `timeout` seconds for it to be published."""
        _check_timeout(timeout)
        if name not in self.groups:
            try:  # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancellation
                async with asyncio.timeout(timeout):
                    while name not in self.groups:
                        await self._changed.wait()
            except TimeoutError:
                return None
        return self.groups[name]

    @endpoint
    async def wait_status(self, name: str, rank: int, status: str, timeout: float,
                          min_restarts: int = 0) -> bool:
        """Wait until rank `rank` of `name` is in `status` after at least `min_restarts`
        restarts; False on timeout."""
        _check_timeout(timeout)

        def reached() -> bool:
            rec = self.groups.get(name)
            return rec is not None and rank < len(rec.status) and rec.status[rank] == status \
                and rec.restarts[rank] >= min_restarts

        # asyncio.timeout, not wait_for: in 3.11 a wait_for whose event fires as its task is
        # cancelled returns normally, and this loop would then wait again (a run's healer hung
        # in it after a rewind)
        try:
            async with asyncio.timeout(timeout):
                while not reached():
                    await self._changed.wait()
        except TimeoutError:
            return False
        return True

    @endpoint
    async def names(self) -> list[str]:
        return sorted(self.groups)
