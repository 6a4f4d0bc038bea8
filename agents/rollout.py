"""The `rollout` object an agent coroutine receives, and `run_agent` that drives one session.

An agent is `async def agent(rollout, sample) -> float | None`. Inside it calls
`await rollout.generate(messages, tools=...)` for each assistant turn and
`await rollout.call_tool(call)` for each tool call; the rollout keeps the token-exact record
(ids, loss mask, log-probs, policy versions, turn spans, timings) and `run_agent` turns it into
a `Trajectory`, marking agents that raise or time out as failed instead of propagating.
This module does not sample tokens (the `Engine` does) or isolate tools (`earl.runtime.tools`).

Example:
    >>> async def agent(rollout, sample):
    ...     messages = [{"role": "user", "content": sample["question"]}]
    ...     while True:
    ...         turn = await rollout.generate(messages, tools=[calculator])
    ...         messages.append(turn.message)
    ...         if not turn.tool_calls or turn.truncated:
    ...             return float(turn.content.strip() == sample["answer"])
    ...         for call in turn.tool_calls:
    ...             messages.append(await rollout.call_tool(call))
"""

from __future__ import annotations

import asyncio
import dataclasses
import operator
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from earl.agents.chat import ChatCodec, Message
from earl.agents.tools import (
    Tool,
    ToolCall,
    ToolRunner,
    as_toolbox,
    check_arguments,
    parse_tool_calls,
)
from earl.engine import ContextLengthError, Engine, SamplingParams
from earl.runtime.tools import run_local
from earl.runtime.types import Trajectory

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from earl.agents.openai_server import OpenAIEndpoint, ServedSession

__all__ = ["Agent", "AssistantTurn", "Rollout", "RolloutConfig", "run_agent"]


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """Limits of one agent session.

    Args:
        sampling: sampling params; `max_tokens` is the per-turn token cap.
        max_total_tokens: per-trajectory cap (prompt included); None = no cap (the default:
            long trajectories are reported, not cut).
        context_window: the engine's context length (None: unknown), what the OpenAI endpoint
            serves a client's `max_tokens` up to.
        tool_timeout_s: per tool call.
        max_tool_output_chars: longer tool outputs are cut and marked.
        agent_timeout_s: the whole agent coroutine; None = no limit.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_total_tokens: int | None = None
    context_window: int | None = None
    tool_timeout_s: float = 30.0
    max_tool_output_chars: int = 4096
    agent_timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"RolloutConfig.max_total_tokens must be >= 1 or None, "
                             f"got {self.max_total_tokens}")
        if self.max_tool_output_chars < 16:
            raise ValueError("RolloutConfig.max_tool_output_chars must be >= 16, got "
                             f"{self.max_tool_output_chars}")


@dataclass(kw_only=True, slots=True)
class AssistantTurn:
    """One generated assistant turn.

    Attributes:
        text: the decoded generation (without the end token).
        content: text outside <tool_call> blocks.
        tool_calls: parsed calls; malformed ones have `error` set.
        message: the assistant message to append to your `messages`.
        finish_reason: "stop", "length", "abort" or "budget" (trajectory cap reached, nothing
            generated).
        truncated: a per-turn or per-trajectory cap cut this turn.
        num_tokens: generated tokens.
    """

    text: str
    content: str
    tool_calls: list[ToolCall]
    message: Message
    finish_reason: str
    truncated: bool
    num_tokens: int


Agent = Callable[["Rollout", object], Awaitable[float | None]]


class Rollout:
    """Per-session recorder handed to an agent coroutine (see the module docstring)."""

    def __init__(self, engine: Engine, codec: ChatCodec, *, sample_id: str, group_id: str,
                 config: RolloutConfig | None = None, executor: ToolRunner | None = None) -> None:
        self.engine, self.codec = engine, codec
        self.config = config or RolloutConfig()
        self.executor = executor
        self.sample_id, self.group_id = sample_id, group_id
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.turn_spans: list[tuple[int, int]] = []
        self.turn_rewards: list[float] = []
        self.info: dict[str, float | int | str] = {}
        self.truncated = False
        self.gen_time_s = self.tool_time_s = 0.0
        self.tool_latencies_s: list[float] = []  # per-action completion time, for ACT stats
        self.prompt_lengths: list[int] = []      # context length at each turn
        self.tool_calls = self.tool_errors = 0
        self._tools: dict[str, Tool] = {}
        self._tool_key: object = None
        self._history: list[Message] = []
        self._generating = False
        self._last: Message | None = None
        self.openai: ServedSession | None = None  # set by run_agent(endpoint=...)
        self.segments: list[Trajectory] = []  # the endpoint session's other segments
        self._params = dataclasses.replace(
            self.config.sampling,
            stop_token_ids=sorted(set(self.config.sampling.stop_token_ids) | set(codec.stop_ids)))

    @property
    def base_url(self) -> str:
        """OpenAI base URL of this session (`run_agent(..., endpoint=OpenAIEndpoint)`)."""
        return self._served().base_url

    @property
    def api_key(self) -> str:
        """The key the endpoint at `base_url` expects as `Authorization: Bearer <key>`."""
        return self._served().api_key

    def openai_client(self) -> AsyncOpenAI:
        """A ready `openai.AsyncOpenAI` for `base_url`, on the endpoint's shared connection pool
        (building one costs ~1.5 ms of CPU; one per session is kept)."""
        return self._served().client()

    def _served(self) -> ServedSession:
        if self.openai is None:
            raise RuntimeError("this rollout has no OpenAI endpoint: run the agent with "
                               "run_agent(..., endpoint=ep) inside `async with "
                               "earl.agents.openai_server.OpenAIEndpoint() as ep`")
        return self.openai

    def _set_tools(self, tools: Sequence[Tool | Callable[..., object]] | dict[str, Tool] | None
                   ) -> list[dict[str, object]] | None:
        key = tuple(id(t) for t in tools) if isinstance(tools, (list, tuple)) else id(tools)
        if key != self._tool_key:
            self._tools = as_toolbox(tools)  # type: ignore[arg-type]
            self._tool_key = key
        return [t.schema for t in self._tools.values()] or None

    def _append(self, ids: list[int], generated: bool) -> None:
        self.token_ids += ids
        self.loss_mask += [1 if generated else 0] * len(ids)
        if not generated:
            self.logprobs += [0.0] * len(ids)
            self.versions += [-1] * len(ids)

    async def generate(self, messages: list[Message],
                       tools: Sequence[Tool | Callable[..., object]] | dict[str, Tool] | None = None,
                       *, max_tokens: int | None = None) -> AssistantTurn:
        """Generate the next assistant turn for `messages`.

        `messages` must extend the list of the previous call: the same messages, then the
        returned `turn.message`, then new messages (tool results, observations). Tools are
        rendered into the first prompt; later calls only change which tools `call_tool` accepts.

        Raises:
            ValueError: `messages` does not extend the previous turn's messages.
        """
        if self._generating:
            raise RuntimeError("rollout.generate is already running for this session; await "
                               "each turn before starting the next")
        self._generating = True
        try:
            return await self._generate(messages, tools, max_tokens)
        finally:
            self._generating = False

    async def _generate(self, messages: list[Message],
                        tools: Sequence[Tool | Callable[..., object]] | dict[str, Tool] | None,
                        max_tokens: int | None) -> AssistantTurn:
        schemas = self._set_tools(tools)
        before = len(self.token_ids)
        if self._last is None:
            self._append(self.codec.encode_prompt(messages, schemas), generated=False)
        else:
            n = len(self._history)
            if len(messages) < n or not all(map(operator.is_, messages, self._history)):
                raise ValueError("messages must extend the previous call's messages with "
                                 "turn.message appended, then new messages; earlier messages "
                                 "cannot be edited (token-exact multi-turn)")
            self._append(self.codec.encode_continuation(messages[n:]), generated=False)
        params = self._params
        cap = max_tokens if max_tokens is not None else params.max_tokens
        if self.config.max_total_tokens is not None:
            cap = min(cap, self.config.max_total_tokens - len(self.token_ids) - 1)
        self.prompt_lengths.append(len(self.token_ids))
        if cap < 1:  # the trajectory cap is reached: drop the unanswerable observation
            self._cut(len(self.token_ids) + 1, "max_total_tokens")
            self._truncate_to(before)
            return self._budget_turn(messages)
        if cap != params.max_tokens:
            params = dataclasses.replace(params, max_tokens=cap)
        t0 = time.perf_counter()
        try:
            gen = await self.engine.generate(self.token_ids, params, session_id=self.sample_id)
        except ContextLengthError:
            self.gen_time_s += time.perf_counter() - t0
            self._cut(len(self.token_ids) + params.max_tokens, "context_window")
            self._truncate_to(before)
            return self._budget_turn(messages)
        self.gen_time_s += time.perf_counter() - t0
        start = len(self.token_ids)
        ids = gen.token_ids
        self.token_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += gen.logprobs
        self.versions += gen.versions
        self.turn_spans.append((start, len(self.token_ids)))
        truncated = gen.finish_reason != "stop"
        self.truncated |= truncated
        body = ids[:-1] if ids and ids[-1] in params.stop_token_ids else ids
        if not ids or ids[-1] != self.codec.end_id:
            # Close the turn so the next prompt stays well formed; the model is not trained on it.
            self._append([self.codec.end_id], generated=False)
        text = self.codec.decode(body)
        content, calls = parse_tool_calls(text)
        message: Message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.to_message() for c in calls if c.error is None]
        self._remember(messages, message)
        return AssistantTurn(text=text, content=content, tool_calls=calls, message=message,
                             finish_reason=gen.finish_reason, truncated=truncated,
                             num_tokens=len(ids))

    def _truncate_to(self, n: int) -> None:
        for col in (self.token_ids, self.loss_mask, self.logprobs, self.versions):
            del col[n:]

    def _remember(self, messages: list[Message], message: Message) -> None:
        self._history = [*messages, message]
        self._last = message

    def _cut(self, need: int, limit: str) -> None:
        """Record why the session was cut: `need` tokens (the prompt so far plus the turn's
        generation cap) did not fit `limit` ("context_window": the rollout's max_model_len;
        "max_total_tokens": the trajectory cap); "cut_first_turn" when no turn was generated."""
        self.info["cut"] = limit
        self.info["cut_need_tokens"] = need
        if not self.turn_spans:
            self.info["cut_first_turn"] = 1

    def _budget_turn(self, messages: list[Message]) -> AssistantTurn:
        self.truncated = True
        message: Message = {"role": "assistant", "content": ""}
        self._remember(messages, message)
        return AssistantTurn(text="", content="", tool_calls=[], message=message,
                             finish_reason="budget", truncated=True, num_tokens=0)

    async def call_tool(self, call: ToolCall, *, timeout_s: float | None = None) -> Message:
        """Run one tool call; return the tool message to append to `messages`.

        Malformed calls, unknown tools, bad arguments, exceptions, timeouts and non-string
        results all come back as an "Error: ..." message for the model, never as an exception.
        """
        timeout = self.config.tool_timeout_s if timeout_s is None else timeout_s
        t0 = time.perf_counter()
        ok, text = await self._run_tool(call, timeout)
        dt = time.perf_counter() - t0
        self.tool_time_s += dt
        self.tool_latencies_s.append(dt)
        self.tool_calls += 1
        if not ok:
            self.tool_errors += 1
            text = f"Error: {text}"
        try:
            text.encode()
        except UnicodeEncodeError:  # lone surrogates: tokenizers only take valid UTF-8
            text = text.encode("utf-8", "replace").decode()
        cap = self.config.max_tool_output_chars
        if len(text) > cap:
            text = f"{text[:cap]}\n[output truncated: {len(text) - cap} more characters]"
        return {"role": "tool", "name": call.name, "content": text}

    async def _run_tool(self, call: ToolCall, timeout: float) -> tuple[bool, str]:
        if call.error is not None:
            return False, call.error
        tool = self._tools.get(call.name)
        if tool is None:
            return False, f"unknown tool {call.name!r}; available tools: {sorted(self._tools)}"
        problem = check_arguments(tool, call.arguments)
        if problem is not None:
            return False, problem
        # Importable tools may go to the worker pool; a tool without a ref (a closure or bound
        # method with per-session state, or where="local") runs here, in the session's process.
        if self.executor is not None and tool.ref is not None:
            res = await self.executor.run(tool, call.arguments, timeout_s=timeout)
        else:
            res = await run_local(tool, call.arguments, timeout_s=timeout)
        return res.ok, res.output

    def trajectory(self, *, reward: float | None, failed: bool = False,
                   error: str | None = None) -> Trajectory:
        """Freeze the record into a Trajectory (called by `run_agent`)."""
        info = dict(self.info)
        info.setdefault("turns", len(self.turn_spans))
        info.setdefault("tool_calls", self.tool_calls)
        info.setdefault("tool_errors", self.tool_errors)
        traj = Trajectory(sample_id=self.sample_id, group_id=self.group_id,
                          token_ids=list(self.token_ids), loss_mask=list(self.loss_mask),
                          logprobs=list(self.logprobs), versions=list(self.versions),
                          turn_spans=list(self.turn_spans), turn_rewards=list(self.turn_rewards),
                          reward=reward, truncated=self.truncated, failed=failed, error=error,
                          gen_time_s=self.gen_time_s, tool_time_s=self.tool_time_s, info=info)
        traj.validate()
        return traj


async def run_agent(agent: Agent, sample: object, *, engine: Engine, codec: ChatCodec,
                    config: RolloutConfig | None = None, executor: ToolRunner | None = None,
                    sample_id: str | None = None, group_id: str | None = None,
                    endpoint: OpenAIEndpoint | None = None,
                    segments: list[Trajectory] | None = None) -> Trajectory:
    """Run `agent(rollout, sample)` to completion and return its Trajectory.

    An agent that raises, times out (`config.agent_timeout_s`), returns a non-number, or leaves
    inconsistent turn rewards gives a trajectory with `failed=True`, `reward=None` and `error`.
    With `endpoint`, the session is also served over HTTP (`rollout.base_url`); when its client
    rewrote history, the returned Trajectory is the last segment and the earlier ones, with the
    same reward and status, are appended to `segments` (see `earl.agents.openai_record`).
    """
    sid = sample_id or uuid.uuid4().hex
    rollout = Rollout(engine, codec, sample_id=sid, group_id=group_id or sid, config=config,
                      executor=executor)
    if endpoint is not None:
        rollout.openai = endpoint.serve(rollout)
    traj = await _drive(agent, rollout, sample)
    if segments is not None:
        segments += [dataclasses.replace(s, reward=traj.reward, failed=traj.failed,
                                         error=traj.error) for s in rollout.segments]
    return traj


async def _drive(agent: Agent, rollout: Rollout, sample: object) -> Trajectory:
    timeout = rollout.config.agent_timeout_s
    try:
        async with asyncio.timeout(timeout):
            try:
                reward = await agent(rollout, sample)
            finally:
                if rollout.openai is not None:
                    await rollout.openai.aclose()
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise TypeError(f"agent returned {type(reward).__name__}; return a float reward "
                            "or None to reject the trajectory")
        return rollout.trajectory(reward=None if reward is None else float(reward))
    except TimeoutError as exc:  # the agent's own TimeoutError too, when no limit is set
        error = (f"agent timed out after {timeout:g} s (RolloutConfig.agent_timeout_s)"
                 if timeout is not None else f"TimeoutError: {exc}")
    except Exception as exc:  # noqa: BLE001 - any agent bug fails this trajectory only
        error = f"{type(exc).__name__}: {exc}"
    try:
        return rollout.trajectory(reward=None, failed=True, error=error)
    except ValueError as exc:  # inconsistent turn rewards: drop them, keep the tokens
        rollout.turn_rewards = []
        return rollout.trajectory(reward=None, failed=True, error=f"{error}; {exc}")
