"""The `chain_smollm2` task: word problems read back from their text (frame and steps) give
disjoint train/eval templates and exact answers; the one-operation calculator; the agent's
scoring on scripted policies; the warm start holds only symbolic problems, solved right."""

from __future__ import annotations

import asyncio
import random
import re

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tools import parse_tool_calls
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.chain import (
    EVAL_FRAMES,
    STEPS,
    TRAIN_FRAMES,
    ChainTasks,
    SymbolicTasks,
    calculate,
    symbolic_steps,
)
from earl.models.tiny import build_tokenizer
from earl.recipe import agent_ref, load_agent, load_recipe
from earl.recipes import chain_smollm2

pytestmark = pytest.mark.timeout(120)
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def _pattern(text: str) -> str:
    out = re.escape(text)
    for name in ("n", "x"):
        out = out.replace(rf"\{{{name}\}}", r"[\w']+")
    return out.replace(r"\{a\}", r"(\d+)").replace(r"\{b\}", r"(\d+)")


_STEP_RES = [(op, re.compile(_pattern(s))) for op, ss in STEPS.items() for s in ss]


def _read(question: str) -> tuple[tuple[str, str], int, list[tuple[str, int]]]:
    """(frame, start, steps) of a ChainTasks question, parsed from its text alone."""
    for frame in (*TRAIN_FRAMES, *EVAL_FRAMES):
        m = re.fullmatch(_pattern(frame[0]) + r" (.*) " + _pattern(frame[1]), question)
        if m is None:
            continue
        steps = []
        for sentence in re.split(r"(?<=\.) ", m.group(2)):
            body = re.sub(r"^(Then|Next|After that|Later) ", "", sentence).removesuffix(".")
            found = [(op, int(r.fullmatch(body).group(1)))  # type: ignore[union-attr]
                     for op, r in _STEP_RES if r.fullmatch(body)]
            assert len(found) == 1, (sentence, found)  # every step reads one way only
            steps.append(found[0])
        return frame, int(m.group(1)), steps
    raise AssertionError(f"no frame matches {question!r}")


def _solve(start: int, steps: list[tuple[str, int]]) -> int:
    value = start
    for op, b in steps:
        if op == "/":
            assert value % b == 0, (value, b)  # whole division only
            value //= b
        else:
            value = _OPS[op](value, b)
        assert 1 <= value <= 999
    return value


def test_splits_share_no_template_and_answers_are_exact() -> None:
    frames = {}
    ops: dict[str, set[str]] = {"train": set(), "eval": set()}
    for split in ("train", "eval"):
        tasks = ChainTasks(split, seed=3).take(400)
        assert tasks == ChainTasks(split, seed=3).take(400)  # deterministic
        frames[split] = set()
        for t in tasks:
            frame, start, steps = _read(str(t["question"]))
            frames[split].add(frame)
            assert len(steps) == t["steps"] and 2 <= len(steps) <= 3
            assert t["answer"] == _solve(start, steps)
            ops[split].update(op for op, _ in steps)
    assert frames["train"] == set(TRAIN_FRAMES) and frames["eval"] == set(EVAL_FRAMES)
    assert not frames["train"] & frames["eval"]
    assert ops["train"] == ops["eval"] == set("+-*/")  # every operator in both splits
    with pytest.raises(ValueError, match="split"):
        ChainTasks("test")


def test_calculator_does_one_operation_on_two_numbers() -> None:
    assert [calculate(e) for e in ("37-9", "12*3", "12 x 3", "48/4", "48//4", "7/2", "5-9")] \
        == ["28", "36", "36", "12", "12", "3.5", "-4"]
    for bad in ("1+2+3", "a*b", "(3+4)", "2**8", "", "12"):
        with pytest.raises(ValueError, match="one operation on two numbers"):
            calculate(bad)
    with pytest.raises(ValueError, match="division by zero"):
        calculate("5/0")


def _oracle(codec: ChatCodec, wrong_at: int | None = None, calls_only: bool = False):  # type: ignore[no-untyped-def]
    """A scripted policy for word problems: the right call per step (a wrong operator at step
    `wrong_at`), then the last result as the answer (never, with `calls_only`)."""

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = codec.decode(prompt_ids)
        _, start, steps = _read(text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>")[0])
        results = re.findall(r"<tool_response>(.*?)</tool_response>", text, re.DOTALL)
        if len(results) < len(steps) or calls_only:
            i = min(len(results), len(steps) - 1)
            op, b = steps[i]
            op = "+" if i == wrong_at and op != "+" else "-" if i == wrong_at else op
            left = results[-1].strip() if results else str(start)
            call = {"name": "calculator", "arguments": {"expression": f"{left}{op}{b}"}}
            reply = "<tool_call>" + str(call).replace("'", '"') + "</tool_call>"
        else:
            reply = f"So the answer is {results[-1].strip()}."
        return codec.encode_text(reply) + [codec.end_id]

    return respond


@pytest.mark.parametrize(("wrong_at", "calls_only", "reward"),
                         [(None, False, 1.0), (0, False, 0.0), (1, False, 0.0),
                          (None, True, 0.0)])
def test_agent_scores_the_exact_final_answer(codec: ChatCodec, wrong_at: int | None,
                                             calls_only: bool, reward: float) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0, seed=0),
                       responder=_oracle(codec, wrong_at, calls_only))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=200))
    for task in ChainTasks("eval").take(12):
        t = asyncio.run(run_agent(chain_smollm2.agent, task, engine=engine, codec=codec,
                                  config=cfg))
        assert not t.failed and t.reward == reward, (task, codec.decode(t.token_ids))
        if calls_only:  # out of turns on a tool call: no answer, no score
            assert t.info["answered"] == 0 and t.info["tool_calls"] == chain_smollm2.MAX_TURNS
        else:  # one call per step, then the answer
            assert t.info["tool_calls"] == task["steps"] and t.info["answered"] == 1
            assert t.info["tool_errors"] == 0


def test_warm_start_is_symbolic_problems_solved_by_chained_calls(codec: ChatCodec) -> None:
    ids, targets = asyncio.run(chain_smollm2.warm_start(codec, 30, seed=2))
    assert len(ids) == len(targets) == 30
    wordings = [w.split("{b}")[-1].strip() or w.split()[1] for ws in STEPS.values() for w in ws]
    for x, rows in zip(ids, targets, strict=True):
        text = codec.decode(x.tolist())
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        start, steps = symbolic_steps(question)  # a symbolic problem, no wording of the task
        assert not any(w in question for w in wordings)
        turns = [t.split("<|im_end|>")[0] for t in text.split("<|im_start|>assistant\n")[1:]]
        assert len(turns) == len(steps) + 1
        value = str(start)
        for turn, (op, b) in zip(turns, steps, strict=False):
            content, (call,) = parse_tool_calls(turn)
            assert content == "" and call.arguments == {"expression": f"{value}{op}{b}"}
            value = calculate(f"{value}{op}{b}")
        assert turns[-1] == value  # the answer: the last result
        # every target is an assistant token of weight 1, the tokens the transcript holds
        assert all(w == 1.0 and x[int(p)] == int(tok) for p, tok, w in rows)
        assert len(rows) == sum(len(codec.encode_text(t)) + 1 for t in turns)


def test_symbolic_tasks_read_back_and_cover_one_to_three_steps() -> None:
    seen = set()
    for k in range(200):
        t = SymbolicTasks(seed=1).sample(k)
        start, steps = symbolic_steps(str(t["question"]))
        assert _solve(start, steps) == t["answer"] and len(steps) == t["steps"]
        seen.add(len(steps))
    assert seen == {1, 2, 3}
    with pytest.raises(ValueError, match="not a SymbolicTasks question"):
        symbolic_steps("Ann has 3 pens.")


def test_recipe_loads_by_name() -> None:
    recipe = load_recipe("chain_smollm2")
    assert recipe is chain_smollm2.recipe and recipe.name == "chain_smollm2"
    assert load_agent(agent_ref(recipe.agent)) is recipe.agent
    evals = recipe.eval.samples("final", 0, 200)
    assert evals == recipe.eval.samples("start", 0, 200) == ChainTasks("eval").take(200)
    assert evals != recipe.eval.samples("validation", 0, 200)
