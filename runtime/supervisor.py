"""Supervision of one actor group: start its processes, watch them, restart or declare dead.

A `GroupSupervisor` belongs to the runtime that spawned the group. For each rank a watcher task
(in the runtime's task group) waits for the process to exit; then, at once, every pending and
new call to that rank fails with `ActorDied` (carrying how the process ended: exit code, signal,
or the slot's OOM killer, where the launcher can tell), the directory records the rank as
`restarting` or `dead`, and, within the group's `RestartPolicy`, a new process is started (after
the backoff) and published under the same name and rank. Stopping is graceful first (close the
liveness line), then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import TYPE_CHECKING, Any

from earl.runtime.config import RestartPolicy
from earl.runtime.directory import DEAD, RESTARTING, UP
from earl.runtime.errors import ActorDied, Cause, actor_label
from earl.runtime.frames import log
from earl.runtime.launch import ActorSpec, Launcher, ProcessHandle
from earl.runtime.launch_local import LocalProcess

if TYPE_CHECKING:
    from earl.runtime.runtime import Runtime


class GroupSupervisor:
    """Owns the processes of one actor group."""

    def __init__(self, rt: Runtime, launcher: Launcher, specs: list[ActorSpec],
                 env: dict[str, str] | None, policy: RestartPolicy) -> None:
        self.rt = rt
        self.launcher = launcher
        self.specs = specs
        self.name = specs[0].name
        self.env = env
        self.policy = policy
        self.handles: list[ProcessHandle | None] = [None] * len(specs)
        self.restarts = [0] * len(specs)  # per rank, over its life (what the directory shows)
        self._times: list[list[float]] = [[] for _ in specs]  # per rank: when it restarted
        self.stopping = False
        self._watchers: list[asyncio.Task[None]] = []
        self._exited: set[int] = set()  # pids whose exit the watchers have seen

    async def start(self) -> None:
        """Launch every rank concurrently; on any failure stop the others and raise."""
        results = await asyncio.gather(*(self._launch(r) for r in range(len(self.specs))),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        for rank in range(len(self.specs)):
            self._watchers.append(self.rt.task(self._watch(rank)))

    async def grow(self, specs: list[ActorSpec]) -> None:
        """Launch new ranks (`specs`, numbered on from the current ones) and watch them; on
        any failure stop the new ones, leave the group as it was and raise."""
        first = len(self.specs)
        self.specs += specs
        self.handles += [None] * len(specs)
        self.restarts += [0] * len(specs)
        self._times += [[] for _ in specs]
        ranks = range(first, len(self.specs))
        results = await asyncio.gather(*(self._launch(r) for r in ranks), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self._reap([h for h in self.handles[first:] if h is not None])
            del self.specs[first:], self.handles[first:], self.restarts[first:]
            del self._times[first:]
            raise errors[0]
        self._watchers += [self.rt.task(self._watch(r)) for r in ranks]

    async def shrink(self, n: int, grace_s: float = 5.0) -> None:
        """Stop the ranks from `n` on (gracefully, then SIGKILL after `grace_s`); the ranks
        below `n` go on untouched."""
        for task in self._watchers[n:]:
            task.cancel()
        gone = [(r, h) for r, h in enumerate(self.handles) if r >= n and h is not None]
        await self._reap([h for _, h in gone], grace_s)
        self._dead_stopped(gone)
        del self.specs[n:], self.handles[n:], self.restarts[n:], self._watchers[n:]
        del self._times[n:]

    async def _launch(self, rank: int) -> ProcessHandle:
        spec = self.specs[rank]
        if spec.bind.startswith("unix:"):
            spec = dataclasses.replace(spec, bind=self.rt.socket_path(self.name, rank))
        handle = await self.launcher.launch(spec, self.env)
        self.handles[rank] = handle
        if self.stopping:
            handle.stop()
        return handle

    def label(self, rank: int) -> str:
        return actor_label(self.name, rank)

    def _death(self, rank: int, handle: ProcessHandle, reason: str) -> ActorDied:
        """`rank`'s process `handle` is gone: how, as data (a local process' exit status and
        its slot's OOM killer; other launchers only say it in `reason`)."""
        cause: Cause = "unknown"
        code = sig = None
        if isinstance(handle, LocalProcess) and handle.proc.returncode is not None:
            rc = handle.proc.returncode
            if rc >= 0:
                cause, code = "exited", rc
            else:
                oom = handle.binding is not None and handle.binding.exit_reason(rc) is not None
                cause, sig = ("oom" if oom else "killed"), -rc
        return ActorDied(self.label(rank), reason, group=self.name, rank=rank,
                         kind=self.specs[rank].cls_qualname, cause=cause, exit_code=code,
                         signal=sig)

    async def _watch(self, rank: int) -> None:
        while True:
            handle = self.handles[rank]
            assert handle is not None
            reason = await handle.wait_exit()
            self._exited.add(handle.pid)
            if self.stopping:
                return
            reason = f"pid {handle.pid} {reason}"
            self.rt.pool.mark_dead(handle.address, self._death(rank, handle, reason))
            now = time.monotonic()
            recent = self._times[rank] = self.policy.recent(self._times[rank], now)
            if len(recent) >= self.policy.max_restarts:
                log.warning("actor %s died (%s); no restarts left", self.label(rank), reason)
                await self.rt.dir_call("update", self.name, rank, DEAD, reason=reason)
                return
            delay = self.policy.delay(len(recent))
            recent.append(now)
            self.restarts[rank] += 1
            log.warning("actor %s died (%s); restart %d/%d in %.2fs", self.label(rank), reason,
                        len(recent), self.policy.max_restarts, delay)
            await self.rt.dir_call("update", self.name, rank, RESTARTING,
                                   reason=f"restarting after: {reason}")
            await asyncio.sleep(delay)
            try:
                handle = await self._launch(rank)
            except Exception as e:  # failing to come back is a death, not a runtime crash  # noqa: BLE001
                why = f"restart failed: {e}"
                log.error("actor %s %s", self.label(rank), why)
                await self.rt.dir_call("update", self.name, rank, DEAD, reason=why)
                return
            await self.rt.dir_call("update", self.name, rank, UP, handle.address, handle.pid)

    def kill(self, rank: int, pid: int) -> bool:
        """SIGKILL `rank` if it still runs as `pid` (its watcher then restarts it, within the
        policy, as after any death); False when that process is already gone or replaced."""
        handle = self.handles[rank]
        if self.stopping or handle is None or handle.pid != pid or pid in self._exited:
            return False
        handle.kill()
        return True

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop every rank: ask nicely, SIGKILL whatever is still alive after `grace_s`."""
        self.stopping = True
        for task in self._watchers:
            task.cancel()
        await self._reap([h for h in self.handles if h is not None], grace_s)
        self._dead_stopped(list(enumerate(self.handles)))

    @staticmethod
    async def _reap(live: list[Any], grace_s: float = 5.0) -> None:
        """Ask `live` processes to stop; SIGKILL those still alive after `grace_s`."""
        for h in live:
            h.stop()

        async def reap(h: Any) -> None:
            try:
                await asyncio.wait_for(h.wait_exit(), grace_s)
            except TimeoutError:
                log.warning("actor pid %s did not stop in %.1fs: killing it", h.pid, grace_s)
                h.kill()
                await h.wait_exit()

        await asyncio.gather(*(reap(h) for h in live))

    def _dead_stopped(self, ranks: list[tuple[int, ProcessHandle | None]]) -> None:
        """Calls still pending on these stopped ranks fail (cause "stopped")."""
        for rank, h in ranks:
            if h is not None and h.address:
                self.rt.pool.mark_dead(h.address, ActorDied(
                    self.label(rank), "stopped", kind=self.specs[rank].cls_qualname,
                    cause="stopped"))
