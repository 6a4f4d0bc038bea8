"""OpenAI endpoint benchmark: what serving a rollout session over `/v1/chat/completions` costs
compared with the agent calling `rollout.generate` directly, on the same sessions.

    python bench/openai_endpoint.py --json [--quick]

Prints one JSON object:
- ``overhead_ms_median`` (goal <= 1 ms): median per-request latency through the endpoint minus
  that of `rollout.generate`, same sessions, same turns, same tokens, one request at a time, on
  `SimEngine(time_scale=0)` so the engine's own time (~tens of us) does not hide the cost. The
  HTTP client is a keep-alive aiohttp session: the endpoint's cost (JSON both ways, loopback
  TCP, auth, validation, recording). ``overhead_ms_by_repeat`` gives each repeat's figure.
- ``overhead_ms_median_openai_client``: the same through `rollout.openai_client()` (the `openai`
  package's AsyncOpenAI on its aiohttp transport), i.e. what an agent written against `openai`
  sees; ``openai_client_ms_median`` is the part spent in that client library itself.
- ``throughput_ratio`` (goal >= 0.9): generated tokens/s of `sessions` (256) concurrent
  multi-turn sessions through the endpoint (lean HTTP client), divided by the same sessions
  calling `rollout.generate`, on the tiny model through the vLLM rollout actor (its own process,
  one core); ``throughput_ratio_openai_client`` the same with the `openai` client. Same prompts
  and per-session seeds on all paths; ``tokens_*`` are the generated-token totals and
  ``same_tokens`` says whether every path generated the very same tokens. Each round runs the
  three paths in a rotated order; ``*_by_round`` gives each round's ratio.
  ``driver_cpu_ms_per_request`` is the CPU this process (agents, endpoint, clients) spent per
  request on each path; ``cpu_ms_per_token`` the CPU of this process and the rollout actor
  (vLLM) per generated token, and ``cpu_ratio`` (direct / endpoint) its ratio: the part of the
  cost that other load on the machine does not change (what the throughput ratio would be on a
  machine where CPU is the only limit).
Timings on a shared 2-core machine are noisy: read the per-repeat figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import asdict

import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

MODEL = "earl-policy"


def letters_responder(codec, n_tokens: int):  # type: ignore[no-untyped-def]
    """SimEngine plays a model that always answers `n_tokens` letters, then ends its turn."""
    letters = [codec.encode_text(c)[0] for c in "abcdefghijklmnopqrstuvwxyz"]

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        return [rng.choice(letters) for _ in range(n_tokens - 1)] + [codec.end_id]

    return respond


def make_agents(turns: int, latencies: list[float], http: object = None):  # type: ignore[no-untyped-def]
    """Three agents doing the same conversation: direct, lean HTTP client, openai client."""

    async def direct(rollout, sample) -> float:  # type: ignore[no-untyped-def]
        msgs = [{"role": "user", "content": f"Session {sample}: tell me a story."}]
        for k in range(turns):
            t0 = time.perf_counter()
            turn = await rollout.generate(msgs)
            latencies.append(time.perf_counter() - t0)
            msgs += [turn.message, {"role": "user", "content": f"go on ({k})"}]
        return 0.0

    async def lean(rollout, sample) -> float:  # type: ignore[no-untyped-def]
        url = f"{rollout.base_url}/chat/completions"
        headers = {"Authorization": f"Bearer {rollout.api_key}"}
        msgs = [{"role": "user", "content": f"Session {sample}: tell me a story."}]
        for k in range(turns):
            t0 = time.perf_counter()
            async with http.post(url, json={"model": MODEL, "messages": msgs},  # type: ignore[attr-defined]
                                 headers=headers) as resp:
                reply = (await resp.json())["choices"][0]["message"]
            latencies.append(time.perf_counter() - t0)
            msgs += [reply, {"role": "user", "content": f"go on ({k})"}]
        return 0.0

    async def with_openai(rollout, sample) -> float:  # type: ignore[no-untyped-def]
        client = rollout.openai_client()
        msgs = [{"role": "user", "content": f"Session {sample}: tell me a story."}]
        for k in range(turns):
            t0 = time.perf_counter()
            r = await client.chat.completions.create(model=MODEL, messages=msgs)
            latencies.append(time.perf_counter() - t0)
            msgs += [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": f"go on ({k})"}]
        return 0.0

    return {"direct": direct, "http": lean, "openai": with_openai}


async def overhead(codec, *, sessions: int, turns: int, tokens: int, repeats: int) -> dict:  # type: ignore[no-untyped-def,type-arg]
    import aiohttp

    from earl.agents.openai_server import OpenAIEndpoint
    from earl.agents.rollout import RolloutConfig, run_agent
    from earl.engine import SamplingParams, SimConfig, SimEngine

    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=tokens))
    lat: dict[str, list[list[float]]] = {"direct": [], "http": [], "openai": []}
    gen: dict[str, int] = {}
    async with OpenAIEndpoint() as ep, aiohttp.ClientSession() as http:
        for rep in range(repeats + 1):  # the first repeat warms up and is not counted
            for path in ("direct", "http", "openai"):
                engine = SimEngine(SimConfig(time_scale=0.0), letters_responder(codec, tokens))
                out: list[float] = []
                agent = make_agents(turns, out, http)[path]
                n = 0
                for i in range(sessions):
                    t = await run_agent(agent, i, engine=engine, codec=codec, config=cfg,
                                        sample_id=f"s{i}", endpoint=None if path == "direct"
                                        else ep)
                    assert not t.failed and t.num_turns == turns, t.error
                    n += t.num_generated
                if rep:
                    lat[path].append(out)
                    gen[path] = n
    med = {p: statistics.median(x for r in runs for x in r) * 1e3 for p, runs in lat.items()}
    by_rep = [round((statistics.median(h) - statistics.median(d)) * 1e3, 3)
              for d, h in zip(lat["direct"], lat["http"], strict=True)]
    assert len(set(gen.values())) == 1, f"paths generated different token counts: {gen}"
    return {"overhead_ms_median": round(med["http"] - med["direct"], 3),
            "overhead_ms_by_repeat": by_rep,
            "overhead_ms_median_openai_client": round(med["openai"] - med["direct"], 3),
            "openai_client_ms_median": round(med["openai"] - med["http"], 3),
            "direct_ms_median": round(med["direct"], 4),
            "endpoint_ms_median": round(med["http"], 3),
            "endpoint_openai_ms_median": round(med["openai"], 3),
            "overhead_requests": sessions * turns * repeats,
            "overhead_tokens_per_request": tokens}


def _tree_cpu_s() -> float:
    """CPU seconds of this process and its children (the rollout actor, vLLM) so far."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


async def throughput(codec, *, sessions: int, turns: int, tokens: int, rounds: int) -> dict:  # type: ignore[no-untyped-def,type-arg]
    from earl.agents.openai_server import OpenAIEndpoint
    from earl.agents.rollout import RolloutConfig, run_agent
    from earl.engine import SamplingParams
    from earl.models.tiny import default_model_dir
    from earl.runtime import Runtime
    from earl.stages.compute import Compute
    from earl.stages.rollout import RolloutActor, RolloutClient
    from earl.stages.vllm_engine import EngineConfig

    ecfg = EngineConfig(model=str(default_model_dir()), compute=Compute(dtype="float32"),
                        max_model_len=2048, max_num_seqs=256)
    import aiohttp

    async with Runtime() as rt, OpenAIEndpoint() as ep, \
            aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        group = await rt.spawn("rollout", RolloutActor, asdict(ecfg), env={"OMP_NUM_THREADS": "1"})
        engine = RolloutClient(group)

        cpu: dict[str, list[float]] = {"direct": [], "http": [], "openai": []}
        tree: dict[str, list[float]] = {"direct": [], "http": [], "openai": []}

        async def run(path: str) -> tuple[float, list[list[int]]]:
            agent = make_agents(turns, [], http)[path]
            c0, tree0 = time.process_time(), _tree_cpu_s()
            t0 = time.perf_counter()
            trajs = await asyncio.gather(*(run_agent(
                agent, i, engine=engine, codec=codec, sample_id=f"{path}{i}-{time.time_ns()}",
                endpoint=None if path == "direct" else ep,
                config=RolloutConfig(sampling=SamplingParams(max_tokens=tokens, seed=1000 + i)))
                for i in range(sessions)))
            dt = time.perf_counter() - t0
            cpu[path].append((time.process_time() - c0) / (sessions * turns))
            for t in trajs:
                assert not t.failed and t.num_turns == turns, t.error
            gen = [[x for x, m in zip(t.token_ids, t.loss_mask, strict=True) if m]
                   for t in trajs]
            tree[path].append((_tree_cpu_s() - tree0) / sum(map(len, gen)))
            return sum(map(len, gen)) / dt, gen

        paths = ["direct", "http", "openai"]
        for path in paths:  # warm-up: engine, prefix cache, sockets
            await run(path)
        rates: dict[str, list[float]] = {p: [] for p in paths}
        same = True
        for k in range(rounds):
            out = {}
            for path in paths[k % 3:] + paths[:k % 3]:  # rotate the order each round
                rate, out[path] = await run(path)
                rates[path].append(rate)
            same &= out["direct"] == out["http"] == out["openai"]
        counts = {p: sum(map(len, g)) for p, g in out.items()}

    def ratio(path: str) -> float:
        return round(statistics.median(rates[path]) / statistics.median(rates["direct"]), 3)

    return {"throughput_ratio": ratio("http"),
            "throughput_ratio_by_round": [round(h / d, 3) for d, h in
                                          zip(rates["direct"], rates["http"], strict=True)],
            "throughput_ratio_openai_client": ratio("openai"),
            "throughput_ratio_openai_client_by_round": [
                round(o / d, 3) for d, o in zip(rates["direct"], rates["openai"], strict=True)],
            "direct_tok_s": round(statistics.median(rates["direct"])),
            "endpoint_tok_s": round(statistics.median(rates["http"])),
            "endpoint_openai_client_tok_s": round(statistics.median(rates["openai"])),
            "tokens_direct": counts["direct"], "tokens_endpoint": counts["http"],
            "tokens_endpoint_openai_client": counts["openai"],
            "same_tokens": same, "sessions": sessions, "turns": turns,
            "driver_cpu_ms_per_request": {p: round(statistics.median(c) * 1e3, 3)
                                          for p, c in cpu.items()},
            "cpu_ms_per_token": {p: round(statistics.median(c) * 1e3, 4) for p, c in tree.items()},
            "cpu_ratio": round(statistics.median(tree["direct"]) / statistics.median(tree["http"]),
                               3),
            "cpu_ratio_openai_client": round(statistics.median(tree["direct"])
                                             / statistics.median(tree["openai"]), 3),
            "max_tokens_per_turn": tokens}


async def main_async(args: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    from earl.agents.chat import ChatCodec
    from earl.models.tiny import build_tokenizer

    codec = ChatCodec(build_tokenizer())
    out: dict[str, object] = {"bench": "openai_endpoint", "quick": args.quick}
    out.update(await overhead(codec, sessions=8 if args.quick else 32, turns=8, tokens=32,
                              repeats=2 if args.quick else 3))
    if not args.no_throughput:
        out.update(await throughput(codec, sessions=args.sessions, turns=2 if args.quick else 4,
                                    tokens=32, rounds=args.rounds or (1 if args.quick else 3)))
    out["goal_overhead_met"] = out["overhead_ms_median"] <= 1.0  # type: ignore[operator]
    if "throughput_ratio" in out:
        out["goal_throughput_met"] = out["throughput_ratio"] >= 0.9  # type: ignore[operator]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object (the default)")
    p.add_argument("--quick", action="store_true", help="fewer sessions, turns and repeats")
    p.add_argument("--sessions", type=int, default=256, help="concurrent sessions (throughput)")
    p.add_argument("--rounds", type=int, default=0, help="throughput rounds (default 3; 1 quick)")
    p.add_argument("--no-throughput", action="store_true", help="skip the vLLM part")
    _results.add_flag(p)
    args = p.parse_args()
    begun = _results.start()
    import uvloop

    out = uvloop.run(main_async(args))
    print(json.dumps(out))
    if args.save:
        _results.save("openai_endpoint", out, quick=args.quick, begun=begun)


if __name__ == "__main__":
    main()
