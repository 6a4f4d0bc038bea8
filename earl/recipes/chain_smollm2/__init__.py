"""The `chain_smollm2` recipe: SmolLM2-135M-Instruct learns multi-step word problems with a
one-operation calculator, by RL on a CPU, on a task that does not saturate at once.

The task is `earl.envs.chain.ChainTasks`: a quantity changed two or three times in words
("Then Ann gives away 12. After that the pile grows to 3 times its size."), the exact final
integer as the answer. The calculator (`earl.envs.chain.calculate`) does one operation on two
numbers per call, so the agent calls it once per step, feeding each result into the next call,
then answers (up to `MAX_TURNS` assistant turns); only a final answer without a tool call
scores (1 for the exact integer). Held-out tasks use frames (opening and question) no training
task uses; the step wordings are shared vocabulary. Training tasks take one to three steps,
held-out ones two or three: a one-step task ties one wording to one operation, so its groups
disagree more often and carry more signal.

RL settings (docs/results.md, "A multi-step tool task with headroom"): groups of 4, 16 a step, 64
out (the one-thread rollout then keeps a surplus of done groups for `filter_groups` to skip from;
with 8 a step it had none); a KL anchor to the warm start (`kl_coef` 0.05; without it the policy
drifted within 6-10 steps at lr 1e-4 to 3e-4); `filter_groups`, since the warm start leaves the
policy nearly deterministic (0.03-0.06 nats a token) and most groups score alike; sampling at
temperature 1.3 (log-probs of logits / 1.3 on every side), so that a wording the policy gets wrong
is sometimes got right and its group carries a gradient (it learned faster than at temperature 1 in
the runs there).

The warm start teaches the tool-call format and chaining only, on problems of another kind:
scripted transcripts of `earl.envs.chain.SymbolicTasks` ("Start with 54. Then / 2. Next + 29.
What is the result?"), whose operators are written as symbols. They hold no word problem, no
wording and no answer of the task: which operator a wording means, and which number a step
takes, is left to the base model's English and to RL. LoRA and bf16 as `calc_smollm2`.

Written against the public API only (`earl`, and the agent and env in `earl.agents` and
`earl.envs`).
"""

from __future__ import annotations

import json
import random
import re

from earl import (
    ChatCodec,
    EvalSet,
    Recipe,
    RolloutConfig,
    SamplingParams,
    SimConfig,
    SimEngine,
    native_dtype,
    run_agent,
    turn_targets,
)
from earl.agents.calc import solve
from earl.agents.tools import Tool
from earl.envs.chain import ChainTasks, SymbolicTasks, calculate, symbolic_steps
from earl.recipes.calc import calc_metric

__all__ = ["CALCULATOR", "MAX_TURNS", "agent", "recipe", "warm_start", "warm_start_responder"]

MAX_TOKENS = 40  # per turn: a tool call is ~30 tokens, an answer ~4
MAX_TURNS = 5  # three steps, the answer, and one retry
SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "One operation on two numbers, e.g. 12+7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}
CALCULATOR = Tool(name="calculator", fn=calculate, schema=SCHEMA)
_RESPONSE = re.compile(r"<tool_response>(.*?)</tool_response>", re.DOTALL)


async def agent(rollout, sample) -> float:  # type: ignore[no-untyped-def]
    """Solve one task: a calculator call per step, then the answer."""
    return await solve(rollout, sample, [CALCULATOR], max_turns=MAX_TURNS)


def warm_start_responder(codec: ChatCodec):  # type: ignore[no-untyped-def]
    """A scripted solver of `SymbolicTasks` (a SimEngine responder): the next operation on the
    last result (the start for the first), then the last result as the answer."""

    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        text = codec.decode(prompt_ids)
        question = text.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>", 1)[0]
        start, steps = symbolic_steps(question)
        results = [r.strip() for r in _RESPONSE.findall(text)]
        if len(results) < len(steps):
            op, b = steps[len(results)]
            left = results[-1] if results else str(start)
            call = {"name": "calculator", "arguments": {"expression": f"{left}{op}{b}"}}
            reply = f"<tool_call>{json.dumps(call)}</tool_call>"
        else:
            reply = results[-1]
        return codec.encode_text(reply) + [codec.end_id]

    return respond


async def warm_start(codec: ChatCodec, n: int, seed: int
                     ) -> tuple[list[object], list[object]]:
    """`n` scripted `SymbolicTasks` transcripts, every assistant token a target of weight 1."""
    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed),
                       responder=warm_start_responder(codec))
    # The script's turns are never cut: ~30 SmolLM2 tokens a call, ~75 for a char tokenizer.
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=128, stop_token_ids=codec.stop_ids))
    tasks = SymbolicTasks(seed=seed + 17)
    return turn_targets([await run_agent(agent, tasks.sample(k), engine=engine, codec=codec,
                                         config=cfg) for k in range(n)])


def _eval_tasks(split: str, step: int, n: int) -> list[object]:
    # "start" and "final" score the same held-out tasks; "validation" (model selection) others.
    return list(ChainTasks("eval", seed=1 if split == "validation" else 0).take(n))


recipe = Recipe(
    name="chain_smollm2",
    agent=agent,
    tasks=ChainTasks("train", seed=0, min_steps=1),
    eval=EvalSet(make=_eval_tasks),
    metric=calc_metric,
    target_key="accuracy",
    max_tokens=MAX_TOKENS,
    shared_group_task=True,
    warm_start=warm_start,
    config={
        "model": {"path": "smollm2-135m", "max_model_len": 640},
        "steps": 1000, "batch_size": 64, "group_size": 4, "max_policy_lag": 1,
        "max_concurrent_groups": 64,
        # the loop's limit: it ends at the first step end past it; with the start-up, the warm
        # start and both evals (the final one up to ~5 min) the run is <= 45 min
        "time_limit_minutes": 38.0, "eval_games": 200, "eval_every": 0, "select_best": False,
        "checkpoint_every": 50,
        "warm_start": {"steps": 60, "batch_size": 8, "lr": 1e-3},
        "lora": {"rank": 16, "alpha": 32.0},
        "algorithm": {"name": "grpo", "critic": "none", "clip_low": 0.2, "clip_high": 0.2,
                      "kl_coef": 0.05, "entropy_coef": 0.0, "filter_groups": True,
                      "temperature": 1.3},
        "optim": {"lr": 1e-4},
        # 8,192 tokens a micro-batch: at 16,384 (calc_smollm2's) the trainer's logits over
        # ~400-token samples took 12.8 GB and were OOM-killed beside other work on a 23 GB machine
        "placement": {"reference": 0, "dtype": native_dtype(), "shared_prefix": True,
                      "micro_batch_tokens": 8192},
    },
)
