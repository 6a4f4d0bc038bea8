"""A producer's open senders, one per consumer address, closed once unused for a while.

A consumer's receiver has an address of its own process: a consumer that dies (or is restarted,
or moves) never uses its old address again. Its sender would otherwise stay open forever, and
with it every frame the dead receiver never released: for an arena frame, a whole 16 MiB
shared-memory segment the producer can never reuse. Closing an idle sender gives those frames
back as orphans (the arena retires their segments once empty; a live receiver that still holds
one keeps reading its mapping) and drops its own pool. A live consumer that was only idle gets
a fresh sender on its next fetch.

Not here: what a sender does (runtime/transport/shm.py and the other transports).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from earl.runtime.transport.base import Sender

__all__ = ["IDLE_S", "SenderCache"]

IDLE_S = 120.0  # a sender unused this long is closed


@dataclass
class _Entry:
    sender: Sender
    used: float
    lock: threading.Lock = field(default_factory=threading.Lock)


class SenderCache:
    """Senders by address, made by `open_sender` on first use.

    Args:
        open_sender: makes a sender for an address.
        idle_s: a sender unused this long is closed at the next `lease`.
        clock: seconds (monotonic); a test's clock in unit tests.
    """

    def __init__(self, open_sender: Callable[[str], Sender], *, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._open, self.idle_s, self._clock = open_sender, idle_s, clock
        self._entries: dict[str, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def lease(self, address: str) -> tuple[Sender, threading.Lock]:
        """The sender to `address` and the lock its sends take turns on (senders are
        single-threaded); first closes the senders idle for `idle_s`."""
        now = self._clock()
        for addr, idle in list(self._entries.items()):
            if addr != address and now - idle.used > self.idle_s and idle.lock.acquire(False):
                try:  # a send still in flight keeps its sender until a later lease
                    idle.sender.close()
                finally:
                    idle.lock.release()
                del self._entries[addr]
        entry = self._entries.get(address)
        if entry is None:
            entry = self._entries[address] = _Entry(self._open(address), now)
        entry.used = now
        return entry.sender, entry.lock

    def close(self) -> None:
        """Close every sender (each after its send in flight, if any)."""
        for entry in self._entries.values():
            with entry.lock:
                entry.sender.close()
        self._entries.clear()
