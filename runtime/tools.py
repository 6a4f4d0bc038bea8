"""Action-level tool executor: one shared, elastic pool of worker processes for all sessions.

Tool calls are *actions* scheduled on whichever worker is free (ARL-Tangram), not on a sandbox
pinned to a trajectory. The pool grows while actions queue and shrinks when workers sit idle,
within [min_workers, max_workers]. Waiting actions run shortest-expected-first, the expectation
being a moving average of each tool's past run time; an action that has waited `max_wait_s`
goes next so nothing starves. Each action has a timeout; a timed-out or cancelled action's
worker is killed (its process group) and replaced. `StaticExecutor` is the baseline it is
measured against (`earl.runtime.tools_static`): one fresh worker per session, held for the
whole session.
Only tools with a `Tool.ref` (importable module-level functions) run on workers. A tool without
one (a closure or bound method keeping per-episode state, or `where="local"`) runs in the
caller's process, on its event loop (`run_local`): its state stays with the session that made
it. Isolation of untrusted code is the `python` tool's job (`earl.runtime.sandbox`), not this
module's.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
import json
import os
import signal
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Self

from earl.runtime.types import JSONValue, Tool, ToolResult, to_text

__all__ = ["ExecutorConfig", "ExecutorStatistics", "ToolExecutor", "run_local",
           "stalled_threads"]

_HEADER = struct.Struct(">I")
# Run as a script, not `-m earl.runtime...`: importing the actor runtime would slow every start.
_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools_worker.py")


@dataclass(kw_only=True, slots=True)
class ExecutorConfig:
    """Pool size, scheduling policy and timeouts.

    Args:
        min_workers: workers kept alive even when idle.
        max_workers: upper bound on workers.
        idle_s: a worker idle this long is closed (down to min_workers).
        policy: "sef" (shortest expected first) or "fifo".
        max_wait_s: an action waiting this long jumps the queue.
        default_timeout_s: per-action timeout when the caller gives none.
    """

    min_workers: int = 0
    max_workers: int = 8
    idle_s: float = 5.0
    policy: str = "sef"
    max_wait_s: float = 5.0
    default_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_workers <= self.max_workers or self.max_workers < 1:
            raise ValueError(f"ExecutorConfig needs 0 <= min_workers <= max_workers and "
                             f"max_workers >= 1, got {self.min_workers}, {self.max_workers}")
        if self.policy not in ("sef", "fifo"):
            raise ValueError(f"ExecutorConfig.policy must be 'sef' or 'fifo', got {self.policy!r}")


@dataclass(frozen=True, slots=True)
class ExecutorStatistics:
    """Counters: current/peak/time-averaged workers, actions by outcome, queue length."""

    workers: int
    peak_workers: int
    mean_workers: float
    spawned: int
    completed: int
    timeouts: int
    crashes: int
    queued: int


class _Worker:
    """One `earl.runtime.tools_worker` process with its pipes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.idle_since = time.monotonic()
        self.dead = False

    @classmethod
    async def start(cls) -> _Worker:
        env = dict(os.environ, EARL_TOOL_PATH=os.pathsep.join(sys.path), OMP_NUM_THREADS="1")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, _WORKER_SCRIPT, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True, env=env)
        worker = cls(proc)
        try:
            await worker._read()  # ready handshake
        except BaseException:
            worker.kill()
            await proc.wait()
            raise
        return worker

    async def _read(self) -> dict[str, JSONValue]:
        assert self.proc.stdout is not None
        (n,) = _HEADER.unpack(await self.proc.stdout.readexactly(4))
        return json.loads(await self.proc.stdout.readexactly(n))

    async def call(self, ref: str, args: dict[str, JSONValue]) -> dict[str, JSONValue]:
        assert self.proc.stdin is not None
        data = json.dumps({"ref": ref, "args": args}).encode()  # ASCII: lone surrogates survive
        self.proc.stdin.write(_HEADER.pack(len(data)) + data)
        await self.proc.stdin.drain()
        return await self._read()

    def kill(self) -> None:
        self.dead = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Action:
    __slots__ = ("expected", "future", "seq", "submitted", "taken")

    def __init__(self, expected: float, seq: int, future: asyncio.Future[_Worker]) -> None:
        self.expected, self.seq, self.future = expected, seq, future
        self.submitted = time.monotonic()
        self.taken = False


class _Pool:
    """Worker bookkeeping shared by both executors: counts, time-averaged size, outcomes."""

    def __init__(self, count_discards: bool = True) -> None:
        self.count_discards = count_discards  # False: the owner counts capacity itself
        self._t0 = self._t_last = time.monotonic()
        self._area = 0.0
        self.size = self.peak = self.spawned = 0
        self.completed = self.timeouts = self.crashes = 0
        self._reaping: set[asyncio.Task[None]] = set()

    def resize(self, delta: int) -> None:
        now = time.monotonic()
        self._area += self.size * (now - self._t_last)
        self._t_last = now
        self.size += delta
        self.peak = max(self.peak, self.size)

    def mean(self) -> float:
        now = time.monotonic()
        area = self._area + self.size * (now - self._t_last)
        return area / (now - self._t0) if now > self._t0 else float(self.size)

    def discard(self, tg: asyncio.TaskGroup, worker: _Worker) -> None:
        worker.kill()
        if self.count_discards:
            self.resize(-1)
        tg.create_task(worker.proc.wait())  # reap it; owned by the executor's task group

    async def call(self, worker: _Worker, tool: Tool, args: dict[str, JSONValue],
                   tg: asyncio.TaskGroup) -> tuple[dict[str, JSONValue] | None, bool]:
        """Run one call; on any interruption kill the worker. Returns (reply, worker_alive)."""
        assert tool.ref is not None
        try:
            reply = await worker.call(tool.ref, args)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.crashes += 1
            self.discard(tg, worker)
            return None, False
        except BaseException:  # timeout or cancellation mid-call: the worker state is unknown
            self.discard(tg, worker)
            raise
        self.completed += 1
        return reply, True

    def result(self, tool: Tool, reply: dict[str, JSONValue] | None, queued: float,
               run: float) -> ToolResult:
        if reply is None:
            return ToolResult(ok=False, output=f"{tool.name} crashed (its worker process died)",
                              error="crashed", queued_s=queued, run_s=run)
        return ToolResult(ok=bool(reply["ok"]), output=str(reply["output"]),
                          error=reply["error"], queued_s=queued, run_s=run)  # type: ignore[arg-type]

    def statistics(self, queued: int) -> ExecutorStatistics:
        return ExecutorStatistics(workers=self.size, peak_workers=self.peak,
                                  mean_workers=self.mean(), spawned=self.spawned,
                                  completed=self.completed, timeouts=self.timeouts,
                                  crashes=self.crashes, queued=queued)


def _not_importable(tool: Tool) -> ToolResult:
    return ToolResult(ok=False, output=f"tool {tool.name!r} cannot run on a worker: define it as "
                      "a module-level function so workers can import it", error="not importable")


def _timed_out(tool: Tool, timeout: float, queued: float, run: float) -> ToolResult:
    return ToolResult(ok=False, output=f"{tool.name} timed out after {timeout:g} s",
                      error="timeout", queued_s=queued, run_s=run)


async def run_local(tool: Tool, arguments: dict[str, JSONValue], *,
                    timeout_s: float) -> ToolResult:
    """Run `tool` in this process (its state, e.g. a closure's, stays with the caller).

    An async tool runs on the event loop; a sync one on a thread of its own, so a sync call
    that hangs (a stalled network read, a deadlock) cannot block the loop and the other
    sessions on it: after `timeout_s` the caller gets a timeout and the thread is left to end
    on its own (`stalled_threads` counts those still running). Failures come back as a not-ok
    ToolResult, never as an exception.
    """
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            if inspect.iscoroutinefunction(tool.fn):
                value = await tool.fn(**arguments)
            else:
                value = await _on_thread(tool, arguments)
            if inspect.isawaitable(value):
                value = await value
        return ToolResult(ok=True, output=to_text(value), run_s=time.monotonic() - t0)
    except TimeoutError:
        return _timed_out(tool, timeout_s, 0.0, time.monotonic() - t0)
    except Exception as exc:  # noqa: BLE001 - the tool's failure is the model's observation
        return ToolResult(ok=False, output=f"{tool.name} raised {type(exc).__name__}: {exc}",
                          error="exception", run_s=time.monotonic() - t0)


_abandoned: set[threading.Thread] = set()  # sync tool threads whose callers stopped waiting


def stalled_threads() -> int:
    """Threads of sync tools still running whose callers stopped waiting (timed out)."""
    _abandoned.difference_update([t for t in list(_abandoned) if not t.is_alive()])
    return len(_abandoned)


async def _on_thread(tool: Tool, arguments: dict[str, JSONValue]) -> object:
    """`tool.fn(**arguments)` on a new daemon thread (never a pool's: a stuck call must not
    take a worker the next calls wait for)."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[object] = loop.create_future()

    def settle(ok: bool, value: object) -> None:
        if not fut.done():
            if ok:
                fut.set_result(value)
            else:
                fut.set_exception(value)  # type: ignore[arg-type]

    def target() -> None:
        try:
            ok, value = True, tool.fn(**arguments)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            ok, value = False, exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(settle, ok, value)

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    try:
        return await fut
    except asyncio.CancelledError:
        stalled_threads()  # drops the abandoned threads that have ended since
        _abandoned.add(thread)
        raise


class ToolExecutor:
    """The elastic, action-level executor. Use as `async with ToolExecutor(cfg) as ex:`."""

    def __init__(self, config: ExecutorConfig | None = None) -> None:
        self.config = config or ExecutorConfig()
        self._pool = _Pool()
        self._idle: list[_Worker] = []
        self._live: weakref.WeakSet[_Worker] = weakref.WeakSet()
        self._by_expected: list[tuple[float, int, _Action]] = []
        self._by_age: list[tuple[int, _Action]] = []
        self._waiting = self._starting = 0
        self._seq = itertools.count()
        self._history: dict[str, float] = {}
        self._tg = asyncio.TaskGroup()
        self._closed = asyncio.Event()

    async def __aenter__(self) -> Self:
        await self._tg.__aenter__()
        for _ in range(self.config.min_workers):
            self._grow()
        self._tg.create_task(self._reap_idle())
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._closed.set()
        for w in list(self._live):  # busy ones too: a caller may still be waiting on them
            if not w.dead:
                self._pool.discard(self._tg, w)
        self._idle.clear()
        await self._tg.__aexit__(None, None, None)

    def for_session(self, session_id: str) -> ToolExecutor:
        """Any session uses the shared pool directly."""
        return self

    async def release_session(self, session_id: str) -> None:
        """Nothing is pinned to a session."""

    def expected_s(self, tool: Tool) -> float:
        """Expected run time of `tool` from its history (unknown tools count as short)."""
        if self.config.policy == "fifo":
            return 0.0
        return self._history.get(tool.name, 0.0)

    def statistics(self) -> ExecutorStatistics:
        return self._pool.statistics(self._waiting)

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult:
        """Run one action on the pool (a tool without a ref in this process, see
        `run_local`); failures come back as a not-ok ToolResult."""
        timeout = self.config.default_timeout_s if timeout_s is None else timeout_s
        if tool.ref is None:
            return await run_local(tool, arguments, timeout_s=timeout)
        t0 = time.monotonic()
        t1 = t0
        try:
            async with asyncio.timeout(timeout):
                worker = await self._acquire(self.expected_s(tool))
                t1 = time.monotonic()
                reply, alive = await self._pool.call(worker, tool, arguments, self._tg)
        except TimeoutError:
            self._pool.timeouts += 1
            self._grow_if_needed()
            return _timed_out(tool, timeout, t1 - t0, time.monotonic() - t1)
        t2 = time.monotonic()
        if alive:
            self._release(worker)
        else:
            self._grow_if_needed()
        if reply is not None:
            run = float(reply.get("run_s", t2 - t1))  # type: ignore[arg-type]
            key = tool.name
            old = self._history.get(key)
            self._history[key] = run if old is None else 0.8 * old + 0.2 * run
        return self._pool.result(tool, reply, t1 - t0, t2 - t1)

    # -- scheduling ---------------------------------------------------------------------------
    async def _acquire(self, expected: float) -> _Worker:
        if self._idle and not self._waiting:
            return self._idle.pop()
        fut: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
        action = _Action(expected, next(self._seq), fut)
        heapq.heappush(self._by_expected, (expected, action.seq, action))
        heapq.heappush(self._by_age, (action.seq, action))
        self._waiting += 1
        self._grow_if_needed()
        try:
            return await fut
        except BaseException:
            if not action.taken:
                action.taken = True
                self._waiting -= 1
            elif fut.done() and not fut.cancelled() and fut.exception() is None:
                self._release(fut.result())  # handed a worker just as we gave up
            raise

    def _next_action(self) -> _Action | None:
        while self._by_age and self._by_age[0][1].taken:
            heapq.heappop(self._by_age)
        if not self._by_age:
            self._by_expected.clear()
            return None
        oldest = self._by_age[0][1]
        if time.monotonic() - oldest.submitted >= self.config.max_wait_s:
            action = oldest
        else:
            while self._by_expected[0][2].taken:
                heapq.heappop(self._by_expected)
            action = self._by_expected[0][2]
        action.taken = True
        self._waiting -= 1
        return action

    def _release(self, worker: _Worker) -> None:
        action = self._next_action()
        if action is None:
            worker.idle_since = time.monotonic()
            self._idle.append(worker)
        else:
            action.future.set_result(worker)

    def _grow_if_needed(self) -> None:
        while self._waiting > self._starting and self._pool.size < self.config.max_workers:
            self._grow()

    def _grow(self) -> None:
        self._starting += 1
        self._pool.resize(+1)  # a worker counts from the moment it is asked for
        self._tg.create_task(self._spawn())

    async def _spawn(self) -> None:
        try:
            worker = await _Worker.start()
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._starting -= 1
            self._pool.resize(-1)
            action = self._next_action()
            if action is not None:
                action.future.set_exception(RuntimeError(f"cannot start a tool worker: {exc}"))
            return
        self._starting -= 1
        self._pool.spawned += 1
        self._live.add(worker)
        if self._closed.is_set():
            self._pool.discard(self._tg, worker)
        else:
            self._release(worker)

    async def _reap_idle(self) -> None:
        period = max(self.config.idle_s / 4, 0.01)
        while not self._closed.is_set():
            try:
                async with asyncio.timeout(period):
                    await self._closed.wait()
            except TimeoutError:
                pass
            now = time.monotonic()
            keep = self.config.min_workers
            for w in sorted(self._idle, key=lambda w: w.idle_since):
                if self._pool.size <= keep or now - w.idle_since < self.config.idle_s:
                    break
                self._idle.remove(w)
                self._pool.discard(self._tg, w)
