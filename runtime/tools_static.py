"""The static baseline for the tool executor: one fresh worker ("sandbox") per session.

A session gets its own worker on its first action and keeps it until `release_session`, as
trajectory-level sandbox allocation does; at most `max_workers` sessions hold one and the rest
wait. `earl stress --compare` measures the elastic, action-level `ToolExecutor` against it.
It shares worker handling with `earl.runtime.tools` and is not meant for production use.
"""

from __future__ import annotations

import asyncio
import time
from typing import Self

from earl.runtime.tools import (
    ExecutorConfig,
    ExecutorStatistics,
    _not_importable,
    _Pool,
    _timed_out,
    _Worker,
)
from earl.runtime.types import JSONValue, Tool, ToolResult

__all__ = ["StaticExecutor"]


class _SessionRunner:
    def __init__(self, owner: StaticExecutor, session_id: str) -> None:
        self.owner, self.session_id = owner, session_id

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult:
        return await self.owner._run(self.session_id, tool, arguments, timeout_s)


class StaticExecutor:
    """Baseline: each session gets its own fresh worker ("sandbox") on its first action and
    keeps it until `release_session`; at most `max_workers` sessions hold one, the rest wait.
    """

    def __init__(self, config: ExecutorConfig | None = None) -> None:
        self.config = config or ExecutorConfig()
        self._pool = _Pool(count_discards=False)  # capacity = sandboxes reserved by sessions
        self._slots = asyncio.Semaphore(self.config.max_workers)
        self._owned: dict[str, _Worker | None] = {}
        self._waiting = 0
        self._tg = asyncio.TaskGroup()

    async def __aenter__(self) -> Self:
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        for sid in list(self._owned):
            await self.release_session(sid)
        await self._tg.__aexit__(None, None, None)

    def for_session(self, session_id: str) -> _SessionRunner:
        return _SessionRunner(self, session_id)

    async def release_session(self, session_id: str) -> None:
        if session_id in self._owned:
            worker = self._owned.pop(session_id)
            if worker is not None:
                self._pool.discard(self._tg, worker)
            self._pool.resize(-1)
            self._slots.release()

    def statistics(self) -> ExecutorStatistics:
        return self._pool.statistics(self._waiting)

    async def _run(self, sid: str, tool: Tool, arguments: dict[str, JSONValue],
                   timeout_s: float | None) -> ToolResult:
        if tool.ref is None:
            return _not_importable(tool)
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        t0 = t1 = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                if sid not in self._owned:
                    self._waiting += 1
                    try:
                        await self._slots.acquire()
                    finally:
                        self._waiting -= 1
                    self._owned[sid] = None
                    self._pool.resize(+1)  # the session's sandbox is reserved from now on
                worker = self._owned[sid]
                if worker is None:  # a fresh sandbox per session (cold start)
                    worker = self._owned[sid] = await _Worker.start()
                    self._pool.spawned += 1
                t1 = time.monotonic()
                reply, alive = await self._pool.call(worker, tool, arguments, self._tg)
        except TimeoutError:
            self._pool.timeouts += 1
            if (w := self._owned.get(sid)) is not None and w.dead:
                self._owned[sid] = None  # killed mid-call: the next action gets a fresh one
            return _timed_out(tool, timeout, t1 - t0, time.monotonic() - t1)
        if not alive:
            self._owned[sid] = None
        return self._pool.result(tool, reply, t1 - t0, time.monotonic() - t1)
