"""Giving freed heap memory back to the OS (glibc's `malloc_trim`).

glibc keeps the memory a process frees in its heap for reuse, and a trainer on CPU frees a
step's activations every step. Reusing them is what makes the next step cheap (trimming after
every step costs a train step its pages faulting back in), but fragmentation makes the kept
heap creep up over hours, and a memory limit (a cgroup, the selector's plan) counts those
pages as used.

`Trimmer` trims only when the heap has crept: it notes the anonymous resident set one step
after a trim (the working set: live memory plus what a step reuses) and trims when a later
step ends more than `slack` above it.

Not glibc (musl, macOS): `trim()` does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import time
from typing import Any

__all__ = ["Trimmer", "anon_bytes", "libc", "status_kib", "trim"]


@functools.cache
def libc() -> ctypes.CDLL | None:
    """The C library (None where it cannot be loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _malloc_trim() -> Any:
    fn = getattr(libc(), "malloc_trim", None)
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> float | None:
    """Return the heap's free pages to the OS; the seconds it took, or None where the C
    library has no `malloc_trim`."""
    fn = _malloc_trim()
    if fn is None:
        return None
    t0 = time.perf_counter()
    fn(0)
    return time.perf_counter() - t0


def status_kib(key: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`, `RssAnon`, ...; Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"{key} not in /proc/self/status")


def anon_bytes() -> int:
    """This process's anonymous resident memory (`RssAnon`), in bytes."""
    return status_kib("RssAnon") << 10


class Trimmer:
    """Trims the heap after a step when it has crept `slack` above the working set (see the
    module's docstring)."""

    def __init__(self, slack: float = 0.10) -> None:
        self.slack = slack
        self.working_set: int | None = None  # bytes, one step after the last trim
        self.trims = 0

    def after_step(self) -> float:
        """Call once a step has freed what it allocated; the seconds spent trimming."""
        anon = anon_bytes()
        if self.working_set is None:
            self.working_set = anon
            return 0.0
        if anon <= self.working_set * (1 + self.slack):
            return 0.0
        self.working_set, self.trims = None, self.trims + 1  # re-noted after the next step
        return trim() or 0.0
