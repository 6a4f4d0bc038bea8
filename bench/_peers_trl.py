"""TRL's side of `bench/peers.py`: one `GRPOTrainer` run in its own process, one JSON line out.

    python bench/_peers_trl.py '{"task": "agentic", "model": DIR, "train": FILE, "seconds": 60, ...}'

The configuration is TRL's natural one on CPU: transformers generation (`use_vllm=False`), one
process, torch with `threads` threads, fp32, plain GRPO (`beta=0`, clip 0.2, token-mean "dapo"
loss, rewards centred per group without std scaling, `steps_per_generation` optimizer steps per
generation batch, 1 by default), constant LR, AdamW. The agentic task's multi-turn episodes run
through a `rollout_func` (`bench/_peers_trl_agentic.py`); the echo task through TRL's own
single-turn generation. The run stops through a callback once the process is `seconds` old
(start-up counts, as in `earl train`'s `time_limit_minutes`). Afterwards the trained model is
evaluated greedily on the task's eval prompts with the same reward rule. This script only runs
TRL; the parent measures the process tree's memory and compares.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _peers_task


def _reward_fn(prompts: list[Any], completions: list[Any], answer: list[str],
               **_: Any) -> list[float]:
    """TRL's reward signature around `_peers_task.reward` (conversational completions)."""
    out = []
    for comp, ans in zip(completions, answer, strict=True):
        text = comp[0]["content"] if isinstance(comp, list) else str(comp)
        out.append(_peers_task.reward({"answer": ans}, text))
    return out


def _greedy_eval(model: Any, tok: Any, max_tokens: int) -> dict[str, float]:
    """Greedy answers to every eval prompt, scored like EARL's eval: mean reward, exact share."""
    import torch

    model.eval()
    rewards = []
    with torch.no_grad():
        for s in _peers_task.eval_samples():
            ids = tok.apply_chat_template([{"role": "user", "content": s["question"]}],
                                          add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
            gen = model.generate(**ids, do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=tok.pad_token_id)
            text = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
            rewards.append(_peers_task.reward(s, text))
    n = len(rewards)
    return {"episodes": float(n), "reward": sum(rewards) / n,
            "accuracy": sum(r >= 1.0 for r in rewards) / n}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Trains with TRL until `cfg["seconds"]` since process start (EARL's `time_limit_minutes`
    rule); returns step times, rewards and the final eval."""
    import psutil
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(int(cfg["threads"]))
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    rows = [json.loads(x) for x in Path(cfg["train"]).read_text().splitlines() if x.strip()]
    agentic = cfg.get("task") == "agentic"
    turns: list[int] = []
    extra: dict[str, Any] = {}
    if agentic:  # multi-turn episodes through a rollout_func (bench/_peers_trl_agentic.py)
        import _agentic_workload as work
        import _peers_trl_agentic as ag

        data = Dataset.from_list([{"prompt": [work.first_message(r)]} for r in rows])
        reward_fn: Any = ag.episode_reward
        extra["rollout_func"] = ag.rollout_func(ag.load_tasks(cfg["train"]), tok, turns,
                                                pace=str(cfg.get("pace", "episode")))
        os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    else:
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                                   "answer": r["answer"]} for r in rows])
        reward_fn = _reward_fn
    steps: list[dict[str, float]] = []
    last: dict[str, float] = {}  # the latest generation's reward and mean length

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Logs each optimizer step's end time and reward; stops the run at the wall budget.
        With `steps_per_generation` > 1 only the first step after a generation logs its
        reward and lengths (for the whole generation); the steps after it carry them on."""

        t0 = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            Clock.t0 = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            if logs and "reward" in logs:
                last.update(reward=float(logs["reward"]),
                            gen_len=float(logs.get("completions/mean_length", 0.0)))
            if logs and "loss" in logs and last:  # one per optimizer step
                steps.append({"step": state.global_step, "t": time.perf_counter() - Clock.t0,
                              "wall_s": time.time() - psutil.Process().create_time(),
                              **last})
            if time.time() - psutil.Process().create_time() >= cfg["seconds"]:
                control.should_training_stop = True

    args = GRPOConfig(
        output_dir=cfg["out"], use_cpu=True, seed=int(cfg["seed"]),
        per_device_train_batch_size=int(cfg["batch_size"]), num_generations=int(cfg["group_size"]),
        steps_per_generation=int(cfg.get("steps_per_generation", 1)), num_iterations=1,
        max_completion_length=int(cfg["max_tokens"]),
        temperature=float(cfg["temperature"]), top_p=1.0, beta=0.0, epsilon=float(cfg["clip"]),
        loss_type="dapo", scale_rewards="none", learning_rate=float(cfg["lr"]),
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", max_steps=100_000, logging_steps=1, save_strategy="no",
        report_to="none", bf16=False, disable_dropout=True, dataloader_num_workers=0,
        adam_beta1=0.9, adam_beta2=0.99,  # EARL's AdamW betas (OptimConfig.betas)
        # TRL's default is on; its help puts the cost at ~20% of speed: both are tried
        gradient_checkpointing=bool(cfg.get("gradient_checkpointing", False)),
        # TRL's own generation options, tried by bench/peers.py
        use_transformers_continuous_batching=cfg.get("generation") == "continuous_batching",
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3}
           if cfg.get("generation") == "vllm_colocate" else {}))
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Clock()], **extra)
    trainer.train()
    loop_s = time.perf_counter() - Clock.t0
    if agentic:
        final = ag.greedy_eval(trainer.model, tok, cfg["eval"], int(cfg["max_tokens"]))
    else:
        final = _greedy_eval(trainer.model, tok, int(cfg["max_tokens"]))
    return {"steps": steps, "loop_s": loop_s, "final_eval": final,
            "turns_mean": sum(turns) / len(turns) if turns else 1.0,
            "wall_s": time.time() - psutil.Process().create_time(),
            "batch_size": int(cfg["batch_size"])}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
