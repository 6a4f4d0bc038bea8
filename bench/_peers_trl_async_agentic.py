"""The agentic task of `bench/peers.py` for TRL's `AsyncGRPOTrainer` (`bench/_peers_trl_async.py`):
a rollout-worker plug-in, the kind TRL's `rollout_worker` argument takes.

`AgenticRolloutWorker` is TRL's own `AsyncRolloutWorker` (a spawned child process that streams
`/v1/completions` from the vLLM server, scores whole groups and queues samples for the trainer)
whose loop plays one episode of `bench/_agentic_workload.py` where TRL's plays one conversation:
`_generate_one` is replaced and the episode's reward handed back as a per-rollout reward
(`_provides_rollout_reward`), which is how TRL plugs its own OpenEnv agent loop in
(`trl.experimental.async_grpo.openenv_harness.HarnessRolloutWorker`). Every episode is its own
task on the worker's event loop (up to `max_inflight_tasks` at once) and goes at its own pace:
each model turn is one request (the server batches whatever requests are pending), each tool is
awaited by its episode alone.

Tokens are handled as in `bench/_peers_trl_agentic.py`: the next turn's prompt is the previous
prompt, the reply's sampled tokens and the chat template's delta for the tool's output (a user
message, found the way TRL's tool loop finds it). Each turn is one of TRL's `TurnRecord`s and TRL's
reconciler (`_chain_to_sequences`) builds the training row: the model's tokens trained with their
sampled logprobs, the environment's tokens context (mask 0). TRL's default loop instead re-renders
the conversation from decoded messages every turn; a reply cut at `max_tokens` then gains an end
token it never sampled, and the reconciler demotes the drifted tail to context, so sampled tokens
would go untrained. TRL's tool loop (`tools=`) is not used for the reason given in
`_peers_trl_agentic.py`: it only calls tools the model asks for in its template's syntax.

The reward is `work.episode_reward` of the replies decoded with special tokens written out, the
rule `_peers_trl_agentic.py` and EARL's agent apply; TRL then centres it per group and divides by
the group's std (its only advantage rule). Each trained sample also carries a ``turns`` metric
(its model turns), which the trainer averages per step like its reward.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

from trl.experimental.async_grpo.async_rollout_worker import (
    AsyncRolloutWorker,
    RolloutGroup,
    RolloutSample,
    TurnRecord,
    _AsyncRolloutLoop,
    _chain_to_sequences,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _agentic_workload as work
import _peers_trl_agentic as ag

Episode = tuple[list[dict[str, str]], list[int], list[Any], int, int, float]


class AgenticLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (in the worker's child process) playing agentic episodes.

    Args:
        tasks_path: the task file the dataset's prompts were made from (JSON lines); a prompt's
            first message names its task.
        **loop_kwargs: TRL's `_AsyncRolloutLoop` arguments.
    """

    _provides_rollout_reward = True

    def __init__(self, *, tasks_path: str, **loop_kwargs: Any) -> None:
        super().__init__(**loop_kwargs)
        self.tasks = ag.load_tasks(tasks_path)
        self.render = ag.Episodes(self.tokenizer)  # the chat template's prompt and deltas
        self.reward_func_names.append("episode_reward")

    async def _generate_one(self, prompt: list[dict[str, str]], tool_dict: Any, tools: Any,
                            group_id: int = 0) -> Episode:
        """One episode: every model turn, then its tool's answer; returns TRL's rollout tuple
        (completion messages, the model's tokens, training rows, tool calls, failed tool calls,
        the episode's reward). A tool that raises answers with its error, as in TRL's tool loop
        (`_execute_tool_calls`): the sandbox's wall limit can trip on a loaded machine."""
        t0 = time.monotonic()
        sample = ag.task_of(prompt, self.tasks)
        ids = self.render._render(list(prompt), True)
        turns: list[TurnRecord] = []
        replies: list[str] = []
        completion: list[dict[str, str]] = []
        model_ids: list[int] = []
        failures = 0
        for turn in range(sample["turns"]):
            out, logprobs = await self._generate_one_turn(ids)
            turns.append(TurnRecord(list(ids), list(out), list(logprobs)))
            reply = self.tokenizer.decode(out, skip_special_tokens=False)
            replies.append(reply)
            completion.append({"role": "assistant", "content": reply})
            model_ids += out
            ids = ids + list(out)
            t_tool = time.monotonic()
            try:  # waited on even after the last turn
                obs = await work.observe(sample, turn)
            except (RuntimeError, OSError) as error:  # as TRL's tool loop: answers the error
                failures += 1
                obs = str({"error": str(error)})
            self._rates["tools/latency_s"][0] += time.monotonic() - t_tool
            self._rates["tools/latency_s"][1] += 1
            if turn + 1 < sample["turns"]:  # the last observation is never shown to the model
                ids = ids + self.render._suffix(obs)
                completion.append({"role": "user", "content": obs})
        sequences, tally = _chain_to_sequences(turns, uuid.uuid4().hex, self._fork_threshold_tokens)
        self._push_rollout_metrics(turns=len(turns), sequences=len(sequences),
                                   completion_ids=model_ids, tally=tally, loop_exhausted=False,
                                   duration_s=time.monotonic() - t0)
        return (completion, model_ids, sequences, len(turns), failures,
                work.episode_reward(sample, replies))

    async def _score_group(self, group: RolloutGroup) -> list[RolloutSample]:
        samples = await super()._score_group(group)
        for s in samples:
            s.metrics["turns"] = float(sum(m["role"] == "assistant" for m in s.completion))
        return samples


class AgenticRolloutWorker(AsyncRolloutWorker):
    """TRL's `AsyncRolloutWorker` running `AgenticLoop`; pass it as
    `AsyncGRPOTrainer(rollout_worker=...)`, built with `tasks_path` and the arguments the trainer
    gives its default worker."""

    _loop_cls = AgenticLoop
