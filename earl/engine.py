"""The engine interface agents talk to, and a simulated engine for tests and stress runs.

An engine turns prompt token ids into generated token ids with their sampling log-probs and the
policy version that produced each token. It knows nothing about chat templates, messages or tools:
that is `earl.agents.rollout`. The real implementation is the vLLM rollout actor
(`earl.stages.rollout`); `SimEngine` here replaces the model with a scripted responder and a
prefill/decode time model so thousands of agent sessions can run in one process.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from earl.runtime.types import ContextLengthError, Engine, Generation, SamplingParams

__all__ = [
    "ContextLengthError",
    "Engine",
    "Generation",
    "Responder",
    "SamplingParams",
    "SimConfig",
    "SimEngine",
    "SimStatistics",
]


# A responder plays the model in SimEngine: (prompt_ids, rng) -> token ids it "wants" to emit.
Responder = Callable[[list[int], random.Random], list[int]]


class _SplitMix(random.Random):
    """splitmix64 behind the `random.Random` API: seeding costs ~1 us instead of ~20 us for
    the Mersenne Twister, which matters when every simulated call gets a fresh seeded rng."""

    _MASK = (1 << 64) - 1

    def seed(self, a: object = None, version: int = 2) -> None:
        self._s = (a if isinstance(a, int) else 0) & self._MASK

    def getrandbits(self, k: int) -> int:
        out, bits = 0, 0
        while bits < k:
            self._s = (self._s + 0x9E3779B97F4A7C15) & self._MASK
            z = self._s
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & self._MASK
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & self._MASK
            out = (out << 64) | (z ^ (z >> 31))
            bits += 64
        return out >> (bits - k)

    def random(self) -> float:
        return self.getrandbits(53) / 9007199254740992.0


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """Time model and limits of the simulated engine.

    A call takes `overhead_s + prefill_s_per_token * uncached_prompt + decode_s_per_token * n_out`
    (scaled by `time_scale`). With `prefix_cache`, prompt tokens already seen for the same
    `session_id` are free, as with a real engine's prefix cache. `max_num_seqs` bounds how many
    calls run at once (a server's batch width); later calls queue, first come first served.
    """

    prefill_s_per_token: float = 2e-5
    decode_s_per_token: float = 1e-3
    overhead_s: float = 1e-3
    time_scale: float = 1.0
    max_model_len: int = 32768
    max_num_seqs: int | None = None
    vocab_size: int = 256
    prefix_cache: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "decode_s_per_token", "overhead_s", "time_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"SimConfig.max_num_seqs must be >= 1 or None, got {self.max_num_seqs}")
        if self.vocab_size < 2:
            raise ValueError(f"SimConfig.vocab_size must be >= 2, got {self.vocab_size}")


@dataclass(frozen=True, slots=True)
class SimStatistics:
    """Counters of a SimEngine: calls, tokens, simulated busy time and idle (bubble) time."""

    calls: int
    prompt_tokens: int
    generated_tokens: int
    simulated_s: float
    compute_s: float  # CPU spent playing the model (responder, sampling): simulated engine time
    busy_s: float
    idle_s: float
    in_flight: int

    @property
    def idle_fraction(self) -> float:
        total = self.busy_s + self.idle_s
        return self.idle_s / total if total > 0 else 0.0


class SimEngine:
    """A deterministic stand-in for a model server.

    Tokens come from `responder(prompt_ids, rng)` (default: random tokens); the rng is seeded from
    (config.seed, session_id, prompt length) or `params.seed`, so a session replays identically
    however calls interleave. Log-probs are those of a uniform distribution over the vocabulary.

    Example:
        >>> engine = SimEngine(SimConfig(time_scale=0.0))
        >>> gen = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_tokens=4)))
        >>> len(gen.token_ids) <= 4
        True
    """

    def __init__(self, config: SimConfig | None = None, responder: Responder | None = None) -> None:
        self.config = config or SimConfig()
        self._responder = responder
        self._version = 0
        self._cached: dict[str, int] = {}
        self._calls = self._prompt_tokens = self._gen_tokens = 0
        self._simulated = 0.0
        self._compute = 0.0
        self._sem: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None
        self._in_flight = 0
        self._busy = self._idle = 0.0
        self._last = time.perf_counter()
        self._logprob = -math.log(self.config.vocab_size)

    @property
    def policy_version(self) -> int:
        return self._version

    def set_policy_version(self, version: int) -> None:
        """Pretend new weights arrived: later tokens carry `version`."""
        self._version = version

    def end_session(self, session_id: str) -> None:
        """Drop the prefix-cache entry of a finished session (as `RolloutClient.end_session`)."""
        self._cached.pop(session_id, None)

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        if self._in_flight:
            self._busy += now - self._last
        else:
            self._idle += now - self._last
        self._last = now
        self._in_flight += delta

    def statistics(self) -> SimStatistics:
        self._tick(0)
        return SimStatistics(calls=self._calls, prompt_tokens=self._prompt_tokens,
                             generated_tokens=self._gen_tokens, simulated_s=self._simulated,
                             compute_s=self._compute,
                             busy_s=self._busy, idle_s=self._idle, in_flight=self._in_flight)

    def _slots(self) -> asyncio.Semaphore | None:
        if self.config.max_num_seqs is None:
            return None
        loop = asyncio.get_running_loop()
        if self._sem is None or self._sem[0] is not loop:
            self._sem = (loop, asyncio.Semaphore(self.config.max_num_seqs))
        return self._sem[1]

    def _rng(self, n_prompt: int, params: SamplingParams, session_id: str | None) -> random.Random:
        if params.seed is not None:
            return _SplitMix(params.seed)
        key = f"{self.config.seed}/{session_id}/{n_prompt}".encode()
        return _SplitMix(zlib.crc32(key))

    def _at_least(self, wanted: list[int], n: int, stops: set[int],
                  rng: random.Random) -> list[int]:
        """`wanted` with no stop token among its first `n` tokens, padded to `n` if shorter."""
        head = wanted[:n] + [rng.randrange(self.config.vocab_size)
                             for _ in range(n - len(wanted))]
        for i, tok in enumerate(head):
            while tok in stops and len(stops) < self.config.vocab_size:
                tok = (tok + 1) % self.config.vocab_size
            head[i] = tok
        return head + wanted[n:]

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        c0 = time.process_time()
        cfg = self.config
        n_prompt = len(prompt_ids)
        if n_prompt + params.max_tokens > cfg.max_model_len:
            raise ContextLengthError(
                f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len={cfg.max_model_len}; lower max_tokens or cap the trajectory")
        rng = self._rng(n_prompt, params, session_id)
        if self._responder is not None:
            wanted = self._responder(prompt_ids, rng)
        else:
            stop = params.stop_token_ids
            wanted = [rng.randrange(cfg.vocab_size) for _ in range(rng.randint(1, params.max_tokens))]
            if stop:
                wanted.append(stop[0])
        if params.min_tokens:  # stop tokens cannot end a turn before min_tokens (vLLM masks them)
            wanted = self._at_least(wanted, min(params.min_tokens, params.max_tokens),
                                    set(params.stop_token_ids), rng)
        out, finish = wanted, "length"
        stops = params.stop_token_ids
        for i, tok in enumerate(wanted):
            if i >= params.max_tokens:
                out = wanted[:i]
                break
            if tok in stops:
                out, finish = wanted[: i + 1], "stop"
                break
        else:
            out = wanted[: params.max_tokens]
            if len(out) < params.max_tokens and self._responder is not None:
                finish = "stop"  # the responder chose to end without a stop token
        cached = self._cached.get(session_id, 0) if (cfg.prefix_cache and session_id) else 0
        uncached = max(0, n_prompt - cached)
        delay = (cfg.overhead_s + cfg.prefill_s_per_token * uncached
                 + cfg.decode_s_per_token * len(out)) * cfg.time_scale
        version = self._version
        self._compute += time.process_time() - c0
        slots = self._slots()
        if slots is not None:
            await slots.acquire()
        self._tick(+1)
        try:
            await asyncio.sleep(delay)
        finally:
            self._tick(-1)
            if slots is not None:
                slots.release()
        if session_id is not None and cfg.prefix_cache:
            self._cached[session_id] = n_prompt + len(out)
        self._calls += 1
        self._prompt_tokens += n_prompt
        self._gen_tokens += len(out)
        self._simulated += delay
        n = len(out)
        return Generation(token_ids=list(out), logprobs=[self._logprob] * n, versions=[version] * n,
                          finish_reason=finish, prompt_tokens=n_prompt)
