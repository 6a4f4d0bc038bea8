"""The `calc` recipe: multi-turn arithmetic with the calculator tool, for the tiny char model.

Tasks are `earl.envs.arithmetic.CalcTasks` dicts `{"question", "answer"}`: six short
one-operator templates (two wordings per operator), split by expression into train and
held-out eval tasks. The agent
(`earl.agents.calc.calc_agent`) calls its problem's calculator, a per-episode stateful tool that
knows the question's numbers as a, b, c, reads the result and answers; only a final answer
without a tool call scores (1 for the exact integer).

The warm start teaches the format, not the answers: its transcripts call the calculator on
a and b joined by an operator drawn uniformly from + - * (the soft target on the operator is
uniform, so the warm-started policy is right by chance only), then answer by copying the
tool's result. RL has to learn which
operators each wording means. Evals are greedy on held-out tasks: "start" and "final" use the
same tasks, "validation" (model selection) others.

Written against the public API only (`earl`, and the task's agent and env in `earl.agents`
and `earl.envs`).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable

import numpy as np

from earl import (
    ChatCodec,
    Episode,
    EvalSet,
    Recipe,
    RolloutConfig,
    SamplingParams,
    SimConfig,
    SimEngine,
    run_agent,
)
from earl.agents.calc import calc_agent
from earl.envs.arithmetic import CalcTasks, quantities

__all__ = ["OPERATORS", "calc_metric", "recipe", "warm_start", "warm_start_responder"]

OPERATORS = "+-*"
COPY_WEIGHT = 8.0  # loss weight of a digit of the answer (copied from the tool's result)
SHORT_COPIES = 3  # warm-start transcripts without the tools block, per full one
ANSWER_COPIES = 2  # per short one: only the tool's result and the reply (copying the result)
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


def _question(prompt: str) -> str:
    """The user message of a rendered first prompt (the question)."""
    return prompt.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]


def warm_start_responder(codec: ChatCodec,
                         expression: Callable[[str, random.Random], str] | None = None):
    """A scripted policy (a SimEngine responder): a calculator call, then the tool's result as
    the answer. The call's expression is `expression(question, rng)`; by default the
    question's numbers by name (a, b, c) joined by random operators."""

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = codec.decode(prompt_ids)
        results = _RESPONSE.findall(text)
        if results:
            reply = results[-1].strip()
        else:
            question = _question(text)
            if expression is not None:
                expr = expression(question, rng)
            else:
                names = list(quantities(question))  # a, b, c: the question's numbers
                expr = names[0] + "".join(rng.choice(OPERATORS) + n for n in names[1:])
            call = {"name": "calculator", "arguments": {"expression": expr}}
            reply = f"<tool_call>{json.dumps(call)}</tool_call>"
        return codec.encode_text(reply) + [codec.end_id]

    return respond


async def warm_start(codec: ChatCodec, n: int, seed: int
                     ) -> tuple[list[object], list[object]]:
    """`n` scripted transcripts on training tasks with soft targets on the assistant tokens,
    plus `SHORT_COPIES * n` of them without the ~500-token tools block in front.

    Each assistant token is its own target with weight 1 (`COPY_WEIGHT` for digits: copying
    the result is the hard part for a small model), except the operators of the tool call,
    whose target is uniform over + - * (the format is taught, the choice is left to RL). The
    short copies keep every offset between the tool result and the answer (what copying
    needs) at a fifth of the tokens, so the same warm-start steps see more examples.
    """
    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed), responder=warm_start_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=recipe.max_tokens,
                                                stop_token_ids=codec.stop_ids))
    tasks = CalcTasks("train", seed=seed + 17)
    op_ids = {codec.decode([i]): i for op in OPERATORS for i in codec.encode_text(op)}
    uniform = [op_ids[op] for op in OPERATORS if op in op_ids]
    ids_out: list[object] = []  # int64 token ids per transcript
    tgt_out: list[object] = []  # float64 (pos, token, weight) rows per transcript
    im_start = codec.encode_text("<|im_start|>")[0]
    for k in range(n * (1 + SHORT_COPIES)):
        t = await run_agent(calc_agent, tasks.sample(k), engine=engine, codec=codec, config=cfg)
        if t.failed or not t.turn_spans:
            continue
        rows: list[tuple[int, int, float]] = []
        for turn, (start, end) in enumerate(t.turn_spans):
            for pos in range(start, end):
                tok = t.token_ids[pos]
                text = codec.decode([tok])
                if turn == 0 and len(uniform) == len(OPERATORS) and text in op_ids:
                    rows += [(pos, i, 1.0 / len(uniform)) for i in uniform]
                else:  # the copied numbers weigh more than the fixed JSON around them
                    rows.append((pos, tok, COPY_WEIGHT if text.isdigit() else 1.0))
        ids, tgt = np.asarray(t.token_ids, dtype=np.int64), np.asarray(rows, dtype=np.float64)
        if k >= n:  # a short copy: cut before the user turn (the second <|im_start|>)
            cut = int(np.flatnonzero(ids == im_start)[1])
            ids, tgt = ids[cut:], tgt - np.array([cut, 0.0, 0.0])
        ids_out.append(ids)
        tgt_out.append(tgt)
        if k >= n:  # and the answer alone: from the tool's result to the reply
            cut = int(np.flatnonzero(ids == im_start)[-2])
            for _ in range(ANSWER_COPIES):
                ids_out.append(ids[cut:])
                tgt_out.append(tgt[tgt[:, 0] >= cut] - np.array([cut, 0.0, 0.0]))
    return ids_out, tgt_out


def calc_metric(episodes: list[Episode]) -> dict[str, float]:
    """accuracy (exact final answer; failed episodes count as wrong), answered_rate (sessions
    that ended on an answer, not a tool call), tool_call_rate (sessions with >= 1 call),
    tool_error_rate (calls that came back as errors), failed_rate, mean turns."""
    n = max(len(episodes), 1)
    ok = [e for e in episodes if not e.failed]
    calls = sum(int(e.info.get("tool_calls", 0)) for e in ok)
    return {
        "episodes": float(len(episodes)),
        "accuracy": sum(int(e.info.get("correct", 0)) for e in ok) / n,
        "answered_rate": sum(int(e.info.get("answered", 0)) for e in ok) / n,
        "tool_call_rate": sum(int(e.info.get("tool_calls", 0)) > 0 for e in ok) / n,
        "tool_error_rate": sum(int(e.info.get("tool_errors", 0)) for e in ok) / max(calls, 1),
        "failed_rate": (len(episodes) - len(ok)) / n,
        "turns": sum(e.turns for e in ok) / max(len(ok), 1),
    }


def _eval_tasks(split: str, step: int, n: int) -> list[object]:
    # "start" and "final" score the same held-out tasks; "validation" (model selection) others.
    return list(CalcTasks("eval", seed=1 if split == "validation" else 0).take(n))


recipe = Recipe(
    name="calc",
    agent=calc_agent,
    tasks=CalcTasks("train", seed=0),
    eval=EvalSet(make=_eval_tasks),
    metric=calc_metric,
    target_key="accuracy",
    max_tokens=72,
    shared_group_task=True,
    warm_start=warm_start,
    config={
        "model": {"max_model_len": 1024},
        "steps": 2000, "batch_size": 64, "group_size": 8, "max_policy_lag": 1,
        "time_limit_minutes": 8.0, "eval_games": 200, "eval_every": 10, "select_best": True,
        "checkpoint_every": 25,
        "warm_start": {"steps": 450, "batch_size": 32, "lr": 3e-3},
        "algorithm": {"name": "grpo", "critic": "none", "clip_low": 0.2, "clip_high": 0.2,
                      "kl_coef": 0.0, "entropy_coef": 0.0},
        "optim": {"lr": 2e-4},
        "placement": {"reference": 0},  # no KL term: nothing reads reference log-probs
    },
)
