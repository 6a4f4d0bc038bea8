"""The shipped recipes: found by scanning earl/recipes/ (a new folder is a new recipe); the
`calc` and `connect4` agents on SimEngine through run_agent, warm-start transcripts,
deterministic and disjoint task sources, JSONL round trip, and the metrics; a recipe's critic
only where it has one."""

from __future__ import annotations

import asyncio
import re
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

import earl.recipes
from earl.agents.chat import ChatCodec
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tools import parse_tool_calls
from earl.config import load_config
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.arithmetic import (
    CALC_TEMPLATES,
    CalcTasks,
    calculator,
    evaluate,
    quantities,
    write_jsonl,
)
from earl.models.tiny import build_tokenizer
from earl.recipe import ListTasks, agent_ref, load_agent, load_jsonl, load_recipe, recipe_names
from earl.recipes import calc, connect4
from earl.resolve import resolve_recipe
from earl.stages.batch_types import Episode, episode_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def _key(task: dict[str, object]) -> str:
    """The expression behind a calc task ("7+5"): what the train/eval split is made of."""
    t, nums = _parse(task)
    return CALC_TEMPLATES[t][1].format(**dict(zip("abc", nums, strict=False)))


def _parse(task: dict[str, object]) -> tuple[int, tuple[int, ...]]:
    """(template, numbers) of a calc task."""
    q = str(task["question"])
    for i, (text, _, _) in enumerate(CALC_TEMPLATES):
        pattern = re.escape(text).replace(r"\{n\}", r"\w+").replace(r"\{x\}", r"\w+")
        pattern = re.sub(r"\\\{[abc]\\\}", r"(\\d+)", pattern)
        m = re.fullmatch(pattern, q)
        if m:
            return i, tuple(int(g) for g in m.groups())
    raise AssertionError(f"no template matches {q!r}")


def test_recipes_load_by_name_and_their_agents_are_importable() -> None:
    for name, module in (("calc", calc), ("connect4", connect4)):
        recipe = load_recipe(name)
        assert recipe is module.recipe and recipe.name == name
        assert load_agent(agent_ref(recipe.agent)) is recipe.agent  # producers import it


def test_a_recipe_is_a_folder_found_by_name(tmp_path: Path, monkeypatch) -> None:
    assert recipe_names() == ("calc", "calc_smollm2", "chain_smollm2", "connect4", "gauntlet",
                              "tictactoe")
    with pytest.raises(ValueError, match="'nope' unknown; choose one of calc, calc_smollm2, "
                                         "chain_smollm2, connect4, gauntlet, tictactoe"):
        load_recipe("nope")
    with pytest.raises(ValueError, match="'recipe': 'nope' unknown"):
        load_config(None, ["--recipe=nope"], recipe_defaults={})
    mine = tmp_path / "mine"  # a new recipe: one folder, no list to add it to
    mine.mkdir()
    (mine / "__init__.py").write_text(
        "from earl import Recipe, SeedTasks\n"
        "async def agent(rollout, seed):\n    return 0.0\n"
        "recipe = Recipe(name='mine', agent=agent, tasks=SeedTasks(), config={'steps': 3})\n")
    (tmp_path / "_private").mkdir()
    (tmp_path / "loose.py").write_text("")  # a module, not a recipe folder
    monkeypatch.setattr(earl.recipes, "__path__", [*earl.recipes.__path__, str(tmp_path)])
    try:
        assert recipe_names() == ("calc", "calc_smollm2", "chain_smollm2", "connect4",
                                  "gauntlet", "mine", "tictactoe")
        assert load_recipe("mine").name == "mine"
        assert load_config(None, ["--recipe=mine"]).steps == 3
    finally:
        sys.modules.pop("earl.recipes.mine", None)


def test_only_a_recipe_with_a_critic_trains_against_one() -> None:
    cfg = load_config(None, ["--recipe=calc", "--algorithm.name=ppo", "--algorithm.critic=recipe"])
    with pytest.raises(ValueError, match="recipe 'calc' has no critic"):
        resolve_recipe(cfg)
    tictactoe, _ = resolve_recipe(load_config())
    assert tictactoe.critic is not None
    with pytest.raises(ValueError, match="algorithm.self_imitation"):
        load_config(None, ["--algorithm.critic=none"])  # self-imitation needs the critic
    assert load_config(None, ["--algorithm.critic=none", "--algorithm.self_imitation=0"])


def test_calc_tasks_are_deterministic_disjoint_and_answerable() -> None:
    train, evals = CalcTasks("train"), CalcTasks("eval")
    assert [train.sample(k) for k in range(50)] == CalcTasks("train").take(50)
    assert CalcTasks("train", seed=1).take(20) != train.take(20)
    train_keys = {_key(t) for t in train.take(3000)}
    eval_keys = {_key(t) for t in evals.take(1000)}
    assert len(train_keys) > 1000 and len(eval_keys) > 300
    assert not train_keys & eval_keys  # no held-out expression is ever trained on
    for task in train.take(200) + evals.take(200):
        assert task["answer"] == int(calculator(_key(task))) >= 1
    seen = {_parse(t)[0] for t in train.take(200)}
    assert seen == set(range(len(CALC_TEMPLATES)))
    with pytest.raises(ValueError, match="split"):
        CalcTasks("test")
    cycled = CalcTasks("train", cycle=True)
    for start in (0, 5, 33):  # any six consecutive tasks hold every wording once
        assert sorted(_parse(cycled.sample(k))[0] for k in range(start, start + 6)) == \
            list(range(len(CALC_TEMPLATES)))
    assert not {_key(t) for t in cycled.take(600)} & eval_keys  # still the train split


def test_calc_eval_splits() -> None:
    start = calc.recipe.eval.samples("start", 0, 50)
    assert start == calc.recipe.eval.samples("final", 99, 50)  # same tasks before and after
    assert start != calc.recipe.eval.samples("validation", 10, 50)
    train_keys = {_key(t) for t in CalcTasks("train").take(3000)}
    assert not {_key(t) for t in start} & train_keys


def test_calc_tasks_round_trip_through_jsonl(tmp_path: Path) -> None:
    tasks = CalcTasks("train").take(30)
    path = write_jsonl(tmp_path / "d" / "train.jsonl", tasks)
    loaded = load_jsonl(path)
    assert loaded == tasks
    src = ListTasks(loaded, seed=3)
    assert sorted(map(str, (src.sample(k) for k in range(30)))) == sorted(map(str, tasks))


def test_shipped_calc_jsonl_files_match_the_generator() -> None:
    data = Path(__file__).resolve().parents[2] / "envs" / "data"
    train = load_jsonl(data / "calc_train.jsonl")
    evals = load_jsonl(data / "calc_eval.jsonl")
    assert train == CalcTasks("train").take(len(train))
    assert evals == CalcTasks("eval").take(len(evals))
    assert not {_key(t) for t in train} & {_key(t) for t in evals}  # type: ignore[arg-type]


def test_calc_agent_on_the_warm_start_policy(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0, seed=1),
                       responder=calc.warm_start_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=calc.recipe.max_tokens))
    for task in CalcTasks("eval").take(30):
        t = asyncio.run(run_agent(calc.recipe.agent, task, engine=engine, codec=codec,
                                  config=cfg))
        assert not t.failed and t.info["tool_calls"] == 1 and t.info["tool_errors"] == 0
        _, (call,) = parse_tool_calls(codec.decode(t.token_ids[slice(*t.turn_spans[0])]))
        result = evaluate(str(call.arguments["expression"]), quantities(str(task["question"])))
        answer = codec.decode(t.token_ids[slice(*t.turn_spans[1])]).removesuffix("<|im_end|>")
        assert answer == result  # the script copies the tool's result
        assert t.reward == float(int(result) == task["answer"]) and t.info["answered"] == 1


def test_calc_warm_start_teaches_the_format_not_the_operators(codec: ChatCodec) -> None:
    ids, targets = asyncio.run(calc.warm_start(codec, 40, seed=5))
    short = 40 * calc.SHORT_COPIES
    assert len(ids) == len(targets) == 40 + short * (1 + calc.ANSWER_COPIES)
    full = codec.decode(ids[0].tolist())
    assert full.startswith("<|im_start|>system") and '"name": "calculator"' in full
    assert all(codec.decode(x[:2].tolist()) == "<|im_start|>u" for x in ids[40:])  # no tools block
    answers = [i for i, x in enumerate(ids) if "<tool_call>" not in codec.decode(x.tolist())]
    assert len(answers) == short * calc.ANSWER_COPIES
    for i in answers:  # the result and the reply alone: the copy, nothing else
        text = codec.decode(ids[i].tolist())
        assert text.startswith("<|im_start|>user\n<tool_response>")
        result = text.split("<tool_response>")[1].split("</tool_response>")[0]
        reply = [int(tok) for pos, tok, _ in targets[i]]
        assert codec.decode(reply) == result + "<|im_end|>"
    ops = {codec.encode_text(o)[0] for o in calc.OPERATORS}
    for x, rows in [(x, r) for i, (x, r) in enumerate(zip(ids, targets, strict=True))
                    if i not in answers]:
        text = codec.decode(x.tolist())
        question = text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        call_text = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
        content, (call,) = parse_tool_calls(call_text)
        assert content == "" and call.error is None and call.name == "calculator"
        expr = str(call.arguments["expression"])
        names = list(quantities(question))  # a, b(, c): the question's numbers by name
        assert re.findall(r"[a-z]", expr) == names and len(names) in (2, 3)
        by_pos: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for pos, tok, w in rows:
            by_pos[int(pos)].append((int(tok), w))
        soft = [p for p, r in by_pos.items() if len(r) > 1]
        assert len(soft) == len(re.findall(r"\d+", question)) - 1  # one per operator
        for p in soft:  # uniform: the warm start does not say which operator is right
            assert {tok for tok, _ in by_pos[p]} == ops and x[p] in ops
            assert all(abs(w - 1 / 3) < 1e-9 for _, w in by_pos[p])
        for p, r in by_pos.items():
            if p not in soft:
                digit = codec.decode([int(x[p])]).isdigit()
                assert r == [(int(x[p]), calc.COPY_WEIGHT if digit else 1.0)]
        # Only assistant tokens are targets: the answer copies the tool result.
        result = text.split("<tool_response>")[1].split("</tool_response>")[0]
        assert text.rstrip().endswith(f"assistant\n{result}<|im_end|>")
        assert max(by_pos) == len(x) - 1 or codec.decode([int(x[max(by_pos)])]) == "<|im_end|>"


def _episode(**kw: object) -> Episode:
    base: dict[str, object] = {"sample_id": "s", "group_id": "g", "reward": 0.0}
    base.update(kw)
    return Episode(**base)  # type: ignore[arg-type]


def test_calc_metric() -> None:
    eps = [_episode(reward=1.0, turns=2, info={"correct": 1, "answered": 1, "tool_calls": 1,
                                               "tool_errors": 0}),
           _episode(turns=3, info={"correct": 0, "answered": 0, "tool_calls": 3,
                                   "tool_errors": 1}),
           _episode(turns=1, info={"correct": 0, "answered": 1, "tool_calls": 0}),
           _episode(reward=None, failed=True, error="boom")]
    m = calc.calc_metric(eps)
    assert m["accuracy"] == 0.25 and m["answered_rate"] == 0.5 and m["tool_call_rate"] == 0.5
    assert m["tool_error_rate"] == 0.25 and m["failed_rate"] == 0.25 and m["turns"] == 2.0


def test_connect4_agent_alternates_the_first_move(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0), responder=connect4.connect4_sim_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=connect4.recipe.max_tokens))
    for seed in (4, 5):
        t = asyncio.run(run_agent(connect4.recipe.agent, seed, engine=engine, codec=codec,
                                  config=cfg))
        first_prompt = codec.decode(t.token_ids[:t.turn_spans[0][0]])
        assert ("O took" in first_prompt) == (seed % 2 == 1)
        assert not t.failed and t.info["illegal"] == 0 and t.info["seed"] == seed
        assert len(t.turn_rewards) == len(t.turn_spans) == t.info["moves"]
        # The whole game stays in context: each turn's prompt extends the previous one.
        assert t.turn_spans == sorted(t.turn_spans) and len(t.token_ids) > 100 * t.info["moves"] // 2
    bad = asyncio.run(run_agent(connect4.recipe.agent, "4", engine=engine, codec=codec))
    assert bad.failed and "seed" in str(bad.error)


def test_connect4_warm_start_targets_are_the_open_columns(codec: ChatCodec) -> None:
    ids, targets = asyncio.run(connect4.warm_start(codec, 12, seed=2))
    assert len(ids) == 12
    for x, rows in zip(ids, targets, strict=True):
        by_pos: dict[int, list[tuple[int, float]]] = defaultdict(list)
        for pos, tok, w in rows:
            by_pos[int(pos)].append((int(tok), w))
        for pos, r in by_pos.items():
            assert abs(sum(w for _, w in r) - 1) < 1e-9
            if len(r) > 1 or codec.decode([r[0][0]]).isdigit():
                board = codec.decode(x[:pos].tolist()).rsplit("<|im_start|>user\n", 1)[1]
                rows_ = [ln for ln in board.split("\n") if re.fullmatch(r"[.XO]{7}", ln)]
                top = rows_[-6]
                legal = {str(i + 1) for i, ch in enumerate(top) if ch == "."}
                assert {codec.decode([tok]) for tok, _ in r} == legal


def test_connect4_metric_and_eval_seeds() -> None:
    seeds = connect4.recipe.eval.samples("start", 0, 10)
    assert seeds == connect4.recipe.eval.samples("final", 5, 10)
    assert not set(seeds) & set(connect4.recipe.eval.samples("validation", 5, 10))
    assert sum(s % 2 for s in seeds) == 5  # type: ignore[operator]
    eps = [_episode(info={"outcome": "win", "illegal": 0, "seed": 0, "moves": 4}),
           _episode(info={"outcome": "draw", "illegal": 0, "seed": 1, "moves": 21}),
           _episode(info={"outcome": "loss", "illegal": 1, "seed": 2, "moves": 3}),
           _episode(reward=None, failed=True, info={"seed": 3})]
    m = connect4.connect4_metric(eps)
    assert (m["win_rate"], m["draw_rate"], m["loss_rate"]) == (0.25, 0.25, 0.5)
    assert m["illegal_rate"] == 0.25 and m["win_draw_rate"] == 0.5
    assert m["first_win_draw"] == 0.5 and m["second_win_draw"] == 0.5 and m["moves"] == 7.0
    assert connect4.recipe.target_key == "win_draw_rate" in m


def test_episode_metadata_carries_what_the_metrics_read(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0), responder=calc.warm_start_responder(codec))
    task = CalcTasks("train").sample(0)
    t = asyncio.run(run_agent(calc.recipe.agent, task, engine=engine, codec=codec,
                              config=RolloutConfig(sampling=SamplingParams(max_tokens=72))))
    m = calc.calc_metric([episode_of(t)])
    assert m["tool_call_rate"] == 1.0 and m["accuracy"] == t.reward
    assert np.isclose(m["turns"], 2.0)
