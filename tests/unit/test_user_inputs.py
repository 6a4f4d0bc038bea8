"""What a user hands `earl train` besides the agent: reward rules, warm-start transcripts, task
files. Bad input names the file, line and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earl.agents.chat import ChatCodec
from earl.loop.warm_start import transcript_targets
from earl.models.tiny import build_tokenizer
from earl.recipe import ListTasks, load_agent, load_jsonl, load_reward


def test_reward_rule_is_loaded_and_checked(tmp_path: Path) -> None:
    f = tmp_path / "rules.py"
    f.write_text("def exact(sample, response):\n    return float(response.strip() == "
                 "str(sample['answer']))\n\nasync def agent(rollout, sample):\n    return 0.0\n"
                 "\ndef one(x):\n    return x\n")
    rule = load_reward(f"{f}:exact")
    assert rule({"answer": 4}, " 4") == 1.0 and rule({"answer": 4}, "5") == 0.0
    with pytest.raises(ValueError, match="two arguments"):
        load_reward(f"{f}:one")
    with pytest.raises(ValueError, match="two arguments"):
        load_reward(f"{f}:agent")
    with pytest.raises(ValueError, match="does not define 'nope'.*exact"):
        load_reward(f"{f}:nope")
    with pytest.raises(ValueError, match="not an `async def`"):
        load_agent(f"{f}:exact")
    with pytest.raises(ValueError, match="PATH.py:NAME"):
        load_agent("no-colon")


def test_transcripts_train_the_assistant_tokens(tmp_path: Path) -> None:
    codec = ChatCodec(build_tokenizer())
    f = tmp_path / "sft.jsonl"
    conv = {"messages": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "<tool_call>x</tool_call>"},
                         {"role": "tool", "content": "4"},
                         {"role": "assistant", "content": "4"}]}
    f.write_text(json.dumps(conv) + "\n")
    ids, targets = transcript_targets(codec, str(f))
    assert len(ids) == 1
    rows = targets[0]
    assert (rows[:, 2] == 1.0).all()
    # every target row names the token at its position: the rows are the assistant turns
    assert all(int(ids[0][int(p)]) == int(t) for p, t, _ in rows)
    text = codec.decode([int(t) for _, t, _ in rows])
    assert "<tool_call>x</tool_call>" in text and text.count("4") >= 1
    assert int(rows[:, 0].max()) == len(ids[0]) - 1  # the last assistant token closes it
    f.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="sample 1 needs a user message"):
        transcript_targets(codec, str(f))


def test_task_files(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"q": 1}\n\n{"q": 2}\n[3]\n')
    items = load_jsonl(f)
    assert items == [{"q": 1}, {"q": 2}, [3]]
    src = ListTasks(items, seed=1)
    epoch = sorted(json.dumps(src.sample(k)) for k in range(3))
    assert epoch == sorted(json.dumps(x) for x in items)  # each epoch is a permutation
    assert [src.sample(k) for k in range(6)] == [src.sample(k) for k in range(6)]
    f.write_text('{"q": 1}\n{"q": NaN}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:2"):
        load_jsonl(f)
    f.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_jsonl(f)
    f.write_text("\n\n")
    with pytest.raises(ValueError, match="holds no samples"):
        load_jsonl(f)
