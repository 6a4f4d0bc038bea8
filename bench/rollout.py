"""Rollout benchmark: vLLM raw speed vs the same work through the rollout actor and agent
coroutines, and trainer -> serving weight-sync time.

    python bench/rollout.py --json [--quick]

Prints one JSON object with, per model ("tiny"; and "smollm2_135m" unless --quick):
- ``raw_tok_s``: generated tokens/s of vLLM stepping a whole batch inside the rollout actor's
  engine thread (`generate_batch`: no RPC, no asyncio per request) -- the physical reference.
  Each turn's batch extends the last turn's prompts with the tokens generated, exactly the
  prompts the agent loop sends (same prefill and prefix-cache work).
- ``agent_loop_tok_s``: tokens/s when `sessions` agent coroutines in this process each run
  `turns` multi-turn calls through `RolloutClient` -> RPC -> `RolloutActor` (each turn's prompt
  extends the previous one, as an agent's does).
- ``ratio``: agent_loop_tok_s / raw_tok_s (target >= 0.9).
- ``weight_sync_s``: median wall time of `WeightPublisher.push` (shm, drain mode) from a state
  dict in this process's memory (the trainer's) until the replica serves the new weights;
  ``weight_sync_first_s`` the first (cold) push; ``weight_memcpy_s`` the time one memcpy of the
  same bytes takes here (the physical limit); ``weight_load_s`` the engine's reload share.
Top-level ``raw_tok_s``/``agent_loop_tok_s``/``ratio``/``weight_sync_s`` repeat the tiny model's.

``--compare-engines`` adds ``engines``: the same concurrent token-id workload, in a fresh process
each, through EARL's in-process engine (LLMEngine stepped in a thread) and through vLLM's
AsyncLLM (which always runs its EngineCore in a separate process): start-up seconds and tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _memcpy_s(nbytes: int) -> float:
    import numpy as np

    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # warm
    t = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t


async def bench_model(rt: object, name: str, path: str, *, dtype: str, sessions: int, turns: int,
                      max_tokens: int, prompt_len: int, vocab_hi: int, syncs: int,
                      cast: str | None) -> dict[str, float | int | str]:
    import torch
    from safetensors.torch import load_file

    from earl.engine import SamplingParams
    from earl.runtime.rollout import RolloutActor, RolloutClient
    from earl.runtime.vllm_engine import EngineConfig
    from earl.runtime.weights import WeightPublisher

    cfg = EngineConfig(model=path, dtype=dtype, max_model_len=2048, max_num_seqs=256)
    t0 = time.perf_counter()
    g = await rt.spawn(f"rollout-{name}", RolloutActor, asdict(cfg),  # type: ignore[attr-defined]
                       env={"OMP_NUM_THREADS": "1"})
    start_s = time.perf_counter() - t0
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(7, vocab_hi) for _ in range(prompt_len)]
               for _ in range(sessions)]
    params = SamplingParams(max_tokens=max_tokens, temperature=1.0)
    await g[0].generate_batch.call_one(prompts[:4], params)  # warm-up

    s0 = await g[0].statistics.call_one()
    t = time.perf_counter()
    raw_tokens = 0
    batch = [list(p) for p in prompts]
    for _ in range(turns):  # each turn's prompt extends the last, as an agent's does
        gens = await g[0].generate_batch.call_one(batch, params)
        raw_tokens += sum(len(x.token_ids) for x in gens)
        batch = [p + x.token_ids + [2, 1, 17] for p, x in zip(batch, gens, strict=True)]
    raw_s = time.perf_counter() - t
    s1 = await g[0].statistics.call_one()

    client = RolloutClient(g)

    async def session(i: int) -> int:
        prompt, n = list(prompts[i]), 0
        for _ in range(turns):
            gen = await client.generate(prompt, params, session_id=f"{name}-{i}")
            n += len(gen.token_ids)
            prompt += gen.token_ids + [2, 1, 17]  # close the turn, open the next one
        return n

    t = time.perf_counter()
    agent_tokens = sum(await asyncio.gather(*(session(i) for i in range(sessions))))
    agent_s = time.perf_counter() - t
    s2 = await g[0].statistics.call_one()

    state = load_file(os.path.join(path, "model.safetensors"))
    pub = WeightPublisher(g, transport="shm", bucket_bytes=64 << 20,
                          dtype=getattr(torch, cast) if cast else None)
    results = []
    for v in range(1, syncs + 1):
        results.append(await pub.push(state, version=v, mode="drain"))
    pub.close()
    check = await g[0].generate.call_one(prompts[0], SamplingParams(max_tokens=2))
    assert check.versions == [syncs] * len(check.versions)
    warm = [r.seconds for r in results[1:]] or [results[0].seconds]
    await rt.stop(g)  # type: ignore[attr-defined]
    raw_tok_s = raw_tokens / raw_s
    agent_tok_s = agent_tokens / agent_s
    return {
        "model": name, "dtype": dtype, "sessions": sessions, "turns": turns,
        "max_tokens": max_tokens, "start_s": round(start_s, 2),
        "raw_tokens": raw_tokens, "agent_tokens": agent_tokens,
        "raw_tok_s": round(raw_tok_s, 1), "agent_loop_tok_s": round(agent_tok_s, 1),
        "ratio": round(agent_tok_s / raw_tok_s, 3),
        # engine steps and the share of wall time the engine thread spent inside step()
        "raw_steps": s1.steps - s0.steps, "agent_steps": s2.steps - s1.steps,
        "raw_busy": round((s1.busy_s - s0.busy_s) / raw_s, 3),
        "agent_busy": round((s2.busy_s - s1.busy_s) / agent_s, 3),
        "weight_bytes": results[0].nbytes, "weight_buckets": results[0].buckets,
        "weight_sync_s": round(statistics.median(warm), 4),
        "weight_sync_first_s": round(results[0].seconds, 4),
        "weight_load_s": round(statistics.median(r.load_s for r in results), 4),
        "weight_memcpy_s": round(_memcpy_s(results[0].nbytes), 4),
    }


async def engine_only(kind: str, sessions: int, turns: int) -> dict[str, float | str]:
    """One engine kind in this process: the agent-style workload without actors."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from earl.engine import SamplingParams
    from earl.models.tiny import default_model_dir

    path = str(default_model_dir())
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(7, 263) for _ in range(32)] for _ in range(sessions)]
    t0 = time.perf_counter()
    if kind == "inproc":
        from earl.runtime.vllm_engine import EngineConfig, VLLMEngine

        eng = VLLMEngine(EngineConfig(model=path, dtype="float32"))
        await eng.start()

        async def gen(p: list[int], i: int) -> list[int]:
            g = await eng.generate(p, SamplingParams(max_tokens=64, seed=i))
            return g.token_ids
    else:
        from vllm import SamplingParams as VSP
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        allm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=path, dtype="float32", enforce_eager=True, max_model_len=2048,
            disable_log_stats=True, enable_chunked_prefill=False, max_num_batched_tokens=2048,
            gpu_memory_utilization=0.3))  # CPU: the share of RAM it insists is free
        ids = iter(range(1 << 30))

        async def gen(p: list[int], i: int) -> list[int]:
            final = None
            async for out in allm.generate({"prompt_token_ids": p}, VSP(
                    max_tokens=64, seed=i, logprobs=0), f"r{next(ids)}"):
                final = out
            assert final is not None
            return list(final.outputs[0].token_ids)
    start_s = time.perf_counter() - t0

    async def session(i: int) -> int:
        p, n = list(prompts[i]), 0
        for _ in range(turns):
            out = await gen(p, i)
            n += len(out)
            p += out + [2, 1, 17]
        return n

    await gen(prompts[0], 0)  # warm-up
    t = time.perf_counter()
    n = sum(await asyncio.gather(*(session(i) for i in range(sessions))))
    tok_s = n / (time.perf_counter() - t)
    if kind == "inproc":
        await eng.close()
    else:
        allm.shutdown()
    return {"engine": kind, "start_s": round(start_s, 2), "tok_s": round(tok_s, 1)}


def compare_engines(sessions: int, turns: int) -> dict[str, object]:
    import subprocess

    out: dict[str, object] = {}
    for kind in ("inproc", "asyncllm"):
        env = dict(os.environ, OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_CPU_KVCACHE_SPACE="1",
                   VLLM_LOGGING_STREAM="ext://sys.stderr")
        res = subprocess.run([sys.executable, __file__, "--engine-only", kind,
                              "--sessions", str(sessions), "--turns", str(turns)],
                             env=env, capture_output=True, text=True, check=False)
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
        out[kind] = json.loads(lines[-1]) if lines else {"error": res.stderr[-2000:]}
    return out


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    from earl.models.tiny import default_model_dir
    from earl.runtime import Runtime

    out: dict[str, object] = {"quick": args.quick, "cores": os.cpu_count()}
    async with Runtime() as rt:
        tiny = await bench_model(
            rt, "tiny", str(default_model_dir()), dtype="float32",
            sessions=args.sessions, turns=2 if args.quick else 4,
            max_tokens=64, prompt_len=32, vocab_hi=263, syncs=3 if args.quick else 5, cast=None)
        out["tiny"] = tiny
        for k in ("raw_tok_s", "agent_loop_tok_s", "ratio", "weight_sync_s"):
            out[k] = tiny[k]
        if not args.quick:
            from earl.models.smollm2 import smollm2_dir

            out["smollm2_135m"] = await bench_model(
                rt, "smollm2", str(smollm2_dir()), dtype="bfloat16", sessions=16, turns=2,
                max_tokens=32, prompt_len=32, vocab_hi=49000, syncs=3, cast="bfloat16")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model only, fewer turns (< 50 s)")
    ap.add_argument("--sessions", type=int, default=64, help="concurrent agent sessions")
    ap.add_argument("--compare-engines", action="store_true",
                    help="also time EARL's in-process engine against vLLM AsyncLLM")
    ap.add_argument("--engine-only", choices=["inproc", "asyncllm"], help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, default=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.engine_only:
        print(json.dumps(asyncio.run(engine_only(args.engine_only, args.sessions, args.turns))))
        return 0
    t = time.perf_counter()
    out = asyncio.run(main_async(args))
    if args.compare_engines:
        out["engines"] = compare_engines(args.sessions, 2 if args.quick else 4)
    out["bench_s"] = round(time.perf_counter() - t, 1)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
