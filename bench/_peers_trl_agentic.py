"""TRL's multi-turn side of `bench/peers.py --task agentic`: the agentic workload as a
`GRPOTrainer` `rollout_func`.

The episodes are `bench/_agentic_workload.py`'s: after every model turn the environment answers
through a tool with real latency (the sandboxed `python` tool every third turn, otherwise a
lognormal-latency lookup), for a heavy-tailed number of turns; the reward is
`work.episode_reward` of the episode's replies (the share of turns whose first digit is the
task's key), the function EARL's agent returns. Replies are decoded with special tokens written
out, as EARL's `AssistantTurn.text` is, so both sides score the same tokens the same way.
Environment-driven turns like these are what TRL's `rollout_func` is for (its OpenEnv
integration uses it); `tools=` / `environment_factory` only act on tool calls the
model emits in its chat template's syntax, which a model trained from random weights never does.

Two ways to play a batch, both through TRL's own generation path (`_generate_single_turn`, the
one its tool loop uses; its built-in loop calls tools one sample after another), chosen in the
same run by `bench/peers.py`: `Episodes` ("turn") generates every live episode's turn in one
batch, then runs every tool call at once, so each turn waits for the slowest tool; and
`PacedEpisodes` ("episode") lets each episode go at its own pace, generation batched over
whichever episodes are waiting for the model. The tool output goes in as a user message whose
tokens are the chat template's delta, found the way TRL's tool loop finds it (a dummy
conversation rendered with and without it). Environment tokens get `env_mask` 0, so only the
model's tokens are trained and counted.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _agentic_workload as work

Generate = Callable[[list[list[int]]], list[list[int]]]


def load_tasks(path: str) -> dict[int, dict[str, int]]:
    """The task file's samples by id (the prompt names its task id)."""
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    return {int(r["id"]): r for r in rows}


def task_of(messages: Sequence[dict[str, Any]], tasks: dict[int, dict[str, int]]
            ) -> dict[str, int]:
    """The sample a prompt was made from (its first message names the task)."""
    return tasks[work.task_id(str(messages[0]["content"]))]


class Episodes:
    """Plays a batch of episodes turn by turn: one batched generation per turn, then every live
    episode's tool call at once."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "A"}]
        self._base = self._render(dummy, False)
        self._dummy = dummy

    def _render(self, messages: list[dict[str, str]], gen: bool) -> list[int]:
        out = self.tok.apply_chat_template(messages, add_generation_prompt=gen, tokenize=True,
                                           return_dict=False)
        return list(out)

    def _suffix(self, text: str) -> list[int]:
        """Tokens the template adds for a user message after an assistant turn (TRL's way)."""
        full = self._render([*self._dummy, {"role": "user", "content": text}], True)
        return full[len(self._base):]

    def play(self, samples: list[dict[str, int]], generate: Generate) -> dict[str, Any]:
        """Runs every sample's episode; returns TRL's rollout fields, rewards and turn counts."""
        n = len(samples)
        prompt_ids = [self._render([work.first_message(s)], True) for s in samples]
        ids = [list(p) for p in prompt_ids]
        completion: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        replies: list[list[str]] = [[] for _ in range(n)]
        for turn in range(work.MAX_TURNS):
            live = [i for i in range(n) if turn < samples[i]["turns"]]
            if not live:
                break
            outs = generate([ids[i] for i in live])
            for i, out in zip(live, outs, strict=True):
                replies[i].append(self.tok.decode(out, skip_special_tokens=False))
                ids[i] += out
                completion[i] += out
                mask[i] += [1] * len(out)
            obs = asyncio.run(_observe_all([samples[i] for i in live], turn))
            for i, o in zip(live, obs, strict=True):
                if turn + 1 == samples[i]["turns"]:
                    continue  # the agent's last observation is never shown to the model
                suffix = self._suffix(o)
                ids[i] += suffix
                completion[i] += suffix
                mask[i] += [0] * len(suffix)
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "env_mask": mask,
                "episode_reward": [work.episode_reward(s, r)
                                   for s, r in zip(samples, replies, strict=True)],
                "turns": [s["turns"] for s in samples]}


class PacedEpisodes(Episodes):
    """Plays a batch of episodes each at its own pace: an episode generates as soon as its tool
    answered, batched with whichever episodes are waiting for the model at that moment (the
    generation runs in a thread while other episodes' tools run), so no episode waits for the
    slowest tool call of a turn. A `rollout_func` is arbitrary code: this is how a TRL user
    would write a multi-turn loop over tools that wait."""

    def play(self, samples: list[dict[str, int]], generate: Generate) -> dict[str, Any]:
        return asyncio.run(self._play(samples, generate))

    async def _play(self, samples: list[dict[str, int]], generate: Generate) -> dict[str, Any]:
        n = len(samples)
        prompt_ids = [self._render([work.first_message(s)], True) for s in samples]
        ids = [list(p) for p in prompt_ids]
        completion: list[list[int]] = [[] for _ in range(n)]
        mask: list[list[int]] = [[] for _ in range(n)]
        replies: list[list[str]] = [[] for _ in range(n)]
        waiting: dict[int, asyncio.Future[list[int]]] = {}
        ready = asyncio.Event()

        async def batcher() -> None:  # one generation at a time, over every waiting episode
            while True:
                await ready.wait()
                ready.clear()
                batch = dict(waiting)
                waiting.clear()
                outs = await asyncio.to_thread(generate, [ids[i] for i in batch])
                for fut, out in zip(batch.values(), outs, strict=True):
                    fut.set_result(out)

        async def episode(i: int) -> None:
            s = samples[i]
            for turn in range(s["turns"]):
                fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
                waiting[i] = fut
                ready.set()
                out = await fut
                replies[i].append(self.tok.decode(out, skip_special_tokens=False))
                ids[i] += out
                completion[i] += out
                mask[i] += [1] * len(out)
                obs = await work.observe(s, turn)
                if turn + 1 < s["turns"]:  # the last observation is never shown to the model
                    suffix = self._suffix(obs)
                    ids[i] += suffix
                    completion[i] += suffix
                    mask[i] += [0] * len(suffix)

        async with asyncio.TaskGroup() as tg:  # a failed generation ends the episodes too
            gen = tg.create_task(batcher())
            await asyncio.gather(*(episode(i) for i in range(n)))
            gen.cancel()
        return {"prompt_ids": prompt_ids, "completion_ids": completion, "env_mask": mask,
                "episode_reward": [work.episode_reward(s, r)
                                   for s, r in zip(samples, replies, strict=True)],
                "turns": [s["turns"] for s in samples]}


async def _observe_all(samples: list[dict[str, int]], turn: int) -> list[str]:
    """Every live episode's tool call for this turn, all at once."""
    return list(await asyncio.gather(*(work.observe(s, turn) for s in samples)))


def rollout_func(tasks: dict[int, dict[str, int]], tok: Any, turns_log: list[int],
                 pace: str = "episode") -> Callable[[list[Any], Any], dict[str, Any]]:
    """TRL's `rollout_func`: the episodes of the prompts it is given, sampled through the
    trainer's own generation path; `pace` "episode" (each at its own pace, `PacedEpisodes`) or
    "turn" (every live episode's turn generated together, then every tool call at once)."""
    if pace not in ("episode", "turn"):
        raise ValueError(f"pace {pace!r}: use 'episode' or 'turn'")
    episodes = PacedEpisodes(tok) if pace == "episode" else Episodes(tok)

    def run(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        def generate(batch: list[list[int]]) -> list[list[int]]:
            comp, _ = trainer._generate_single_turn(batch, None, {}, 1)
            return [list(c) for c in comp]

        out = episodes.play([task_of(p, tasks) for p in prompts], generate)
        turns_log.extend(out.pop("turns"))
        return {**out, "logprobs": None}

    return run


def episode_reward(prompts: list[Any], completions: list[Any], episode_reward: list[float],
                   **_: Any) -> list[float]:
    """TRL's reward function: the reward the episode earned (passed on by `rollout_func`)."""
    return list(episode_reward)


def greedy_eval(model: Any, tok: Any, path: str, max_tokens: int) -> dict[str, float]:
    """The held-out tasks played greedily through the same episode loop; mean reward."""
    import torch

    model.eval()
    pad = tok.pad_token_id

    def generate(batch: list[list[int]]) -> list[list[int]]:
        width = max(len(b) for b in batch)
        x = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        att = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        with torch.no_grad():
            out = model.generate(input_ids=x, attention_mask=att, do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=pad)
        res = []
        for row in out[:, width:].tolist():
            if tok.eos_token_id in row:
                row = row[:row.index(tok.eos_token_id) + 1]
            res.append(row)
        return res

    samples = list(load_tasks(path).values())
    rewards = Episodes(tok).play(samples, generate)["episode_reward"]
    return {"episodes": float(len(rewards)), "reward": sum(rewards) / len(rewards),
            "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards)}
