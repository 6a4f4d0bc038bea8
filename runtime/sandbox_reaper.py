"""The sandbox's reaper: kills a fork server's runs when the server dies, however it dies.

With root every run has a uid of its own (`sandbox_zygote.UID_BASE + pid`), and a kill sent as
that uid (`kill_uid`) reaches every process of the run at once, forks in flight included, even
those that called setsid and were reparented away; a parent-death signal would reach only the
run's first process. A fork server that exits, or whose caller dies, kills its runs itself.
One that is SIGKILLed cannot, and its caller may be gone too: its reaper does it.

One reaper per fork server (`start`, after the chroot): a root process in a session of its own
and not the server's child, so nothing that signals the server, its process group or a run
reaches it. It holds the only read end of a pipe whose write end only the server holds (and a
run until its set-up closes it). A run writes its uid there (`register`) before its code
starts; the server writes the uid negated (`unregister`) once the run is killed and reaped. At
end of file (the server is gone, by any death) the reaper kills every uid still registered,
runs its `cleanup` (removing the server's cgroups) and exits. Stdlib only. This module knows
nothing of runs beyond their uids.
"""

from __future__ import annotations

import os
import signal
import struct
import time
from collections.abc import Callable

__all__ = ["kill_uid", "register", "start", "unregister"]

_RECORD = struct.Struct("=q")  # one uid per write: atomic on a pipe, never split on a read
_BATCH_S = 0.05  # delays the kills after a server's death by at most this


def kill_uid(uid: int) -> None:
    """SIGKILL every process whose uid is `uid`: a child that becomes `uid` may signal exactly
    that uid's processes, and kill(-1) reaches them all while no fork can slip past it."""
    child = os.fork()
    if child == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)
    os.waitpid(child, 0)


def register(fd: int, uid: int) -> None:
    os.write(fd, _RECORD.pack(uid))


def unregister(fd: int, uid: int) -> None:
    os.write(fd, _RECORD.pack(-uid))


def start(keep: list[int], cleanup: Callable[[], None] | None) -> int:
    """Start the reaper, which keeps only descriptors `keep` of this process's and calls
    `cleanup` after its kills. Returns the write end of its pipe, for `register` (by a run, which
    must close it before its code starts) and `unregister` (by the fork server)."""
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
    middle = os.fork()
    if middle == 0:
        try:
            os.setsid()
            if os.fork() == 0:  # the reaper: reparented away when `middle` exits
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):  # holds no pipe of the caller's open
                    os.dup2(null, fd)
                open_fds = sorted({read_fd, *keep})
                low = 3
                for fd in open_fds:
                    os.closerange(low, fd)
                    low = fd + 1
                os.closerange(low, os.sysconf("SC_OPEN_MAX"))
                _watch(read_fd)
                if cleanup is not None:
                    cleanup()
        finally:
            os._exit(0)
    os.close(read_fd)
    os.waitpid(middle, 0)
    return write_fd


def _watch(fd: int) -> None:
    """Follow the registrations until end of file, then kill every uid still registered."""
    live: set[int] = set()
    pending = b""
    while chunk := os.read(fd, 1 << 16):
        time.sleep(_BATCH_S)  # let records gather: one wake-up per batch, not two per run
        pending += chunk
        whole = len(pending) - len(pending) % _RECORD.size
        for (uid,) in _RECORD.iter_unpack(pending[:whole]):
            if uid > 0:
                live.add(uid)
            else:
                live.discard(-uid)
        pending = pending[whole:]
    for uid in live:
        kill_uid(uid)
