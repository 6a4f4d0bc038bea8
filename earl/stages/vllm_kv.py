"""What a weight load does to vLLM's KV cache, per `UpdateMode`, inside the engine thread.

- "drain": nothing runs; the prefix cache is reset (vLLM's `reset_prefix_cache`).
- "inflight": every running request is preempted and its KV dropped (recomputed under the new
  weights when it is scheduled again), then the prefix cache is reset.
- "inflight_keep_kv" (PipelineRL's in-flight update): running requests keep their KV, computed
  under older weights, and go on decoding; only the prefix cache is forgotten, for the running
  requests' blocks too, so no request started after the load reuses KV from before it.

Why the prefix cache is forgotten rather than kept: the staleness bound (`max_policy_lag`)
bounds a sample's oldest *token*. A running request's KV is never older than its own first
token (its prompt was computed when it started), so the bound covers it. A block reused by
prefix caching carries no such bound: a hot prefix (a system prompt, a group's shared task)
would be computed once and then served to every later request, whatever the version, as long
as some request held it. vLLM 0.32's `reset_prefix_cache` refuses while any block is in use
(it returns False and warns), so `forget_prefix_cache` evicts the hashes block by block with the
block pool's own eviction step, used and free blocks alike: the blocks stay with their
requests, no lookup finds them.

This module reaches into the in-process vLLM V1 core (scheduler, KV-cache coordinator, block
pools) of vLLM 0.32; it knows nothing about versions or requests' tokens
(`earl.stages.vllm_engine`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["forget_prefix_cache", "reset_for_load", "running_requests"]


def reset_for_load(eng: Any, mode: str) -> int:
    """Apply `mode`'s KV policy after new weights are in (see the module docstring); returns
    the running requests a "inflight" load preempted (0 for the other modes)."""
    if mode == "inflight_keep_kv":
        forget_prefix_cache(eng)
        return 0
    preempted = running_requests(eng) if mode == "inflight" else 0
    eng.reset_prefix_cache(reset_running_requests=mode == "inflight")
    return preempted


def running_requests(eng: Any) -> int:
    """Requests in the scheduler's running queue (holding KV) now."""
    return len(_scheduler(eng).running)


def forget_prefix_cache(eng: Any) -> int:
    """Drop every prefix-cache hash, including those of blocks running requests hold, without
    freeing any block; returns the blocks that had a hash."""
    manager = _scheduler(eng).kv_cache_manager
    if not manager.enable_caching:
        return 0
    pools = dict.fromkeys(m.block_pool for m in manager.coordinator.single_type_managers)
    n = 0
    for pool in pools:
        for block in pool.blocks:
            if block.block_hash is not None:
                n += pool._maybe_evict_cached_block(block)  # vLLM's own eviction step
    return n


def _scheduler(eng: Any) -> Any:
    return eng.engine_core.engine_core.scheduler  # LLMEngine -> InprocClient -> EngineCore
