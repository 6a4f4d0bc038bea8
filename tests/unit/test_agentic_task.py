"""bench/_agentic_workload.py's reward is correctness: a turn is right only when its reply's first
digit is the task's key (stated in the first message, with tool outputs holding other digits in
between), so a policy that guesses digits, or always says one, scores ~0.1; and TRL's rollout
loop (bench/_peers_trl_agentic.py) scores the same episodes exactly as EARL's agent does."""

from __future__ import annotations

import asyncio
import contextlib
import io
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _agentic_workload as work
import _peers_trl_agentic as ag

Policy = Callable[[str], str]  # the rendered conversation -> the reply's text


@pytest.fixture(autouse=True)
def instant_tools(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real tools' outputs without their waits: the lookup's sleep takes no time and the
    `python` tool's program runs in this process, not in the sandbox (no process in a unit
    test)."""
    sleep = asyncio.sleep

    async def no_wait(delay: float, *args: Any) -> Any:
        return await sleep(0, *args)

    def python(code: str) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code, {})  # noqa: S102 - the workload's own program, not user input
        return out.getvalue()

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    monkeypatch.setattr(work, "python", python)


def render(messages: list[dict[str, str]]) -> str:
    return "".join(f"<{m['role']}>{m['content']}|" for m in messages)


class Tok:
    """A char-level tokenizer with a prefix-consistent template (`render`) whose end-of-turn
    "|" is a special token: the model generates it, decoding skips it."""

    def apply_chat_template(self, messages: list[dict[str, str]], *, add_generation_prompt: bool,
                            tokenize: bool, return_dict: bool) -> list[int]:
        return [ord(c) for c in render(messages) + ("<assistant>" if add_generation_prompt else "")]

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


EOS = ord("|")


@dataclass
class Reply:
    """EARL's `AssistantTurn` as the agent reads it: `text`, special tokens written out."""

    text: str
    message: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        self.message = {"role": "assistant", "content": self.text}


@dataclass
class Rollout:
    """EARL's side of the agent's `rollout`: `policy` of the conversation rendered by `Tok`."""

    policy: Policy

    async def generate(self, messages: list[dict[str, str]]) -> Reply:
        return Reply(self.policy(render(messages) + "<assistant>"))


def earl_rewards(samples: list[dict[str, int]], policy: Policy) -> list[float]:
    async def main() -> list[float]:
        return list(await asyncio.gather(*(work.agent(Rollout(policy), s) for s in samples)))

    return asyncio.run(main())


def trl_rewards(samples: list[dict[str, int]], policy: Policy, paced: bool) -> list[float]:
    def generate(batch: list[list[int]]) -> list[list[int]]:
        return [[*map(ord, policy("".join(map(chr, ids)))), EOS] for ids in batch]

    player = ag.PacedEpisodes(Tok()) if paced else ag.Episodes(Tok())
    return list(player.play(samples, generate)["episode_reward"])


def key_of(text: str) -> int:
    """The key of the conversation `text` (read off its first message)."""
    return int(text.split(": key ", 1)[1][0])


def oracle(text: str) -> str:
    return str(key_of(text))


def test_a_right_reply_scores_one_and_a_wrong_digit_zero() -> None:
    s = {"id": 3, "turns": 3, "seed": 5, "key": 4}
    assert work.first_message(s)["content"] == "Task d: key 4444"
    assert work.episode_reward(s, ["4", "4", "4"]) == 1.0
    assert work.episode_reward(s, ["5", "3", "0"]) == 0.0
    assert work.episode_reward(s, ["4", "4", "1"]) == pytest.approx(2 / 3)
    # the first digit decides; text around it is ignored, a reply without a digit is wrong
    assert work.episode_reward(s, ["a4b", "4 or 3", "x"]) == pytest.approx(2 / 3)
    assert work.episode_reward(s, ["34", "04", "٤"]) == 0.0  # ASCII digits only
    # a special token's name is not text the model wrote: its digits do not count
    assert work.episode_reward(s, ["<|reserved_4|>", "<|reserved_1|>4<|im_end|>", "4"]
                               ) == pytest.approx(2 / 3)


def test_the_agent_scores_the_oracle_one_and_a_wrong_digit_zero() -> None:
    samples = work.tasks(40, seed=2)
    assert earl_rewards(samples, oracle) == [1.0] * 40
    assert earl_rewards(samples, lambda t: str((key_of(t) + 1) % 10)) == [0.0] * 40
    # the tools' outputs carry digits, but echoing the latest one finds the key on the first
    # turn only (then by chance): a policy must carry the key across the tools' answers
    latest = earl_rewards(samples, lambda t: [c for c in t if c.isdigit()][-1])
    first_turns = sum(1 / s["turns"] for s in samples)
    assert sum(latest) < first_turns + 0.2 * (len(samples) - first_turns)


def test_guessing_scores_about_a_tenth() -> None:
    samples = work.tasks(2000, seed=2)
    rng = random.Random(0)
    guess = earl_rewards(samples, lambda t: str(rng.randrange(10)))
    assert 0.07 < sum(guess) / len(guess) < 0.13
    # no digit is a shortcut: keys are close to uniform, so no constant reply beats ~0.1
    for d in "0123456789":
        const = [work.episode_reward(s, [d] * s["turns"]) for s in samples]
        assert sum(const) / len(const) < 0.13
    # the untrained model's kind of reply (bytes and special tokens at random) scores ~0
    vocab = [*(chr(i) for i in range(32, 127)), *(f"<|reserved_{i}|>" for i in range(57))]
    noise = earl_rewards(samples, lambda t: "".join(rng.choices(vocab, k=8)))
    assert sum(noise) / len(noise) < 0.05


def mixed(text: str) -> str:
    """A policy right on some turns only, decided by the conversation it sees (so the same
    conversation gets the same reply on either side), in several reply formats."""
    key, h = key_of(text), sum(map(ord, text)) % 4
    return (f"{key}", f"<|reserved_3|>b{key}{key + 1}", f"{(key + 3) % 10}", "none")[h]


@pytest.mark.parametrize("paced", [False, True])
def test_trl_scores_the_same_episodes_as_earl(paced: bool) -> None:
    samples = work.tasks(60, seed=7)
    earl = earl_rewards(samples, mixed)
    assert trl_rewards(samples, mixed, paced) == earl
    assert len(set(earl)) > 3 and 0.0 < sum(earl) / len(earl) < 1.0  # a real mix of scores
    assert trl_rewards(samples, oracle, paced) == [1.0] * 60


def test_both_decoders_give_the_rule_the_same_digit() -> None:
    """Random generations of the real tiny tokenizer (bytes, specials, reserved tokens): EARL's
    turn text (`ChatCodec.decode` of the reply without its stop token) and TRL's
    `decode(..., skip_special_tokens=False)` of the whole reply score alike for every digit."""
    from earl.agents.chat import ChatCodec
    from earl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    codec = ChatCodec(tok)
    rng = random.Random(0)
    hits = 0
    for _ in range(300):
        body = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 8))]
        body = [t for t in body if t != codec.end_id]
        earl, trl = codec.decode(body), tok.decode([*body, codec.end_id],
                                                   skip_special_tokens=False)
        for d in range(10):
            assert work.correct(earl, d) == work.correct(trl, d)
            hits += work.correct(earl, d)
    assert hits > 30  # enough of the replies hold a digit for the comparison to mean something
