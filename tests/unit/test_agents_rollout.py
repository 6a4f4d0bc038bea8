"""Agent loop API: token-exact multi-turn, loss mask, tool calls and their failure modes."""

from __future__ import annotations

import asyncio

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tools import Tool, parse_tool_calls
from earl.engine import Generation, SamplingParams, SimConfig, SimEngine
from earl.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: e.g. "3 * (4 + 5)".
    """
    return str(eval(expression, {"__builtins__": {}}))  # test-only, inputs are ours


def scripted(codec: ChatCodec, replies: list[str]):
    """A SimEngine responder that plays `replies` in order (one per turn) and records prompts."""
    prompts: list[list[int]] = []

    def respond(prompt_ids, rng):
        prompts.append(list(prompt_ids))
        return codec.encode_text(replies[len(prompts) - 1]) + [codec.end_id]

    return respond, prompts


def test_multi_turn_is_token_exact_and_masked(codec: ChatCodec) -> None:
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>'
    respond, prompts = scripted(codec, [call, "The answer is 42."])
    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)

    async def agent(rollout, sample):
        messages = [{"role": "user", "content": sample}]
        while True:
            turn = await rollout.generate(messages, tools=[calculator])
            messages.append(turn.message)
            if not turn.tool_calls:
                rollout.info["final"] = turn.content
                return 1.0 if "42" in turn.content else 0.0
            for c in turn.tool_calls:
                messages.append(await rollout.call_tool(c))

    traj = asyncio.run(run_agent(agent, "What is 6*7?", engine=engine, codec=codec))
    assert traj.reward == 1.0 and not traj.failed and not traj.truncated
    assert len(traj.turn_spans) == 2 and traj.info["tool_calls"] == 1
    # Turn 2's prompt is exactly turn 1's prompt + sampled tokens + new tokens (no drift).
    (s0, e0), (s1, e1) = traj.turn_spans
    assert prompts[0] == traj.token_ids[:s0]
    assert prompts[1] == traj.token_ids[:s1] and prompts[1][:e0] == traj.token_ids[:e0]
    # The loss mask is 1 exactly on the generated spans.
    ones = [i for i, m in enumerate(traj.loss_mask) if m]
    assert ones == list(range(s0, e0)) + list(range(s1, e1))
    assert all(v == -1 for v, m in zip(traj.versions, traj.loss_mask) if not m)
    # The whole trajectory equals the template rendering of the final conversation.
    messages = [{"role": "user", "content": "What is 6*7?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "calculator",
                                                      "arguments": {"expression": "6*7"}}}]},
                {"role": "tool", "name": "calculator", "content": "42"},
                {"role": "assistant", "content": "The answer is 42."}]
    full = codec.encode_text(codec.render(messages, [Tool.from_function(calculator).schema],
                                          add_generation_prompt=False))
    assert traj.token_ids == full[: len(traj.token_ids)]
    assert codec.decode(traj.token_ids[e0:s1]).count("<tool_response>42</tool_response>") == 1


def test_continuation_frame_cache_matches_template(codec: ChatCodec) -> None:
    msgs = [{"role": "tool", "name": "calculator", "content": c} for c in ("1", " two ", "")]
    for _ in range(4):  # first uses render, later uses the cached frame: same text every time
        for k in (1, 2, 3):
            assert codec.continuation_text(msgs[:k]) == codec._delta(msgs[:k])
    user = [{"role": "user", "content": "Board:\n1 2 3"}]
    assert codec.continuation_text(user) == codec._delta(user)


def test_prompt_frame_cache_matches_template(codec: ChatCodec) -> None:
    schema = [Tool.from_function(calculator).schema]
    questions = ["What is 2+2?", "  spaced  ", "", "line\nbreak", "x" * 300, "<tool_call>"]
    for tools in (schema, None):
        for _ in range(3):
            for q in questions:
                msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]
                assert codec.prompt_text(msgs, tools) == codec.render(msgs, tools)
                assert codec.encode_prompt(msgs, tools) == list(codec._encode_raw(
                    codec.render(msgs, tools)))


def test_codec_falls_back_when_the_template_transforms_content() -> None:
    tok = build_tokenizer()
    tok.chat_template = tok.chat_template.replace(
        "<tool_response>{{ message.content }}", "<tool_response>{{ message.content | trim }}")
    codec = ChatCodec(tok)
    msgs = [{"role": "tool", "content": c} for c in ("a", "b", "c", "  padded  ", "d")]
    for m in msgs:  # content with edge whitespace never uses the cached frame
        assert codec.continuation_text([m]) == codec._delta([m])
    assert "<tool_response>padded</tool_response>" in codec.continuation_text([msgs[3]])


@pytest.mark.parametrize("text,error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 1}}</tool_call>', "type"),
    ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "unknown tool"),
    ('<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>', "unexpected"),
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>{"name": "calculator"', "unclosed"),
    ('<tool_call>["calculator"]</tool_call>', "JSON object"),
])
def test_malformed_tool_calls_become_error_observations(codec, text, error) -> None:
    respond, _ = scripted(codec, [text, "done"])
    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)
    seen: list[str] = []

    async def agent(rollout, sample):
        messages = [{"role": "user", "content": "go"}]
        turn = await rollout.generate(messages, tools=[calculator])
        messages.append(turn.message)
        assert len(turn.tool_calls) == 1
        obs = await rollout.call_tool(turn.tool_calls[0])
        seen.append(obs["content"])
        messages.append(obs)
        await rollout.generate(messages)
        return 0.0

    traj = asyncio.run(run_agent(agent, None, engine=engine, codec=codec))
    assert not traj.failed, traj.error
    assert seen[0].startswith("Error:") and error in seen[0]
    assert traj.info["tool_errors"] == 1


def test_tool_failures_are_observations(codec: ChatCodec) -> None:
    def boom(x: int) -> str:
        """Fail.

        Args:
            x: anything.
        """
        raise RuntimeError("kaput")

    async def slow(x: int) -> str:
        """Hang.

        Args:
            x: anything.
        """
        await asyncio.sleep(10)
        return "never"

    def huge(x: int) -> dict:
        """Big and not a string.

        Args:
            x: size.
        """
        return {"data": "é" * x}

    def surrogate(x: int) -> str:
        """Invalid UTF-8 in a str.

        Args:
            x: anything.
        """
        return "half \ud800 pair"

    def bad(x: int) -> object:
        """Not JSON.

        Args:
            x: anything.
        """
        return object()

    def call(name: str) -> str:
        return f'<tool_call>{{"name": "{name}", "arguments": {{"x": 100000}}}}</tool_call>'

    respond, _ = scripted(codec, [call("boom"), call("slow"), call("huge"), call("bad"),
                                  call("surrogate"), "end"])
    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)
    outs: list[str] = []

    async def agent(rollout, sample):
        messages = [{"role": "user", "content": "go"}]
        for _ in range(5):
            turn = await rollout.generate(messages, tools=[boom, slow, huge, bad, surrogate])
            messages.append(turn.message)
            obs = await rollout.call_tool(turn.tool_calls[0], timeout_s=0.05)
            outs.append(obs["content"])
            messages.append(obs)
        await rollout.generate(messages)
        return 1.0

    cfg = RolloutConfig(max_tool_output_chars=100)
    traj = asyncio.run(run_agent(agent, None, engine=engine, codec=codec, config=cfg))
    assert not traj.failed, traj.error
    assert "RuntimeError: kaput" in outs[0] and "timed out" in outs[1]
    assert outs[2].startswith('{"data": "éé') and "output truncated" in outs[2]
    assert len(outs[2]) < 200
    assert outs[3].startswith("Error:") and "not a string" in outs[3]
    assert outs[4] == "half ? pair"
    assert traj.info["tool_errors"] == 3


def test_caps_mark_truncated_without_failing(codec: ChatCodec) -> None:
    respond, _ = scripted(codec, ["x" * 50, "y" * 50, "z" * 50])
    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)

    async def agent(rollout, sample):
        messages = [{"role": "user", "content": "go"}]
        turns = []
        for _ in range(3):
            turn = await rollout.generate(messages)
            turns.append(turn)
            messages += [turn.message, {"role": "user", "content": "again"}]
        return float(len(turns))

    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=20), max_total_tokens=80)
    traj = asyncio.run(run_agent(agent, None, engine=engine, codec=codec, config=cfg))
    assert traj.truncated and not traj.failed and traj.reward == 3.0
    assert all(e - s <= 20 for s, e in traj.turn_spans)
    assert len(traj.token_ids) <= 80
    # Without caps the same script is not truncated: no hard truncation by default.
    respond, _ = scripted(codec, ["x" * 50, "y" * 50, "z" * 50])
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=512))
    traj = asyncio.run(run_agent(agent, None, engine=SimEngine(SimConfig(time_scale=0.0),
                                                               responder=respond),
                                 codec=codec, config=cfg))
    assert not traj.truncated and len(traj.turn_spans) == 3


def test_bad_agents_fail_their_trajectory_only(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0))

    async def raises(rollout, sample):
        await rollout.generate([{"role": "user", "content": "hi"}])
        raise KeyError("oops")

    async def hangs(rollout, sample):
        await asyncio.sleep(60)

    async def returns_str(rollout, sample):
        return "1.0"

    async def edits_history(rollout, sample):
        m = [{"role": "user", "content": "hi"}]
        turn = await rollout.generate(m)
        await rollout.generate([{"role": "user", "content": "changed"}, turn.message])

    async def overlaps(rollout, sample):
        m = [{"role": "user", "content": "hi"}]
        await asyncio.gather(rollout.generate(m), rollout.generate(m))

    async def main():
        cfg = RolloutConfig(agent_timeout_s=0.1)
        return await asyncio.gather(*(run_agent(a, None, engine=engine, codec=codec, config=cfg)
                                      for a in (raises, hangs, returns_str, edits_history,
                                                overlaps)))

    t_raise, t_hang, t_str, t_edit, t_overlap = asyncio.run(main())
    assert t_overlap.failed and "already running" in t_overlap.error
    assert t_raise.failed and "KeyError" in t_raise.error and len(t_raise.turn_spans) == 1
    assert t_hang.failed and "timed out" in t_hang.error
    assert t_str.failed and "return a float" in t_str.error
    assert t_edit.failed and "extend" in t_edit.error


def test_parse_tool_calls_keeps_content() -> None:
    content, calls = parse_tool_calls('I will add.\n<tool_call>{"name": "a", "arguments": '
                                      '"{\\"x\\": 1}"}</tool_call>')
    assert content == "I will add." and calls[0].name == "a" and calls[0].arguments == {"x": 1}
    assert parse_tool_calls("plain") == ("plain", [])


def test_sim_engine_is_deterministic_and_respects_caps() -> None:
    async def go(engine: SimEngine) -> list[Generation]:
        p = SamplingParams(max_tokens=8, stop_token_ids=[3])
        return [await engine.generate(list(range(n)), p, session_id="s") for n in (5, 9, 13)]

    a = asyncio.run(go(SimEngine(SimConfig(time_scale=0.0, seed=1))))
    b = asyncio.run(go(SimEngine(SimConfig(time_scale=0.0, seed=1))))
    c = asyncio.run(go(SimEngine(SimConfig(time_scale=0.0, seed=2))))
    assert [g.token_ids for g in a] == [g.token_ids for g in b] != [g.token_ids for g in c]
    for g in a:
        assert len(g.token_ids) <= 8 and (g.finish_reason == "stop") == (g.token_ids[-1] == 3)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_sim_engine_batch_width_queues_calls() -> None:
    engine = SimEngine(SimConfig(max_num_seqs=2, overhead_s=0.02, decode_s_per_token=0.0))
    peak = 0

    async def one(i: int) -> None:
        nonlocal peak
        task = asyncio.ensure_future(engine.generate([i], SamplingParams(max_tokens=2)))
        await asyncio.sleep(0.005)
        peak = max(peak, engine.statistics().in_flight)
        await task

    async def main() -> None:
        await asyncio.gather(*(one(i) for i in range(6)))

    asyncio.run(main())
    asyncio.run(main())  # a second event loop gets its own queue
    assert peak == 2 and engine.statistics().calls == 12


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    """SmolLM2's byte-level BPE tokenizer with EARL's ChatML template: what
    `earl.models.smollm2.smollm2_dir()` saves, read straight from the GGUF that `.ci/install`
    installs (~6 s; the whole model's conversion, ~20-80 s, is not needed for its tokenizer)."""
    from transformers import AutoTokenizer

    from earl.models.smollm2 import gguf_path
    from earl.models.tiny import CHAT_TEMPLATE

    gguf = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def test_codec_is_exact_with_a_byte_level_bpe_tokenizer(smollm2_tokenizer) -> None:
    codec = ChatCodec(smollm2_tokenizer)
    schema = [Tool.from_function(calculator).schema]
    texts = ["What's 2+2?", "Board:\n123\n456", "  spaced ", "héllo 世界", "<tool_call>x"]
    for _ in range(3):
        for t in texts:
            msgs = [{"role": "user", "content": t}]
            assert codec.encode_prompt(msgs, schema) == list(
                codec._encode_raw(codec.render(msgs, schema)))
            for role in ("user", "tool"):
                m = [{"role": role, "content": t}]
                assert codec.encode_continuation(m) == list(codec._encode_raw(codec._delta(m)))
    assert codec._split is not None  # splitting at added tokens agreed with whole-text encoding


def test_a_cut_session_records_why_and_how_much_context_it_needed(codec: ChatCodec) -> None:
    """The first prompt does not fit the engine's window: the episode says so (`info.cut`),
    with the tokens it needed, so the driver's error can name the number and the flag."""
    engine = SimEngine(SimConfig(time_scale=0.0, max_model_len=64))

    async def agent(rollout, sample):
        turn = await rollout.generate([{"role": "user", "content": "x" * 80}])
        return 0.0 if turn.truncated else 1.0

    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=16))
    traj = asyncio.run(run_agent(agent, None, engine=engine, codec=codec, config=cfg))
    assert traj.truncated and not traj.loss_mask.count(1)
    assert traj.info["cut"] == "context_window" and traj.info["cut_first_turn"] == 1
    assert int(traj.info["cut_need_tokens"]) > 80 + 16
    capped = RolloutConfig(sampling=SamplingParams(max_tokens=16), max_total_tokens=40)
    traj = asyncio.run(run_agent(agent, None, engine=SimEngine(SimConfig(time_scale=0.0)),
                                 codec=codec, config=capped))
    assert traj.info["cut"] == "max_total_tokens"
