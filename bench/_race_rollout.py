"""TRL's multi-turn rollout for `bench/race_chain.py`: the `chain_smollm2` recipe's own agent
played through a `GRPOTrainer` `rollout_func`, each episode at its own pace.

TRL's docs have a multi-turn environment plug into `GRPOTrainer(rollout_func=...)`: a function
that gets a batch of prompts and the trainer, plays them with the trainer's generation, and
returns `prompt_ids`, `completion_ids`, `logprobs` and, for tokens the model did not write, an
`env_mask` (0 on tool output). Here the episode is the recipe's agent coroutine itself
(`earl.recipes.chain_smollm2.agent`: the calculator once per step, then the answer), run by
`earl.run_agent` against `BatchedEngine`, an `earl.Engine` whose every `generate` waits in a
queue that one generation call at a time empties: whichever episodes wait for the model are
generated together (TRL's `_generate_single_turn`, the path its own tool loop uses), while the
others run their calculator. So both sides play the same prompts, chat template, tool-call
syntax, tool and reward; only the generation and the trainer differ.

Not here: the trainer's configuration (`bench/_race_trl.py`), evaluation (the harness
evaluates both sides' saved policies with one evaluator).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

from earl import (
    ContextLengthError,
    Generation,
    RolloutConfig,
    SamplingParams,
    Trajectory,
    run_agent,
)

__all__ = ["BatchedEngine", "episode_reward", "play", "rollout_func", "sampling", "trl_fields"]

GenerateBatch = Callable[[list[list[int]]], list[list[int]]]


class BatchedEngine:
    """An `earl.Engine` over a blocking batch generator (prompt ids -> completion ids, cut
    after the stop token): requests that arrive while a batch runs wait for the next one.
    `serve()` generates; run it in the task group of the episodes it serves.

    Args:
        generate_batch: runs in a worker thread, one call at a time.
        window: the context length; a prompt that leaves no room for `max_tokens` raises
            `ContextLengthError`, as the vLLM engine does.
        stop_ids: tokens that end a turn (for `finish_reason`).
    """

    def __init__(self, generate_batch: GenerateBatch, *, window: int, stop_ids: Sequence[int]
                 ) -> None:
        self.generate_batch, self.window, self.stop_ids = generate_batch, window, set(stop_ids)
        self._waiting: list[tuple[list[int], asyncio.Future[list[int]]]] = []
        self._ready = asyncio.Event()
        self.batches: list[int] = []  # how many requests each generation call served

    @property
    def policy_version(self) -> int:
        return 0

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                       session_id: str | None = None) -> Generation:
        if len(prompt_ids) + params.max_tokens > self.window:
            raise ContextLengthError(f"prompt ({len(prompt_ids)} tokens) + max_tokens "
                                     f"({params.max_tokens}) exceeds the window {self.window}")
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiting.append((list(prompt_ids), fut))
        self._ready.set()
        out = await fut
        finish = "stop" if out and out[-1] in self.stop_ids else "length"
        return Generation(token_ids=out, logprobs=[0.0] * len(out), versions=[0] * len(out),
                          finish_reason=finish, prompt_tokens=len(prompt_ids))

    async def serve(self) -> None:
        """Forever: generate for every request waiting; a failed call fails the episodes
        that waited on it (`run_agent` reports them) and serving goes on."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            batch, self._waiting = self._waiting, []
            if not batch:
                continue
            self.batches.append(len(batch))
            try:
                outs = await asyncio.to_thread(self.generate_batch, [p for p, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting episode fails with it
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            for (_, fut), out in zip(batch, outs, strict=True):
                fut.set_result(list(out))


async def play(agent: Any, samples: Sequence[object], engine: BatchedEngine, codec: Any,
               config: RolloutConfig) -> list[Trajectory]:
    """Every sample's episode at once against `engine` (served while they run)."""
    async with asyncio.TaskGroup() as tg:
        server = tg.create_task(engine.serve())
        trajs = await asyncio.gather(*(run_agent(agent, s, engine=engine, codec=codec,
                                                 config=config) for s in samples))
        server.cancel()
    return list(trajs)


def trl_fields(trajectories: Sequence[Trajectory], end_id: int) -> dict[str, list[Any]]:
    """What a `rollout_func` returns for played trajectories: the prompt (every token before
    the first assistant turn), the rest as the completion with `env_mask` 1 on the model's
    tokens only, and the reward (a failed episode scores 0). A trajectory without a turn (its
    prompt did not fit) gets a one-token completion (`end_id`) that is not trained."""
    out: dict[str, list[Any]] = {"prompt_ids": [], "completion_ids": [], "env_mask": [],
                                 "episode_reward": [], "model_turns": [], "failed": []}
    for t in trajectories:
        start = t.turn_spans[0][0] if t.turn_spans else len(t.token_ids)
        completion, mask = t.token_ids[start:], t.loss_mask[start:]
        if not completion:
            completion, mask = [end_id], [0]
        out["prompt_ids"].append(list(t.token_ids[:start]))
        out["completion_ids"].append(list(completion))
        out["env_mask"].append(list(mask))
        out["episode_reward"].append(float(t.reward or 0.0))
        out["model_turns"].append(len(t.turn_spans))
        out["failed"].append(bool(t.failed))
    return out


def rollout_func(agent: Any, tasks: dict[str, object], codec: Any,
                 config: RolloutConfig, log: list[dict[str, float]]
                 ) -> Callable[[list[Any], Any], dict[str, Any]]:
    """TRL's `rollout_func`: each prompt's episode played by `agent` through the trainer's own
    generation, every episode at its own pace.

    Args:
        agent: the recipe's agent coroutine `(rollout, task) -> reward`.
        tasks: the train tasks by question (a prompt is `[{"role": "user", "content": q}]`).
        codec: the `earl.ChatCodec` of the model's tokenizer.
        config: per-turn sampling cap, stop tokens, context window (as EARL's producers).
        log: gets one row per call: its seconds, episodes, model turns, generation calls,
            failures.
    """

    def run(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        def generate(batch: list[list[int]]) -> list[list[int]]:
            comp, _ = trainer._generate_single_turn(batch, None, {}, 1)
            return [list(c) for c in comp]

        engine = BatchedEngine(generate, window=config.context_window or 1 << 30,
                               stop_ids=codec.stop_ids)

        samples = [tasks[str(p[-1]["content"])] for p in prompts]
        t0 = time.perf_counter()
        out = trl_fields(asyncio.run(play(agent, samples, engine, codec, config)), codec.end_id)
        log.append({"s": round(time.perf_counter() - t0, 2), "episodes": float(len(prompts)),
                    "turns": float(sum(out.pop("model_turns"))),
                    "failed": float(sum(out.pop("failed"))),
                    "generate_calls": float(len(engine.batches))})
        return {**out, "logprobs": None}

    return run


def episode_reward(prompts: list[Any], completions: list[Any], episode_reward: list[float],
                   **_: Any) -> list[float | None]:
    """TRL's reward function: the reward the recipe's agent gave the episode."""
    return list(episode_reward)


def sampling(max_tokens: int, temperature: float, stop_ids: Sequence[int], window: int,
             max_total_tokens: int | None) -> RolloutConfig:
    """The rollout limits EARL's producers give the recipe's agent (`ProducerActor`)."""
    return RolloutConfig(sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                 stop_token_ids=list(stop_ids)),
                         max_total_tokens=max_total_tokens, context_window=window)
