"""An OpenAI-compatible `/v1/chat/completions` endpoint for rollout sessions, on loopback.

One `OpenAIEndpoint` per process serves every session of that process: `run_agent(...,
endpoint=ep)` registers the session's `Rollout`, whose `base_url`
(`http://127.0.0.1:PORT/s/<session>/v1`), `api_key` and `openai_client()` an agent written
against the `openai` package (or any framework on top of it) uses unchanged. Every request is
answered by the rollout's engine and recorded token-exactly (`earl.agents.openai_record`).
Requests need `Authorization: Bearer <api_key>` (one random key per endpoint); anything else gets
401 and its connection closed. The HTTP layer is aiohttp's low-level server (no router, no
middleware) guarded against other local users (`earl.agents.openai_http`: read timeout,
connection cap). A request body that is not in within `read_timeout_s` gets 408.

Request bodies over 64 KiB are parsed, and their prompts rendered, in one worker thread of the
endpoint, so that a large request does not hold up the small ones of other sessions. The JSON
parser and each call into the tokenizer still hold the GIL while they run: a body of many tiny
JSON values costs up to ~0.15 s per MiB, one long message ~1 s per million characters (tiny
test tokenizer).

`stream=true` is answered as server-sent events once the generation is complete: the engine
interface returns whole generations, so streaming changes the framing, not the latency.
`tool_choice="required"` or a named function is honoured by putting the opening of a tool call
(`<tool_call>` and, for a name, `{"name": ..., "arguments": `) at the start of the reply as
context tokens (loss mask 0); this assumes the Hermes/Qwen tool-call format of EARL's template.

A client's `max_tokens` (or `max_completion_tokens`) is honoured: the run's per-turn
`max_tokens` is the default for a request that leaves it out, not a ceiling (agent frameworks set
their own, often 96-4096). A request is served up to what is left of the session's
`max_total_tokens` and of the model's context window, and its reply then ends with
`finish_reason` "length"; a prompt that leaves no room gets a 400 naming the limit.
`parallel_tool_calls: false` gets at most one call. A reply cut at the cap (`finish_reason`
"length") is all content, never a tool call; a malformed call comes back as OpenAI reports one
(`earl.agents.openai_reply`). The tool results a client sends back for the calls the endpoint
returned are the episode's `info.tool_calls` and `info.tool_errors`.

This module does not validate requests (`earl.agents.openai_protocol`), keep the token record
(`earl.agents.openai_record`) or manage connections (`earl.agents.openai_http`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Self, TypeVar

from aiohttp import web

from earl.agents.openai_http import ConnectionStatistics, GuardedServer, connection_cap, serve
from earl.agents.openai_protocol import (
    APIError,
    ChatRequest,
    Choice,
    Limits,
    assistant_message,
    completion_body,
    parse_request,
    stream_body,
)
from earl.agents.openai_record import Prompt, SessionRecord, segment_trajectory
from earl.agents.openai_reply import ToolTally, reply_calls, stop_at, tokens_through
from earl.runtime.types import ContextLengthError, Generation, SamplingParams

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from earl.agents.rollout import Rollout

__all__ = ["EndpointConfig", "OpenAIEndpoint", "ServedSession"]

_JSON = "application/json"
_INLINE_BYTES = 64 << 10  # larger bodies are parsed and rendered in the worker thread
_LIMITS = Limits()
_T = TypeVar("_T")


@dataclass(kw_only=True, slots=True)
class EndpointConfig:
    """Settings of the endpoint.

    Args:
        model: the model name clients must send (`/v1/models` lists it).
        port: TCP port on 127.0.0.1; 0 picks a free one.
        max_n: the largest `n` a request may ask for.
        max_messages: the most `messages` a request may carry (larger: 400).
        max_tools: the most `tools` a request may carry (larger: 400).
        max_chars: the most characters of message text, tool-call arguments and tool
            definitions a request may carry (more: 400).
        max_request_bytes: larger request bodies get 413.
        read_timeout_s: a connection whose first request with the key has not arrived this long
            after it opened is closed; a request body not in this long after its headers gets
            408.
        max_connections: open connections kept before the oldest that never sent the key are
            closed; None: half the process's open-file limit (RLIMIT_NOFILE), at most 4096.
    """

    model: str = "earl-policy"
    port: int = 0
    max_n: int = _LIMITS.max_n
    max_messages: int = _LIMITS.max_messages
    max_tools: int = _LIMITS.max_tools
    max_chars: int = _LIMITS.max_chars
    max_request_bytes: int = 32 << 20
    read_timeout_s: float = 5.0
    max_connections: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"EndpointConfig.port must be in [0, 65535], got {self.port}")
        for name in ("max_n", "max_messages", "max_chars", "max_request_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"EndpointConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_tools < 0:
            raise ValueError(f"EndpointConfig.max_tools must be >= 0, got {self.max_tools}")
        if not self.read_timeout_s > 0:
            raise ValueError(f"EndpointConfig.read_timeout_s must be > 0 seconds, got "
                             f"{self.read_timeout_s}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"EndpointConfig.max_connections must be >= 1 or None (half the "
                             f"open-file limit), got {self.max_connections}")

    @property
    def limits(self) -> Limits:
        return Limits(max_n=self.max_n, max_messages=self.max_messages,
                      max_tools=self.max_tools, max_chars=self.max_chars)


class OpenAIEndpoint:
    """The process's chat-completions server; `async with OpenAIEndpoint() as ep:`.

    Example:
        >>> async with OpenAIEndpoint() as ep:
        ...     traj = await run_agent(agent, sample, engine=engine, codec=codec, endpoint=ep)
    """

    def __init__(self, config: EndpointConfig | None = None) -> None:
        self.config = config or EndpointConfig()
        self.api_key = "earl-" + secrets.token_urlsafe(32)
        self._parse = functools.partial(parse_request, model=self.config.model,
                                        limits=self.config.limits)
        self._sessions: dict[str, ServedSession] = {}
        self._server: GuardedServer | None = None
        self._runner: web.ServerRunner | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._http: _SharedHTTP | None = None
        self.port = 0

    async def start(self) -> None:
        """Bind 127.0.0.1 and start serving.

        Raises:
            ValueError: `EndpointConfig.max_connections` is over half the open-file limit.
        """
        cfg = self.config
        self._server = GuardedServer(self._handle, auth=f"Bearer {self.api_key}".encode(),
                                     max_connections=connection_cap(cfg.max_connections),
                                     read_timeout_s=cfg.read_timeout_s,
                                     max_body=cfg.max_request_bytes)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="earl-openai-parse")
        self._runner, self.port = await serve(self._server, cfg.port)

    def statistics(self) -> ConnectionStatistics:
        """The endpoint's connections now (all zero before `start`)."""
        if self._server is None:
            return ConnectionStatistics(open=0, untrusted=0, closed_untrusted=0)
        return self._server.statistics()

    def _in_worker(self, fn: Callable[..., _T], *args: object) -> asyncio.Future[_T]:
        """`fn(*args)` in the endpoint's worker thread (one: large requests take turns)."""
        return asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _http_client(self) -> _SharedHTTP:
        """The connection pool every session's `openai_client()` uses: building an AsyncOpenAI
        with its own pool costs ~18 ms of CPU (an SSL context), with a shared one ~1.5 ms."""
        if self._http is None:
            self._http = _shared_http()
        return self._http

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close_pool()
            self._http = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._worker is not None:
            self._worker.shutdown(wait=False, cancel_futures=True)
            self._worker = None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def serve(self, rollout: Rollout) -> ServedSession:
        """Register `rollout`; its session is reachable until `ServedSession.aclose()`."""
        if self._runner is None:
            raise RuntimeError("OpenAIEndpoint is not started; use `async with OpenAIEndpoint()`"
                               " or `await endpoint.start()`")
        token = secrets.token_urlsafe(12)
        session = ServedSession(self, rollout, token)
        self._sessions[token] = session
        return session

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        assert self._server is not None
        if not self._server.authorized(request.headers):
            return _error(APIError(401, "Incorrect or missing API key: send `Authorization: "
                                   "Bearer <rollout.api_key>`", code="invalid_api_key"),
                          close=True)
        parts = request.path.split("/")  # "", "s", token, "v1", ...
        session = self._sessions.get(parts[2]) if len(parts) > 3 and parts[1] == "s" else None
        if session is None:
            return _error(APIError(404, f"no live session at {request.path!r}; use the "
                                   "rollout's base_url while its agent runs",
                                   code="session_not_found"))
        route = "/".join(parts[3:])
        try:
            if route == "v1/chat/completions" and request.method == "POST":
                raw = await self._body(request)
                if len(raw) <= _INLINE_BYTES:
                    req = self._parse(raw)
                    body = await session.complete(req)
                else:
                    req = await self._in_worker(self._parse, raw)
                    body = await session.complete(req, offload=True)
                return web.Response(body=body, content_type="text/event-stream"
                                    if req.stream else _JSON)
            if route == "v1/models" and request.method == "GET":
                return web.Response(body=json.dumps({"object": "list", "data": [{
                    "id": self.config.model, "object": "model", "created": 0,
                    "owned_by": "earl"}]}).encode(), content_type=_JSON)
            raise APIError(404, f"unknown route {request.method} /{route}; this endpoint serves "
                           "POST /v1/chat/completions and GET /v1/models")
        except APIError as exc:
            return _error(exc, close=exc.status == 408)
        except Exception as exc:  # noqa: BLE001 - one bad request must not end the session
            return _error(APIError(500, f"internal error: {type(exc).__name__}: {exc}",
                                   type="server_error"))

    async def _body(self, request: web.BaseRequest) -> bytes:
        limit = self.config.max_request_bytes
        too_big = APIError(413, f"request body over {limit} bytes "
                           "(EndpointConfig.max_request_bytes)")
        if (request.content_length or 0) > limit:  # refuse before reading any of it
            raise too_big
        timeout = self.config.read_timeout_s
        try:
            if request.content.is_eof():  # all in already (most requests): no timer needed
                return await request.read()
            async with asyncio.timeout(timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_big from None
        except TimeoutError:
            raise APIError(408, f"the request body did not arrive within {timeout} s of its "
                           "headers (EndpointConfig.read_timeout_s)", code="timeout") from None


class _SharedHTTP(Protocol):
    async def close_pool(self) -> None: ...


def _shared_http() -> _SharedHTTP:
    """openai's aiohttp-backed httpx2 client (~0.3 ms less per request than its default
    transport), one keep-alive connection per concurrent session, that a session's
    `client.close()` (or `async with client:`) leaves open for the other sessions."""
    import httpx2
    from openai import DefaultAioHttpClient

    class SharedHTTP(DefaultAioHttpClient):  # type: ignore[misc,valid-type]
        async def aclose(self) -> None:
            pass

        async def close_pool(self) -> None:
            await super().aclose()

    return SharedHTTP(limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None))  # type: ignore[no-any-return]


def _error(exc: APIError, *, close: bool = False) -> web.Response:
    resp = web.Response(status=exc.status, body=json.dumps(exc.body()).encode(),
                        content_type=_JSON)
    if close:
        resp.force_close()
    return resp


class ServedSession:
    """One rollout served over HTTP: its URL, key, client, and token record."""

    def __init__(self, endpoint: OpenAIEndpoint, rollout: Rollout, token: str) -> None:
        self.endpoint, self.rollout, self.token = endpoint, rollout, token
        self.base_url = f"http://127.0.0.1:{endpoint.port}/s/{token}/v1"
        self.api_key = endpoint.api_key
        self.record = SessionRecord(rollout.codec)
        self.tally = ToolTally()
        self._rendering = asyncio.Lock()  # held while the worker renders one of its prompts
        self._client: AsyncOpenAI | None = None
        sampling = rollout.config.sampling
        self._stops = sorted(set(sampling.stop_token_ids) | set(rollout.codec.stop_ids))

    def client(self) -> AsyncOpenAI:
        """An `openai.AsyncOpenAI` for this session (one per session, closed with it)."""
        if self._client is None:
            from openai import AsyncOpenAI

            self._client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key,
                                       max_retries=0,
                                       http_client=self.endpoint._http_client())  # type: ignore[arg-type]
        return self._client

    async def aclose(self) -> None:
        """End the session: later requests get 404; the segments go into the rollout."""
        self.endpoint._sessions.pop(self.token, None)
        self._client = None  # its connection pool is the endpoint's
        r, segs = self.rollout, self.record.segments()
        if not segs:
            return
        main = segs[-1]
        r.token_ids, r.loss_mask = list(main.token_ids), list(main.loss_mask)
        r.logprobs, r.versions = list(main.logprobs), list(main.versions)
        r.turn_spans, r.truncated = list(main.turn_spans), main.truncated
        r.segments = [segment_trajectory(b, sample_id=f"{r.sample_id}/{k}", group_id=r.group_id)
                      for k, b in enumerate(segs[:-1])]
        r.info.setdefault("segments", len(segs))
        r.info.setdefault("requests", self.record.requests)
        r.info.setdefault("new_segment_requests", self.record.new_segments)

    async def complete(self, req: ChatRequest, *, offload: bool = False) -> bytes:
        """Answer and record one request; returns the response body.

        Args:
            req: the request.
            offload: render its prompt in the endpoint's worker thread (a large request).
        """
        r = self.rollout
        if r.turn_spans and not self.record.requests:
            raise APIError(409, "this session already used rollout.generate; an agent uses "
                           "either rollout.generate or the OpenAI endpoint, not both")
        ran, failed = self.tally.answered(req.tool_results)
        r.tool_calls += ran
        r.tool_errors += failed
        sampling = r.config.sampling
        record = self.record
        if offload:
            prompt = await self._render_in_worker(req)
        elif self._rendering.locked():
            async with self._rendering:
                prompt = record.prompt(req.messages, req.tools)
        else:
            prompt = record.prompt(req.messages, req.tools)
        forced = self._forced(req)
        ids = prompt.token_ids + forced
        cap = req.max_tokens or sampling.max_tokens
        budget, window = r.config.max_total_tokens, r.config.context_window
        limits: dict[str, int] = {}  # what is left under each limit the run knows, named for the error
        if budget is not None:
            limits[f"this session's budget (RolloutConfig.max_total_tokens={budget})"] = \
                budget - len(ids) - 1
        if window is not None:
            limits[f"the model's context window ({window} tokens, --model.max_model_len)"] = \
                window - len(ids)
        room = min([cap, *limits.values()])
        if room < 1:
            record.release(prompt)
            binding = min(limits, key=limits.__getitem__)
            raise APIError(400, f"the prompt ({len(ids)} tokens) leaves no room in {binding}",
                           param="messages", code="context_length_exceeded")
        cap = room  # served up to the budget or the window; the reply then ends "length"
        temperature = sampling.temperature if req.temperature is None else req.temperature
        params = [SamplingParams(max_tokens=cap, temperature=temperature,
                                 top_p=sampling.top_p if req.top_p is None else req.top_p,
                                 top_k=sampling.top_k, stop_token_ids=self._stops,
                                 seed=(sampling.seed if req.seed is None else req.seed + i)
                                 if req.n == 1 or req.seed is not None else None)
                  for i in range(req.n)]
        r.prompt_lengths.append(len(ids))
        t0 = time.perf_counter()
        try:
            if req.n == 1:
                gens = [await r.engine.generate(ids, params[0], session_id=r.sample_id)]
            else:
                async with asyncio.TaskGroup() as tg:
                    tasks = [tg.create_task(r.engine.generate(ids, p, session_id=r.sample_id))
                             for p in params]
                gens = [t.result() for t in tasks]
        except Exception as exc:  # noqa: BLE001 - the engine's failure is the client's 500
            record.release(prompt)
            while isinstance(exc, ExceptionGroup):
                exc = exc.exceptions[0]
            if isinstance(exc, ContextLengthError):
                raise APIError(400, str(exc), param="messages",
                               code="context_length_exceeded") from None
            raise APIError(500, f"the engine failed: {type(exc).__name__}: {exc}",
                           type="server_error") from None
        except BaseException:  # cancelled: the client went away
            record.release(prompt)
            raise
        finally:
            r.gen_time_s += time.perf_counter() - t0
        request = record.start()
        choices = [self._record(req, prompt, request, i, forced, g) for i, g in enumerate(gens)]
        record.commit(prompt)
        completion = sum(len(g.token_ids) for g in gens)
        usage = {"prompt_tokens": len(ids), "completion_tokens": completion,
                 "total_tokens": len(ids) + completion}
        cid = f"chatcmpl-{self.token}-{request}"
        created = int(time.time())
        if req.stream:
            return stream_body(cid, created, req.model, choices,
                               usage if req.include_usage else None)
        return completion_body(cid, created, req.model, choices, usage)

    async def _render_in_worker(self, req: ChatRequest) -> Prompt:
        """`record.prompt` in the worker thread. It takes a branch out of the record, so this
        session's other prompts wait for it, and if the request is cancelled meanwhile the
        branch goes back once the worker is done."""
        await self._rendering.acquire()
        try:
            fut = self.endpoint._in_worker(self.record.prompt, req.messages, req.tools)
        except BaseException:  # the endpoint is closed
            self._rendering.release()
            raise
        cancelled = False

        def done(f: asyncio.Future[Prompt]) -> None:
            if cancelled and not f.cancelled() and f.exception() is None:
                self.record.release(f.result())
            self._rendering.release()

        fut.add_done_callback(done)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            cancelled = True
            raise

    def _forced(self, req: ChatRequest) -> list[int]:
        if req.tool_choice in ("auto", "none"):
            return []
        text = "<tool_call>" if req.tool_choice == "required" else \
            '<tool_call>{"name": ' + json.dumps(req.tool_choice) + ', "arguments": '
        return self.rollout.codec.encode_text(text)

    def _record(self, req: ChatRequest, prompt: Prompt, request: int, index: int,
                forced: list[int], gen: Generation) -> Choice:
        codec = self.rollout.codec
        ids, finish = gen.token_ids, gen.finish_reason
        closed = bool(ids) and ids[-1] == codec.end_id
        body = ids[:-1] if ids and ids[-1] in self._stops else ids
        text = codec.decode(body)
        cut = stop_at(text, req.stop)
        if cut is not None:  # keep the model's tokens up to the one completing the stop string
            k = tokens_through(codec, body, cut[1])
            body, text, finish, closed = body[:k], text[:cut[0]], "stop", False
            gen = Generation(token_ids=body, logprobs=gen.logprobs[:k],
                             versions=gen.versions[:k], finish_reason="stop",
                             prompt_tokens=gen.prompt_tokens)
        text = codec.decode(forced) + text if forced else text
        content, calls = text, []
        if req.tools and req.tool_choice != "none" and finish != "length":
            names = {str(t["function"]["name"]) for t in req.tools}  # type: ignore[index]
            content, calls = reply_calls(text, names, parallel=req.parallel_tool_calls)
        wire = [(f"call_{request}_{index}_{j}", name, args if isinstance(args, str)
                 else json.dumps(args)) for j, (name, args) in enumerate(calls)]
        self.tally.returned(cid for cid, _, _ in wire)
        reply = assistant_message(content, calls)
        self.record.add(prompt, request, forced=forced, gen=gen, closed=closed, reply=reply)
        if calls:
            finish = "tool_calls"
        elif finish not in ("stop", "length"):
            finish = "stop"
        lps = [(codec.decode([t]), lp) for t, lp in zip(body, gen.logprobs, strict=False)] \
            if req.logprobs else None
        return Choice(content=content if content or not calls else None, tool_calls=wire,
                      finish_reason=finish, logprobs=lps)

