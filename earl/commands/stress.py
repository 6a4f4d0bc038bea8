"""`earl stress`: N concurrent multi-turn agent sessions against an engine and the tool executor.

Runs real agent loops (earl.agents) on real environments with a simulated engine by default
(`--engine vllm` uses the tiny model in vLLM), injects tool latency (fixed, lognormal, heavy
tail) and failures, and reports throughput, action completion time (ACT), engine bubbles,
context growth per turn, peak RSS and the runtime's own CPU cost per turn. `--compare` runs the
same workload on the elastic action-level executor and on the static per-session baseline.
Every session ends completed or failed (an agent error or timeout); the exit status is 1 when
any session failed. `--agent` sessions are also served at the OpenAI endpoint `earl train` gives
them (`earl.agents.openai_server`, HTTP on 127.0.0.1 with its key), so an agent written against
the `openai` client runs unchanged.

Example:
    earl stress --sessions 10000 --env tictactoe --engine sim --json
    earl stress --sessions 64 --env calc --arrival burst --compare --json --plot stress.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import random
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from earl.agents.chat import ChatCodec
from earl.agents.rollout import Agent, RolloutConfig, run_agent
from earl.agents.tools import JSONValue, Tool, ToolResult
from earl.engine import (
    Engine,
    Generation,
    SamplingParams,
    SimConfig,
    SimEngine,
    SimStatistics,
)

if TYPE_CHECKING:
    from earl.agents.openai_server import OpenAIEndpoint

ENVS = ("tictactoe", "connect4", "calc", "python")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="earl stress", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--sessions", type=int, default=1000, help="concurrent agent sessions (default 1000)")
    a("--env", choices=ENVS, default="tictactoe")
    a("--agent", help="your agent coroutine, PATH.py:NAME (with --tasks; replaces --env)")
    a("--tasks", help="JSONL file of samples for --agent (cycled over the sessions)")
    a("--engine", choices=("sim", "vllm"), default="sim")
    a("--executor", choices=("elastic", "static"), default="elastic")
    a("--compare", action="store_true", help="also run the other executor; report both")
    a("--json", action="store_true", help="print one JSON object")
    a("--plot", metavar="PATH", help="write a PNG of load over time, ACT and context length")
    a("--seed", type=int, default=0)
    a("--arrival", choices=("all", "burst", "poisson"), default="all")
    a("--burst-size", type=int, default=32)
    a("--burst-interval-s", type=float, default=1.0)
    a("--rate", type=float, default=100.0, help="poisson arrivals per second")
    a("--tool-latency", choices=("fixed", "lognormal", "heavy"), default="lognormal")
    a("--tool-latency-ms", type=float, default=50.0, help="mean injected tool latency")
    a("--tool-failure-rate", type=float, default=0.0)
    a("--tool-timeout-s", type=float, default=10.0)
    a("--tool-calls", type=int, default=1, help="calc/python: tool calls per session")
    a("--min-workers", type=int, default=0)
    a("--max-workers", type=int, default=8, help="elastic pool upper bound")
    a("--static-workers", type=int, default=None,
      help="sandboxes of the static baseline (default 2 x --max-workers)")
    a("--idle-s", type=float, default=2.0, help="elastic: close workers idle this long")
    a("--policy", choices=("sef", "fifo"), default="sef",
      help="elastic: shortest-expected-first or first-in-first-out")
    a("--decode-ms", type=float, default=1.0, help="sim engine: ms per generated token")
    a("--prefill-us", type=float, default=20.0, help="sim engine: us per uncached prompt token")
    a("--engine-overhead-ms", type=float, default=1.0, help="sim engine: ms per call")
    a("--max-num-seqs", type=int, default=None, help="sim engine: calls served at once")
    a("--illegal-rate", type=float, default=0.02, help="games: sim model's illegal-move rate")
    a("--max-tokens", type=int, default=256, help="per-turn token cap")
    a("--max-total-tokens", type=int, default=None, help="per-trajectory cap (default none)")
    a("--session-timeout-s", type=float, default=600.0)
    a("--model", default=None, help="HF folder for --engine vllm (default: the tiny model)")
    return p


def _check(args: argparse.Namespace) -> None:
    if bool(args.agent) != bool(args.tasks):
        raise ValueError("--agent PATH.py:NAME and --tasks FILE.jsonl go together")
    if args.sessions < 1:
        raise ValueError(f"--sessions must be >= 1, got {args.sessions}")
    if not 0 <= args.tool_failure_rate <= 1:
        raise ValueError(f"--tool-failure-rate must be in [0, 1], got {args.tool_failure_rate}")
    if args.tool_latency_ms < 0 or min(args.max_workers, args.burst_size, args.tool_calls) < 1:
        raise ValueError("--tool-latency-ms must be >= 0; --max-workers, --burst-size and "
                         "--tool-calls must be >= 1")


@dataclass(slots=True)
class LatencyModel:
    """Injected tool latency with a given mean: fixed, lognormal (sigma 1) or Pareto (alpha 1.5)."""

    kind: str
    mean_s: float

    def sample(self, rng: random.Random) -> float:
        if self.kind == "fixed" or self.mean_s == 0:
            return self.mean_s
        if self.kind == "lognormal":
            return rng.lognormvariate(math.log(self.mean_s) - 0.5, 1.0)
        alpha = 1.5
        return self.mean_s * (alpha - 1) / alpha * rng.paretovariate(alpha)


class _Injector:
    """A ToolRunner that adds latency/failures (in the worker) and records each action's ACT."""

    def __init__(self, inner: object, sim_tool: Tool, latency: LatencyModel, failure_rate: float,
                 rng: random.Random, acts: list[float]) -> None:
        self.inner, self.sim_tool, self.latency = inner, sim_tool, latency
        self.failure_rate, self.rng, self.acts = failure_rate, rng, acts

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult:
        wrapped = Tool(name=tool.name, fn=self.sim_tool.fn, schema=tool.schema,
                       ref=self.sim_tool.ref)
        args: dict[str, JSONValue] = {"ref": tool.ref, "arguments": arguments,
                                      "seconds": self.latency.sample(self.rng),
                                      "fail": self.rng.random() < self.failure_rate}
        t0 = time.perf_counter()
        res = await self.inner.run(wrapped, args, timeout_s=timeout_s)  # type: ignore[attr-defined]
        self.acts.append(time.perf_counter() - t0)
        return res


class _Meter:
    """Wraps any Engine; measures the time with no request in flight (engine bubbles)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.in_flight = 0
        self.busy = self.idle = 0.0
        self._last = time.perf_counter()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        if self.in_flight:
            self.busy += now - self._last
        else:
            self.idle += now - self._last
        self._last = now
        self.in_flight += delta

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        self._tick(+1)
        try:
            return await self.engine.generate(prompt_ids, params, session_id=session_id)
        finally:
            self._tick(-1)

    def idle_fraction(self) -> float:
        self._tick(0)
        total = self.busy + self.idle
        return self.idle / total if total else 0.0


@dataclass(slots=True)
class _Totals:
    completed: int = 0
    failed: int = 0
    truncated: int = 0
    turns: int = 0
    generated: int = 0
    context: dict[int, list[int]] = field(default_factory=dict)
    series: list[tuple[float, int, int, int]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)


def _idle_fraction(meter: _Meter | None, engine: Engine, before: object) -> float:
    if meter is not None:
        return meter.idle_fraction()
    assert isinstance(engine, SimEngine) and isinstance(before, SimStatistics)
    now = engine.statistics()
    busy, idle = now.busy_s - before.busy_s, now.idle_s - before.idle_s
    return idle / (busy + idle) if busy + idle > 0 else 0.0


def _pct(xs: Sequence[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _workload(args: argparse.Namespace, codec: ChatCodec, use_sim: bool):
    """(agent, sample_fn, responder) for the chosen env, or the user's --agent on --tasks (the
    simulated engine then plays the model with its default responder)."""
    if args.agent:
        from earl.recipe import ListTasks, load_agent, load_jsonl

        tasks = ListTasks(load_jsonl(args.tasks), seed=args.seed)
        return load_agent(args.agent), tasks.sample, None
    if args.env in ("tictactoe", "connect4"):
        from earl.agents.connect4 import connect4_agent, connect4_sim_responder
        from earl.agents.tictactoe import sim_responder, tictactoe_agent

        if args.env == "tictactoe":
            game, responder = tictactoe_agent, sim_responder(codec, illegal_rate=args.illegal_rate)
        else:
            game = connect4_agent
            responder = connect4_sim_responder(codec, illegal_rate=args.illegal_rate)
        return game, (lambda i: args.seed * 1_000_003 + i), responder if use_sim else None
    from earl.agents.calc import make_tool_agent, tool_sim_responder
    from earl.envs.arithmetic import ArithmeticProblems, calculator
    from earl.envs.python_tool import python

    problems = ArithmeticProblems(args.seed)
    tool = "calculator" if args.env == "calc" else "python"
    agent: Agent = make_tool_agent([calculator if args.env == "calc" else python],
                                   max_turns=args.tool_calls + 1)
    responder = tool_sim_responder(codec, tool, calls=args.tool_calls)
    return agent, problems.problem, responder if use_sim else None


def _arrival(args: argparse.Namespace, i: int, rng: random.Random, prev: float) -> float:
    if args.arrival == "burst":
        return (i // args.burst_size) * args.burst_interval_s
    if args.arrival == "poisson":
        return prev + rng.expovariate(args.rate)
    return 0.0


async def run_stress(args: argparse.Namespace, executor_kind: str, codec: ChatCodec,
                     engine: Engine) -> dict[str, Any]:
    """One stress run with `executor_kind`; returns the metrics dict."""
    from earl.envs import sim_tools
    from earl.runtime.tools import ExecutorConfig, ToolExecutor
    from earl.runtime.tools_static import StaticExecutor

    use_sim = isinstance(engine, SimEngine)
    agent, sample, responder = _workload(args, codec, use_sim)
    if isinstance(engine, SimEngine):
        engine = SimEngine(engine.config, responder=responder)
    # SimEngine measures its own busy/idle time; any other engine gets a wrapper that does.
    meter: _Meter | None = None if isinstance(engine, SimEngine) else _Meter(engine)
    gen_engine: Engine = engine if meter is None else meter
    rcfg = RolloutConfig(sampling=SamplingParams(max_tokens=args.max_tokens),
                         max_total_tokens=args.max_total_tokens,
                         tool_timeout_s=args.tool_timeout_s,
                         agent_timeout_s=args.session_timeout_s)
    uses_tools = args.env in ("calc", "python") and not args.agent
    static_workers = args.static_workers or 2 * args.max_workers
    if executor_kind == "static":
        executor = StaticExecutor(ExecutorConfig(max_workers=static_workers))
    else:
        executor = ToolExecutor(ExecutorConfig(min_workers=args.min_workers,
                                               max_workers=args.max_workers, idle_s=args.idle_s,
                                               policy=args.policy))
    sim_tool = Tool.from_function(sim_tools.simulated)
    latency = LatencyModel(args.tool_latency, args.tool_latency_ms / 1000)
    rng = random.Random(args.seed)
    acts: list[float] = []
    tot = _Totals()
    done = asyncio.Event()
    endpoint: OpenAIEndpoint | None = None  # --agent: started with the executor below
    arrivals, prev = [], 0.0
    for i in range(args.sessions):
        prev = _arrival(args, i, rng, prev)
        arrivals.append(prev)

    async def session(i: int, t_start: float) -> None:
        delay = t_start + arrivals[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sid = f"s{i}"
        runner = _Injector(executor.for_session(sid), sim_tool, latency, args.tool_failure_rate,
                           random.Random(args.seed * 7919 + i), acts) if uses_tools else None
        try:
            traj = await run_agent(agent, sample(i), engine=gen_engine, codec=codec, config=rcfg,
                                   executor=runner, sample_id=sid, endpoint=endpoint)
        finally:
            await executor.release_session(sid)
        if use_sim:
            engine.end_session(sid)  # type: ignore[attr-defined]
        if traj.failed:
            tot.failed += 1
            kind = (traj.error or "").split(":", 1)[0]
            tot.errors[kind] = tot.errors.get(kind, 0) + 1
            tot.examples.setdefault(kind, (traj.error or "")[:300])
        else:
            tot.completed += 1
        tot.truncated += traj.truncated
        tot.turns += len(traj.turn_spans)
        tot.generated += sum(traj.loss_mask)
        for k, (start, _) in enumerate(traj.turn_spans):
            tot.context.setdefault(k, []).append(start)

    async def monitor(t0: float) -> None:
        while not done.is_set():
            st = executor.statistics()
            in_flight = meter.in_flight if meter else engine.statistics().in_flight  # type: ignore[attr-defined]
            tot.series.append((time.perf_counter() - t0, in_flight, st.workers, st.queued))
            try:
                async with asyncio.timeout(0.05):
                    await done.wait()
            except TimeoutError:
                pass

    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(executor)
        if args.agent:  # served as `earl train`'s producers serve them (aiohttp only for --agent)
            from earl.agents.openai_server import OpenAIEndpoint

            endpoint = await stack.enter_async_context(OpenAIEndpoint())
            with contextlib.suppress(ImportError):  # not in the timed run (~0.25 s)
                import openai  # noqa: F401
        sim0 = engine.statistics().compute_s if use_sim else 0.0  # type: ignore[attr-defined]
        cpu0, t0 = time.process_time(), time.perf_counter()
        if meter is not None:
            meter.busy = meter.idle = 0.0
            meter._last = t0
        idle0 = engine.statistics() if isinstance(engine, SimEngine) else None
        async with asyncio.TaskGroup() as tg:
            mon = tg.create_task(monitor(t0))
            async with asyncio.TaskGroup() as sessions:
                for i in range(args.sessions):
                    sessions.create_task(session(i, t0))
            done.set()
            await mon
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        if use_sim:  # the simulated model's own CPU (responder, sampling) is engine time
            cpu -= engine.statistics().compute_s - sim0  # type: ignore[attr-defined]
        stats = executor.statistics()
    turns = max(tot.turns, 1)
    context = {str(k): {"n": len(v), "p50": _pct(v, 0.5), "p99": _pct(v, 0.99), "max": max(v)}
               for k, v in sorted(tot.context.items())}
    act_ms = [a * 1000 for a in acts]
    return {
        "env": args.agent or args.env, "engine": args.engine, "executor": executor_kind,
        "sessions": args.sessions,
        # every session ends completed or failed (run_agent turns any error into a failed
        # trajectory; anything else would have raised here)
        "sessions_completed": tot.completed, "sessions_failed": tot.failed,
        "sessions_truncated": tot.truncated, "failure_kinds": tot.errors,
        "failure_examples": tot.examples,
        "turns": tot.turns, "turns_per_s": tot.turns / wall, "tokens_per_s": tot.generated / wall,
        "wall_s": wall,
        "tool_calls": len(acts), "act_p50_ms": _pct(act_ms, 0.5), "act_p99_ms": _pct(act_ms, 0.99),
        "act_mean_ms": sum(act_ms) / len(act_ms) if act_ms else None,
        "workers_peak": stats.peak_workers, "workers_mean": stats.mean_workers,
        "workers_spawned": stats.spawned, "tool_timeouts": stats.timeouts,
        "engine_idle_fraction": _idle_fraction(meter, engine, idle0),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # Main-process CPU per turn: sim engine/tool time is sleeping or in workers, so
        # this is the runtime's own cost (agent loop, codec, scheduling, executor IPC).
        "overhead_us_per_turn": cpu / turns * 1e6 if use_sim else None,
        "context_len_per_turn": context,
        "_series": tot.series, "_acts_ms": act_ms,
    }


def _load_engine(args: argparse.Namespace):
    if args.engine == "sim":
        return SimEngine(SimConfig(decode_s_per_token=args.decode_ms / 1000,
                                   prefill_s_per_token=args.prefill_us / 1e6,
                                   overhead_s=args.engine_overhead_ms / 1000, seed=args.seed,
                                   max_num_seqs=args.max_num_seqs))
    try:
        from earl.stages.rollout import VLLMEngine  # type: ignore[attr-defined]
    except ImportError:
        from earl.stages.vllm_engine import VLLMEngine
    from earl.stages.vllm_engine import EngineConfig

    return VLLMEngine(EngineConfig(model=args.model))


async def _amain(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine == "sim" and args.model is None:
        from earl.models.tiny import build_tokenizer

        tokenizer: Any = build_tokenizer()
    else:
        from transformers import AutoTokenizer

        if args.model is None:
            from earl.models.tiny import default_model_dir

            args.model = str(default_model_dir())
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    codec = ChatCodec(tokenizer)
    engine = _load_engine(args)
    # Thousands of live sessions make full GC passes expensive: move what is loaded so far out
    # of the collector's view and collect young objects less often.
    gc.freeze()
    gc.set_threshold(50_000, 50, 100)
    kinds = [args.executor]
    if args.compare:
        kinds.append("static" if args.executor == "elastic" else "elastic")
    if args.engine == "vllm":
        async with engine:
            results = [await run_stress(args, k, codec, engine) for k in kinds]
    else:
        results = [await run_stress(args, k, codec, engine) for k in kinds]
    out = dict(results[0])
    if args.compare:
        by = {r["executor"]: r for r in results}
        e, s = by["elastic"], by["static"]
        public = {k: {x: r[x] for x in ("act_p50_ms", "act_p99_ms", "act_mean_ms",
                                        "workers_peak", "workers_mean", "turns_per_s",
                                        "sessions_completed", "sessions_failed", "wall_s")}
                  for k, r in by.items()}
        ratio = (s["act_mean_ms"] / e["act_mean_ms"]) if e["act_mean_ms"] and s["act_mean_ms"] \
            else None
        out["compare"] = public | {
            "act_mean_speedup": ratio,
            "act_p99_speedup": (s["act_p99_ms"] / e["act_p99_ms"]) if e["act_p99_ms"] else None,
            "worker_reduction": 1 - e["workers_peak"] / s["workers_peak"]
            if s["workers_peak"] else None}
        out["_others"] = results[1:]
    return out


def _plot(path: str, out: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [out, *out.get("_others", [])]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for r in runs:
        s = r["_series"]
        if s:
            t = [x[0] for x in s]
            ax[0].plot(t, [x[2] for x in s], label=f"{r['executor']} workers")
            ax[0].plot(t, [x[1] for x in s], "--", label=f"{r['executor']} engine in-flight")
        acts = sorted(r["_acts_ms"])
        if acts:
            ax[1].plot(acts, [i / len(acts) for i in range(len(acts))], label=r["executor"])
    ax[0].set(xlabel="s", title="load over time", yscale="symlog")
    ax[1].set(xlabel="ACT ms", ylabel="CDF", xscale="log", title="action completion time")
    ctx = out["context_len_per_turn"]
    ks = sorted(ctx, key=int)
    ax[2].plot([int(k) for k in ks], [ctx[k]["p50"] for k in ks], label="p50")
    ax[2].plot([int(k) for k in ks], [ctx[k]["max"] for k in ks], label="max")
    ax[2].set(xlabel="turn", ylabel="tokens", title="context length per turn")
    for a in ax:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check(args)
    except ValueError as exc:
        print(f"earl stress: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        out = uvloop.run(_amain(args))
    except ValueError as exc:  # a bad --agent or --tasks (named, with the fix)
        print(f"earl stress: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        _plot(args.plot, out)
    public = {k: v for k, v in out.items() if not k.startswith("_")}
    if args.json:
        print(json.dumps(public))
    else:
        for k, v in public.items():
            if k != "context_len_per_turn":
                print(f"{k:>24}: {v}")
    return 0 if public["sessions_failed"] == 0 else 1
