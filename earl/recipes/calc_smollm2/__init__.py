"""The `calc_smollm2` recipe: a real pretrained LLM (SmolLM2-135M-Instruct) learns multi-turn
tool use by RL on a CPU.

The task is the `calc` recipe's (`earl.envs.arithmetic.CalcTasks`: six one-operator word
problems, two wordings per operator, held-out expressions for evaluation), played by an agent
that calls a calculator, reads the result and answers; only a final answer without a tool call
scores (1 for the exact integer). The base model never calls the tool, so every episode scores 0
before the warm start.

The warm start is supervised, on transcripts the environment generates with an imperfect
demonstrator (`earl.envs.arithmetic.demo_expression`): it calls the calculator on the
question's two numbers with the right operator for one wording per operator ("gets", "loses",
"buys") and a random one for the other wording, then answers with the tool's result. The
warm-started policy has the format and half the wordings; GRPO has to learn the other half
("found more", "gave away", "boxes of") from the reward. Templates come in turn
(`CalcTasks(cycle=True)`), so each step's six groups hold every wording once. LoRA adapters keep
the trainer fast enough on two cores (rank 16 on every linear layer; the rollout serves the
merged weights); bf16 autocast where the CPU has bf16 instructions. The tool's schema is kept
short: the prompt is ~185 tokens of the ~250 a sample holds.

Written against the public API only (`earl`, and the task's agent and env in `earl.agents`
and `earl.envs`).
"""

from __future__ import annotations

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
from earl.envs.arithmetic import CalcTasks, demo_expression, evaluate, quantities
from earl.recipes.calc import calc_metric, warm_start_responder

__all__ = ["agent", "calculator_for", "recipe", "warm_start"]

MAX_TOKENS = 40  # per turn: a tool call is ~30 tokens, an answer ~4
SCHEMA = {"type": "function", "function": {
    "name": "calculator",
    "description": "Arithmetic on numbers, e.g. 12+7",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


def calculator_for(question: str) -> Tool:
    """The calculator of one question (a per-episode tool: a, b are its numbers)."""
    names = quantities(question)
    return Tool(name="calculator", fn=lambda expression: evaluate(expression, names),
                schema=SCHEMA)


async def agent(rollout, sample) -> float:  # type: ignore[no-untyped-def]
    """Solve one task: calculator calls, then the answer (up to 3 assistant turns)."""
    return await solve(rollout, sample, [calculator_for(str(sample["question"]))])


async def warm_start(codec: ChatCodec, n: int, seed: int
                     ) -> tuple[list[object], list[object]]:
    """`n` scripted transcripts on training tasks, every assistant token a target of weight 1:
    the calculator on the question's two numbers joined by the demonstrator's operator
    (`demo_expression`), then the tool's result as the answer."""
    engine = SimEngine(SimConfig(time_scale=0.0, seed=seed),
                       responder=warm_start_responder(codec, demo_expression))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=MAX_TOKENS,
                                                stop_token_ids=codec.stop_ids))
    tasks = CalcTasks("train", seed=seed + 17)
    return turn_targets([await run_agent(agent, tasks.sample(k), engine=engine, codec=codec,
                                         config=cfg) for k in range(n)])


def _eval_tasks(split: str, step: int, n: int) -> list[object]:
    # "start" and "final" score the same held-out tasks; "validation" (model selection) others.
    return list(CalcTasks("eval", seed=1 if split == "validation" else 0).take(n))


recipe = Recipe(
    name="calc_smollm2",
    agent=agent,
    tasks=CalcTasks("train", seed=0, cycle=True),
    eval=EvalSet(make=_eval_tasks),
    metric=calc_metric,
    target_key="accuracy",
    max_tokens=MAX_TOKENS,
    shared_group_task=True,
    warm_start=warm_start,
    config={
        "model": {"path": "smollm2-135m", "max_model_len": 512},
        "steps": 1000, "batch_size": 48, "group_size": 8, "max_policy_lag": 1,
        "time_limit_minutes": 10.0, "eval_games": 200, "eval_every": 0, "select_best": False,
        "checkpoint_every": 50,
        "warm_start": {"steps": 20, "batch_size": 8, "lr": 1e-3},
        "lora": {"rank": 16, "alpha": 32.0},
        "algorithm": {"name": "grpo", "critic": "none", "clip_low": 0.2, "clip_high": 0.2,
                      "kl_coef": 0.0, "entropy_coef": 0.0},
        "optim": {"lr": 3e-4},
        "placement": {"reference": 0, "dtype": native_dtype(), "shared_prefix": True,
                      "micro_batch_tokens": 16384},
    },
)
