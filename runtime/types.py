"""The types both sides of the runtime share, defined once: engine I/O, trajectories, tools, and
the transfer dock's column schema.

This is the lowest module of EARL: it imports only the standard library (transformers lazily, in
`Tool.from_function`). The actor runtime, the stage actors, the agent API and the RL loop all
import these names from here (the public API re-exports them from `earl`). It defines no
behaviour beyond validation of its own fields.
"""

from __future__ import annotations

import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias, runtime_checkable

__all__ = [
    "COLUMNS", "ContextLengthError", "Engine", "Generation", "JSONValue", "SamplingParams", "Tool",
    "ToolCall", "ToolResult", "ToolRunner", "Trajectory", "column_dtype", "to_text",
]

JSONValue: TypeAlias = "None | bool | int | float | str | list[JSONValue] | dict[str, JSONValue]"

# The dock's per-sample columns: name -> numpy dtype name. Producers put them, consumers fetch
# them by these names; one definition for the rollout side, the reference and the trainer.
COLUMNS: dict[str, str] = {
    "input_ids": "int64",         # the whole conversation, prompt included
    "loss_mask": "int8",          # 1 on tokens the policy generated and is trained on
    "advantages": "float32",      # per-token advantage
    "rollout_logprobs": "float32",  # sampling log-prob (behaviour policy), NaN where unknown
    "versions": "int32",          # policy version that sampled each token, -1 elsewhere
    "ref_logprobs": "float32",    # the reference model's log-prob of each trained token
    "rewards": "float32",         # per-token reward (rule or reward-model scores)
    "values": "float32",          # per-token value estimate
}


def column_dtype(name: str) -> str:
    """The numpy dtype name of dock column `name`.

    Raises:
        KeyError: `name` is not a dock column (the message lists them).
    """
    if name not in COLUMNS:
        raise KeyError(f"unknown dock column {name!r}; columns are {sorted(COLUMNS)}")
    return COLUMNS[name]

@dataclass(kw_only=True, slots=True)
class SamplingParams:
    """How to sample one assistant turn.

    Args:
        max_tokens: cap on generated tokens for this call (the per-turn cap).
        min_tokens: generate at least min(min_tokens, max_tokens) tokens: stop tokens (EOS
            included) cannot end the turn earlier (benchmarks set it to `max_tokens` for the
            same work per call).
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass.
        top_k: keep the k most likely tokens; -1 keeps all.
        stop_token_ids: generation stops after emitting any of these (the token is kept).
        seed: per-request seed; None lets the engine pick.
    """

    max_tokens: int = 64
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"SamplingParams.min_tokens must be >= 0, got {self.min_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")


@dataclass(kw_only=True, slots=True)
class Generation:
    """One engine call's output.

    Attributes:
        token_ids: generated tokens, including the stop token when one was hit.
        logprobs: sampling log-prob of each generated token.
        versions: policy version that produced each generated token.
        finish_reason: "stop" (stop token), "length" (max_tokens) or "abort".
        prompt_tokens: length of the prompt the engine saw.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    prompt_tokens: int


@runtime_checkable
class Engine(Protocol):
    """What an agent's rollout needs from a generator."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation: ...

    @property
    def policy_version(self) -> int: ...


class ContextLengthError(ValueError):
    """The prompt plus `max_tokens` exceeds the engine's context length."""


@dataclass(kw_only=True, slots=True)
class Trajectory:
    """One multi-turn sample.

    Attributes:
        sample_id: unique id of this trajectory.
        group_id: id shared by trajectories of the same prompt (GRPO groups).
        token_ids: the whole conversation as token ids, prompt included.
        loss_mask: 1 for tokens the model generated, 0 for prompt/tool/observation tokens.
        logprobs: sampling log-prob per token (0.0 where loss_mask is 0).
        versions: policy version per token (-1 where loss_mask is 0).
        turn_spans: [start, end) of each assistant turn in token_ids.
        turn_rewards: optional per-turn reward (per-move credit); [] when unused.
        reward: scalar reward; None when the agent rejected the trajectory.
        truncated: a per-turn or per-trajectory token cap was hit.
        failed: the agent raised or timed out.
        error: the error text when failed.
        gen_time_s: wall time spent waiting on the engine.
        tool_time_s: wall time spent waiting on tools.
        info: small scalars about the episode, e.g. {"outcome": "win", "illegal": 0}.
    """

    sample_id: str
    group_id: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_spans: list[tuple[int, int]] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward: float | None = None
    truncated: bool = False
    failed: bool = False
    error: str | None = None
    gen_time_s: float = 0.0
    tool_time_s: float = 0.0
    info: dict[str, float | int | str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_turns(self) -> int:
        return len(self.turn_spans)

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)

    def validate(self) -> None:
        """Raise ValueError if the per-token columns or turn spans are inconsistent."""
        n = len(self.token_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"Trajectory.{name} has {len(getattr(self, name))} entries, "
                                 f"token_ids has {n}; every per-token column needs one per token")
        prev = 0
        for start, end in self.turn_spans:
            if not prev <= start <= end <= n:
                raise ValueError(f"Trajectory.turn_spans entry {(start, end)} is out of order or "
                                 f"outside [0, {n}]")
            prev = end
        if self.turn_rewards and len(self.turn_rewards) != len(self.turn_spans):
            raise ValueError(f"Trajectory.turn_rewards has {len(self.turn_rewards)} entries for "
                             f"{len(self.turn_spans)} turns; give one per turn or none")


@dataclass(kw_only=True, slots=True)
class ToolCall:
    """One tool call parsed from the model's text.

    Attributes:
        name: the tool name ("" when it could not be read).
        arguments: keyword arguments for the tool.
        raw: the text inside the <tool_call> block.
        error: why the call is malformed, or None when it is well formed.
        id: position of the call in its turn ("call_0", ...).
    """

    name: str
    arguments: dict[str, JSONValue] = field(default_factory=dict)
    raw: str = ""
    error: str | None = None
    id: str = "call_0"

    def to_message(self) -> dict[str, object]:
        """The OpenAI/HF `tool_calls` entry for an assistant message."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(kw_only=True, slots=True)
class Tool:
    """A callable the model may use.

    Attributes:
        name: the name the model calls it by.
        fn: the function; sync or async, returns a string (other JSON values are dumped).
        schema: the JSON schema handed to the chat template.
        ref: "module:qualname" a worker process imports it by: the tool may run on the shared
            worker pool. None: it runs in the agent's own process (closures, bound methods and
            other callables that carry per-session state, or `where="local"`).
    """

    name: str
    fn: Callable[..., object]
    schema: dict[str, object]
    ref: str | None = None

    @classmethod
    def from_function(cls, fn: Callable[..., object], name: str | None = None, *,
                      where: str = "auto") -> Tool:
        """Build a tool from a typed function with a Google-style docstring.

        Args:
            fn: the function (or any callable: a closure or bound method keeps its state).
            name: the name the model calls it by (default: the function's).
            where: "auto" (the worker pool when a fresh process can import `fn`, else the
                agent's process), "worker" (must be importable) or "local" (always in-process).

        Raises:
            TypeError: a parameter lacks a type hint or the docstring lacks an Args entry, or
                `where="worker"` for a callable a worker cannot import.
            ValueError: `where` is not one of the three.
        """
        if where not in ("auto", "worker", "local"):
            raise ValueError(f"Tool where={where!r}: choose 'auto', 'worker' or 'local'")
        from transformers.utils import get_json_schema

        if not callable(fn):
            raise TypeError(f"tool must be a callable, got {type(fn).__name__}")
        try:
            schema = get_json_schema(fn)
        except Exception as exc:  # transformers raises its own DocstringParsingException types
            raise TypeError(f"cannot make a tool schema from {fn.__qualname__}: {exc}. Give every "
                            "parameter a type hint and an `Args:` docstring entry") from exc
        schema["function"].pop("return", None)  # type: ignore[union-attr]
        if name is not None:
            schema["function"]["name"] = name  # type: ignore[index]
        ref = None if where == "local" else _worker_ref(fn)
        if where == "worker" and ref is None:
            raise TypeError(f"tool {getattr(fn, '__qualname__', fn)!r} cannot run on a worker: "
                            "a worker imports it by module and name, so define it as a "
                            "module-level function in an importable module (not __main__, a "
                            "closure or a bound method), or use where='local'")
        return cls(name=name or fn.__name__, fn=fn, schema=schema, ref=ref)

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


def _worker_ref(fn: Callable[..., object]) -> str | None:
    """"module:qualname" when a fresh process can import exactly `fn` by it, else None."""
    if not inspect.isfunction(fn):  # bound methods, partials, callable objects: state
        return None
    module, qual = fn.__module__, fn.__qualname__
    mod = sys.modules.get(module)
    if mod is None or module in ("__main__", "__mp_main__") or "<" in qual:
        return None
    obj: object = mod
    for part in qual.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn:
        return None
    top = module.partition(".")[0]  # found by the import system, not loaded from a bare file
    if not any(getattr(f, "find_spec", None) and f.find_spec(top, None) for f in sys.meta_path):
        return None
    return f"{module}:{qual}"


@dataclass(kw_only=True, slots=True)
class ToolResult:
    """Outcome of running one tool call.

    Attributes:
        ok: the tool returned normally.
        output: its text (or the error text when not ok).
        error: short error kind when not ok ("timeout", "exception", "crashed", ...).
        queued_s: time waiting for a worker.
        run_s: time running on a worker.
    """

    ok: bool
    output: str
    error: str | None = None
    queued_s: float = 0.0
    run_s: float = 0.0


class ToolRunner(Protocol):
    """Where tool calls run: `earl.runtime.tools.ToolExecutor` implements this."""

    async def run(self, tool: Tool, arguments: dict[str, JSONValue], *,
                  timeout_s: float | None = None) -> ToolResult: ...


def to_text(value: object) -> str:
    """A tool's return value as text: str as is, other JSON values dumped, else TypeError."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"tool returned {type(value).__name__}, which is not a string or JSON "
                        "value; return a str") from exc
