"""Rollout benchmark: agent coroutines through the rollout actor vs a batched reference doing
the same token work, and trainer -> serving weight-sync time.

    python bench/rollout.py --json [--quick]

Both paths do the same work: `sessions` conversations of `turns` turns, each turn exactly
``max_tokens`` generated tokens (``min_tokens = max_tokens``: stop tokens cannot end a turn
early), fixed sampling seeds, temperature 1, and the same prompt tokens (the chat template's first
prompt, then each turn's tokens plus the end token and the next user message, never
re-tokenized). The first user message differs between the paths only in one digit, so neither path
reuses the other's prefix cache.

Prints one JSON object with, per model ("tiny"; and "smollm2_135m" unless --quick):
- ``agent_loop_tok_s``: generated tokens/s of `sessions` real agent coroutines (a multi-turn chat
  agent: ``rollout.generate(messages)``, append the reply and the next user message) run
  concurrently by `run_agent` with a `ChatCodec`, through `RolloutClient` -> RPC ->
  `RolloutActor` (vLLM stepped in the actor's engine thread).
- ``batched_ref_tok_s``: the batched reference: the same prompts as one batch per turn, stepped
  inside the rollout actor's engine thread (`generate_batch`: no RPC or asyncio per request, no
  agent code). Not a ceiling: a different schedule of the same work.
- ``ratio``: agent_loop_tok_s / batched_ref_tok_s, the median over ``repeats`` (default 3) pairs
  of runs, the two paths alternated (batched first in even repeats, agents first in odd ones) so
  drift on a shared machine hits both; ``ratio_min``/``ratio_max``/``ratios`` give the spread, and
  the tok/s figures are medians too. ``agent_tokens`` == ``batched_ref_tokens`` (per run) and the
  prompt token totals are reported so the equality can be checked.
- ``weight_sync_s``: median wall time of `WeightPublisher.push` (shm, drain mode) from a state
  dict in this process's memory (the trainer's) until the replica serves the new weights;
  ``weight_sync_first_s`` the first (cold) push; ``weight_memcpy_s`` the time one memcpy of the
  same bytes takes here (the physical limit); ``weight_load_s`` the engine's reload share.
Top-level ``batched_ref_tok_s``/``agent_loop_tok_s``/``ratio``/``weight_sync_s`` repeat the tiny
model's.

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
from typing import Any

import _results

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


SEED = 1234
FOLLOW_UP = {"role": "user", "content": "Go on."}


def _first_message(path: int, i: int, prompt_words: int) -> list[dict[str, object]]:
    """Session `i`'s opening message; `path` (0 warm-up, then one number per path and repeat)
    changes two digits, so no run reuses another's cached prefix, and prompts keep one length."""
    rng = random.Random(i)
    words = " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega"))
                     for _ in range(prompt_words))
    return [{"role": "user", "content": f"Run {path:02d}. Session {i:04d}: {words}"}]


async def _agent_path(client: object, codec: object, *, sessions: int, turns: int,
                      params: object, prompt_words: int, tag: str,
                      path: int = 1) -> tuple[float, int, int]:
    """`sessions` chat agents through `run_agent`: (seconds, generated tokens, prompt tokens)."""
    from earl import RolloutConfig, run_agent

    async def agent(rollout, sample) -> float:  # type: ignore[no-untyped-def]
        messages = list(sample)
        for _ in range(turns):
            turn = await rollout.generate(messages)
            messages += [turn.message, dict(FOLLOW_UP)]
        return 0.0

    cfg = RolloutConfig(sampling=params)  # type: ignore[arg-type]
    t = time.perf_counter()
    trajs = await asyncio.gather(*(
        run_agent(agent, _first_message(path, i, prompt_words), engine=client,  # type: ignore[arg-type]
                  codec=codec, config=cfg, sample_id=f"{tag}-{i}")  # type: ignore[arg-type]
        for i in range(sessions)))
    secs = time.perf_counter() - t
    for tr in trajs:
        assert not tr.failed, tr.error
        assert len(tr.turn_spans) == turns, f"{len(tr.turn_spans)} turns, want {turns}"
    gen = sum(sum(tr.loss_mask) for tr in trajs)
    prompt = sum(a for tr in trajs for a, _ in tr.turn_spans)  # each turn's prompt length
    return secs, gen, prompt


async def _batched_path(group: object, codec: object, *, sessions: int, turns: int,
                        params: object, prompt_words: int,
                        path: int = 2) -> tuple[float, int, int]:
    """The batched reference: the agents' token work as one `generate_batch` per turn."""
    batch = [codec.encode_prompt(_first_message(path, i, prompt_words))  # type: ignore[attr-defined]
             for i in range(sessions)]
    follow = codec.encode_continuation([FOLLOW_UP])  # type: ignore[attr-defined]
    end = codec.end_id  # type: ignore[attr-defined]
    gen = prompt = 0
    t = time.perf_counter()
    for _ in range(turns):
        gens = await group[0].generate_batch.call_one(batch, params)  # type: ignore[index]
        prompt += sum(len(p) for p in batch)
        gen += sum(len(x.token_ids) for x in gens)
        # as the agent's rollout does: close the turn with the end token, then the next message
        batch = [p + x.token_ids + ([] if x.token_ids[-1:] == [end] else [end]) + follow
                 for p, x in zip(batch, gens, strict=True)]
    return time.perf_counter() - t, gen, prompt


async def bench_model(rt: object, name: str, path: str, *, dtype: str, sessions: int, turns: int,
                      max_tokens: int, prompt_words: int, syncs: int, cast: str | None,
                      repeats: int) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from earl import ChatCodec
    from earl.engine import SamplingParams
    from earl.stages.compute import Compute
    from earl.stages.rollout import RolloutActor, RolloutClient
    from earl.stages.vllm_engine import EngineConfig
    from earl.stages.weights import WeightPublisher

    cfg = EngineConfig(model=path, compute=Compute(dtype=dtype), max_model_len=2048,
                       max_num_seqs=256)
    t0 = time.perf_counter()
    g = await rt.spawn(f"rollout-{name}", RolloutActor, asdict(cfg),  # type: ignore[attr-defined]
                       env={"OMP_NUM_THREADS": "1"})
    start_s = time.perf_counter() - t0
    codec = ChatCodec(AutoTokenizer.from_pretrained(path))
    params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=1.0,
                            seed=SEED, stop_token_ids=codec.stop_ids)
    client = RolloutClient(g)
    work = {"sessions": sessions, "turns": turns, "params": params, "prompt_words": prompt_words}
    await _agent_path(client, codec, tag=f"{name}-warm", path=0,  # warm-up, its own prompts
                      **{**work, "sessions": 4})

    want = sessions * turns * max_tokens
    runs: dict[str, list[tuple[float, int, int, Any, Any]]] = {"agent": [], "ref": []}
    for rep in range(repeats):  # alternated, so drift on a shared machine hits both paths
        for kind in (("ref", "agent") if rep % 2 == 0 else ("agent", "ref")):
            s0 = await g[0].statistics.call_one()
            if kind == "ref":
                secs, gen, prompt = await _batched_path(g, codec, **work,  # type: ignore[arg-type]
                                                        path=2 * rep + 2)
            else:
                secs, gen, prompt = await _agent_path(
                    client, codec, tag=f"{name}-{rep}", path=2 * rep + 1, **work)  # type: ignore[arg-type]
            s1 = await g[0].statistics.call_one()
            assert gen == want, (kind, gen, want)
            runs[kind].append((secs, gen, prompt, s0, s1))

    state = load_file(os.path.join(path, "model.safetensors"))
    pub = WeightPublisher(g, transport="shm", bucket_bytes=64 << 20,
                          dtype=getattr(torch, cast) if cast else None)
    results = []
    for v in range(1, syncs + 1):
        results.append(await pub.push(state, version=v, mode="drain"))
    pub.close()
    check = await g[0].generate.call_one([1, 2, 3], SamplingParams(max_tokens=2))
    assert check.versions == [syncs] * len(check.versions)
    warm = [r.seconds for r in results[1:]] or [results[0].seconds]
    await rt.stop(g)  # type: ignore[attr-defined]
    ref_rates = [gen / secs for secs, gen, *_ in runs["ref"]]
    agent_rates = [gen / secs for secs, gen, *_ in runs["agent"]]
    ratios = sorted(a / r for a, r in zip(agent_rates, ref_rates, strict=True))

    def steps(kind: str) -> int:
        return sum(s1.steps - s0.steps for *_, s0, s1 in runs[kind])

    def busy(kind: str) -> float:
        return sum(s1.busy_s - s0.busy_s for *_, s0, s1 in runs[kind]) / sum(
            secs for secs, *_ in runs[kind])

    return {
        "model": name, "dtype": dtype, "sessions": sessions, "turns": turns,
        "max_tokens": max_tokens, "min_tokens": max_tokens, "seed": SEED,
        "start_s": round(start_s, 2), "repeats": repeats,
        "batched_ref_tokens": runs["ref"][0][1], "agent_tokens": runs["agent"][0][1],
        "batched_ref_prompt_tokens": runs["ref"][0][2],
        "agent_prompt_tokens": runs["agent"][0][2],
        "batched_ref_tok_s": round(statistics.median(ref_rates), 1),
        "agent_loop_tok_s": round(statistics.median(agent_rates), 1),
        # the median of the per-repeat ratios (each pair ran back to back), with its spread
        "ratio": round(statistics.median(ratios), 3),
        "ratio_min": round(ratios[0], 3), "ratio_max": round(ratios[-1], 3),
        "ratios": [round(x, 3) for x in ratios],
        # engine steps and the share of wall time the engine thread spent inside step()
        "batched_ref_steps": steps("ref"), "agent_steps": steps("agent"),
        "batched_ref_busy": round(busy("ref"), 3), "agent_busy": round(busy("agent"), 3),
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
        from earl.stages.compute import Compute
        from earl.stages.vllm_engine import EngineConfig, VLLMEngine

        eng = VLLMEngine(EngineConfig(model=path, compute=Compute(dtype="float32")))
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
            max_tokens=64, prompt_words=6, syncs=3 if args.quick else 5, cast=None,
            repeats=args.repeats)
        out["tiny"] = tiny
        for k in ("batched_ref_tok_s", "agent_loop_tok_s", "ratio", "weight_sync_s"):
            out[k] = tiny[k]
        if not args.quick:
            from earl.models.smollm2 import smollm2_dir

            out["smollm2_135m"] = await bench_model(
                rt, "smollm2", str(smollm2_dir()), dtype="bfloat16", sessions=16, turns=2,
                max_tokens=32, prompt_words=6, syncs=3, cast="bfloat16", repeats=args.repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="tiny model only, fewer turns (< 50 s)")
    ap.add_argument("--sessions", type=int, default=64, help="concurrent agent sessions")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each path, alternated (ratio: median of the per-pair ratios)")
    ap.add_argument("--compare-engines", action="store_true",
                    help="also time EARL's in-process engine against vLLM AsyncLLM")
    ap.add_argument("--engine-only", choices=["inproc", "asyncllm"], help=argparse.SUPPRESS)
    ap.add_argument("--turns", type=int, default=4, help=argparse.SUPPRESS)
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    begun = _results.start()
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
    if args.save:
        _results.save("rollout", out, quick=args.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
