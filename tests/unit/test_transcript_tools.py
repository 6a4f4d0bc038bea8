"""Warm-start transcripts with tools: the first prompt carries the tools block, as the agent's
requests do (the OpenAI calc agent's own transcripts)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.openai_calc import SYSTEM, TOOLS, warm_start_transcripts
from earl.envs.arithmetic import DEMO_KNOWN, CalcTasks, evaluate
from earl.loop.warm_start import transcript_targets
from earl.models.tiny import build_tokenizer


def test_openai_calc_transcripts_start_with_the_agents_own_prompt(tmp_path: Path) -> None:
    codec = ChatCodec(build_tokenizer())
    tasks = CalcTasks("train", seed=0).take(6)
    lines = warm_start_transcripts(tasks, seed=1)
    f = tmp_path / "sft.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in lines))
    ids, targets = transcript_targets(codec, str(f))
    for task, line, seq, rows in zip(tasks, lines, ids, targets, strict=True):
        prompt = codec.encode_prompt([{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": task["question"]}],
                                     tools=TOOLS)
        assert list(seq[:len(prompt)]) == prompt  # what the agent's first request renders
        assert int(rows[:, 0].min()) == len(prompt)  # nothing before the first reply trains
        call = json.loads(line["messages"][2]["content"].removeprefix("<tool_call>")
                          .removesuffix("</tool_call>"))
        assert line["messages"][-1]["content"] == evaluate(call["arguments"]["expression"])
    seen: dict[bool, set[str]] = {True: set(), False: set()}
    for x in warm_start_transcripts(CalcTasks("train").take(120)):
        question, call = x["messages"][1]["content"], x["messages"][2]["content"][11:-12]
        op = re.sub(r"\d", "", json.loads(call)["arguments"]["expression"])
        known = next((o for w, o in DEMO_KNOWN.items() if w in question), None)
        assert op == known or known is None
        seen[known is None].add(op)
    # the demonstrator knows one wording per operator and draws the operator for the others
    assert seen[False] == seen[True] == {"+", "-", "*"}


def test_transcript_tools_must_be_schemas(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"tools": "calculator", "messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}) + "\n")
    with pytest.raises(ValueError, match='sample 1: "tools" must be a list'):
        transcript_targets(ChatCodec(build_tokenizer()), str(f))


def test_the_warm_start_takes_every_core_this_process_may_use() -> None:
    """No other actor is alive during the warm start: its Learner gets the process's cores, and
    never fewer threads than each actor's share."""
    import os

    from earl.loop.warm_start import warm_start_threads

    cores = len(os.sched_getaffinity(0))
    assert warm_start_threads(1) == cores
    assert warm_start_threads(cores + 3) == cores + 3
