"""TRL's side of `bench/race_chain.py`: one `GRPOTrainer` run of the `chain_smollm2` task in its
own process, one JSON line out.

    python bench/_race_trl.py '{"out": DIR, "seconds": 2700, "points": [300, ...],
                                "arm": {"gradient_checkpointing": false,
                                        "generation": "transformers"}, "threads": 2,
                                "micro_batch": 16}'

Everything the two sides share is read from EARL's recipe, not copied: `earl.config.load_config`
on `--recipe=chain_smollm2` (plus the harness's overrides, the same ones EARL gets) gives the
model, LoRA, warm start, group size, batch, staleness bound, temperature, clip, KL, LR and AdamW
settings; `earl.recipe.load_recipe` the agent, train tasks, per-turn token cap and warm-start
transcripts.

1. Warm start, as EARL's (`earl.learner.Learner.warm_start`): the recipe's transcripts
   (`recipe.warm_start(codec, max(4 x batch, 512), seed)`), LoRA adapters trained for
   `warm_start.steps` steps of `warm_start.batch_size` random transcripts (generator seed
   1234) at `warm_start.lr` on the assistant tokens, bf16 autocast where the recipe's dtype is
   bf16, then merged into the weights: the RL start, written to `<out>/start`.
2. RL, written as TRL's docs have it: `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...),
   train_dataset, peft_config=LoraConfig(...), rollout_func=...)`. The multi-turn episodes run
   in the `rollout_func` (`bench/_race_rollout.py`, each episode at its own pace, generation
   through TRL's own `_generate_single_turn`), `env_mask` 0 on tool output. An optimizer step
   trains EARL's batch in `micro_batch` pieces (gradient accumulation); one generation feeds
   EARL's bound plus one optimizer steps (samples at most `max_policy_lag` versions old);
   `beta` EARL's `kl_coef`, clip `epsilon`/`epsilon_high`, token-mean loss (`dapo`),
   group-centred rewards (`scale_rewards` "none" unless EARL divides by the std), constant LR,
   grad clip, AdamW betas.
   The arm chooses TRL's own speed options: `gradient_checkpointing`, and `generation`
   "transformers" (plain `generate`), "continuous_batching"
   (`use_transformers_continuous_batching`) or "vllm_colocate" (`use_vllm`, colocate mode).
   With ``"start": DIR`` the run begins from that warm-started folder instead (the harness's
   speed screen: every arm from one warm start); ``"warm_start_only": true`` writes
   `<out>/start` and stops there; ``"whole_generations": true`` stops at the budget only
   where a generation's optimizer steps are all done (a screen's rate then covers whole cycles).
3. Snapshots: the adapter is saved after every optimizer step (and once before the first);
   for each evaluation point the snapshot in force then (the last saved at or before it) is
   kept, the others deleted. The run stops at the first step end once the process is
   `seconds` old (its start-up counts, EARL's `time_limit_minutes` rule).

The harness evaluates the kept snapshots afterwards (merged into `<out>/start`), with the same
evaluator as EARL's, and measures this process' CPU time and memory from outside.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _race_rollout as rr
from _race_measure import policy_at

TASKS = 5000  # train tasks in the dataset (TRL repeats each num_generations times)


def _age() -> float:
    import psutil

    return time.time() - psutil.Process().create_time()


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer and chat template files of an HF folder (as EARL's `save_hf` copies)."""
    for f in src.iterdir():
        if f.is_file() and ("token" in f.name or f.name.endswith((".jinja", ".txt"))):
            shutil.copy2(f, dst / f.name)


def warm_start(model: Any, run: Any, recipe: Any, codec: Any) -> tuple[Any, list[float]]:
    """EARL's supervised warm start on the recipe's transcripts (see the module docstring);
    returns the merged model and its loss every 25 steps."""
    import peft
    import torch

    w = run.warm_start
    if w.steps == 0 or recipe.warm_start is None:
        return model, []
    ids, tgts = asyncio.run(recipe.warm_start(codec, max(4 * w.batch_size, 512), run.seed))
    torch.manual_seed(run.seed)  # as the Learner: its seed, then fresh adapters
    lm = peft.get_peft_model(model, _lora(run))
    lm.train()
    opt = torch.optim.AdamW([p for p in lm.parameters() if p.requires_grad], lr=w.lr,
                            weight_decay=0.0)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) \
        if run.placement.dtype == "bfloat16" else contextlib.nullcontext()
    gen = torch.Generator().manual_seed(1234)
    pad = codec.end_id
    losses: list[float] = []
    for step in range(w.steps):
        idx = torch.randint(0, len(ids), (min(w.batch_size, len(ids)),), generator=gen).tolist()
        width = max(len(ids[i]) for i in idx)
        x = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        rows, pos, tok, wt = [], [], [], []
        for j, i in enumerate(idx):
            x[j, :len(ids[i])] = torch.from_numpy(ids[i])
            att[j, :len(ids[i])] = 1
            t = torch.from_numpy(tgts[i])
            rows.append(torch.full((len(t),), j, dtype=torch.long))
            pos.append(t[:, 0].long() - 1)  # logits at pos-1 predict pos
            tok.append(t[:, 1].long())
            wt.append(t[:, 2].float())
        r, p, c, ws = torch.cat(rows), torch.cat(pos), torch.cat(tok), torch.cat(wt)
        with autocast:
            logits = lm(input_ids=x, attention_mask=att).logits[r, p].float()
        loss = -(torch.log_softmax(logits, -1)[torch.arange(len(c)), c] * ws).sum() / ws.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 0 or step == w.steps - 1:
            losses.append(round(loss.item(), 4))
    return lm.merge_and_unload(), losses


def _lora(run: Any) -> Any:
    """EARL's adapters (`earl.stages.lora.apply_lora`'s peft config) from the run's config."""
    import peft

    lo = run.lora
    return peft.LoraConfig(r=lo.rank, lora_alpha=lo.alpha, target_modules=lo.target_modules(),
                           lora_dropout=lo.dropout, bias="none", task_type="CAUSAL_LM")


def grpo_args(run: Any, cfg: dict[str, Any], max_tokens: int) -> Any:
    """TRL's config for EARL's run settings and this arm's speed options."""
    from trl import GRPOConfig

    a, o, arm = run.algorithm, run.optim, cfg["arm"]
    micro = min(int(cfg.get("micro_batch", run.batch_size)), run.batch_size)
    if run.batch_size % micro or micro % run.group_size:
        raise ValueError(f"--trl-micro-batch {micro} must divide the batch ({run.batch_size}) "
                         f"and be a multiple of the group size ({run.group_size})")
    generation = arm.get("generation", "transformers")
    return GRPOConfig(
        output_dir=str(Path(cfg["out"]) / "trl"), use_cpu=True, seed=run.seed,
        # an optimizer step trains EARL's batch in micro-batches (TRL's way to fit memory); a
        # generation feeds lag + 1 optimizer steps
        per_device_train_batch_size=micro, gradient_accumulation_steps=run.batch_size // micro,
        generation_batch_size=run.batch_size * (run.max_policy_lag + 1),
        num_generations=run.group_size, num_iterations=1,
        max_completion_length=max_tokens, temperature=a.temperature, top_p=1.0,
        beta=a.kl_coef, epsilon=a.clip_low, epsilon_high=a.clip_high, loss_type="dapo",
        scale_rewards="group" if a.normalize_std else "none",
        learning_rate=o.lr, lr_scheduler_type="constant", warmup_steps=o.warmup_steps,
        weight_decay=o.weight_decay, max_grad_norm=o.grad_clip, adam_beta1=o.betas[0],
        adam_beta2=o.betas[1], adam_epsilon=o.adam_eps, optim="adamw_torch",
        bf16=run.placement.dtype == "bfloat16", max_steps=1_000_000, logging_steps=1,
        save_strategy="no", report_to="none", disable_dropout=True, dataloader_num_workers=0,
        gradient_checkpointing=bool(arm.get("gradient_checkpointing", False)),
        use_transformers_continuous_batching=generation == "continuous_batching",
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3,
            "vllm_max_model_length": run.model.max_model_len}
           if generation == "vllm_colocate" else {}))


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Warm start, then GRPO until `cfg["seconds"]` of process age; returns step records,
    the snapshots kept for each point and the rollout log."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from earl import ChatCodec
    from earl.config import load_config
    from earl.models.smollm2 import resolve_model
    from earl.recipe import load_recipe

    torch.set_num_threads(int(cfg["threads"]))
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    run = load_config(None, ["--recipe=chain_smollm2", *cfg.get("overrides", [])])
    recipe = load_recipe(run.recipe)
    base = Path(resolve_model(run.model.path))
    tok = AutoTokenizer.from_pretrained(base)
    codec = ChatCodec(tok)
    max_tokens = run.max_tokens or recipe.max_tokens
    t_ws = time.perf_counter()
    if cfg.get("start"):  # a warm start written before (a speed screen's shared one)
        start = Path(cfg["start"])
        model = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
        ws_losses: list[float] = []
    else:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model, ws_losses = warm_start(model, run, recipe, codec)
        start = out / "start"
        model.save_pretrained(start)
        copy_tokenizer(base, start)
    ws_s = time.perf_counter() - t_ws
    if cfg.get("warm_start_only"):
        return {"start": str(start), "warm_start_s": round(ws_s, 1),
                "warm_start_loss": ws_losses}
    saved: list[tuple[float, str]] = [(_age(), "start")]
    snaps = out / "snapshots"
    points: list[float] = [float(t) for t in cfg["points"]]

    samples: list[Any] = [recipe.tasks.sample(k) for k in range(TASKS)]
    tasks: dict[str, object] = {str(t["question"]): t for t in samples}
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}]} for q in tasks])
    rollouts: list[dict[str, float]] = []
    config = rr.sampling(max_tokens, run.algorithm.temperature, codec.stop_ids,
                         run.model.max_model_len, recipe.max_total_tokens)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental
    steps: list[dict[str, float]] = []
    last: dict[str, float] = {}
    per_generation = run.max_policy_lag + 1  # optimizer steps one generation feeds

    def snapshot(model: Any, name: str) -> None:
        """Save the adapter as `name`; keep only what some passed point needs, and the latest."""
        model.save_pretrained(snaps / name)
        saved.append((_age(), name))
        keep = {policy_at(saved, t) for t in points if t <= saved[-1][0]} | {name, "start"}
        for _, old in saved:
            if old not in keep and (snaps / old).exists():
                shutil.rmtree(snaps / old)

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Logs each optimizer step (process age, reward, model tokens a trajectory), saves
        its snapshot, and stops the run at the budget."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                           **kw: Any) -> None:
            snapshot(model, "s0")

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            if logs and "reward" in logs:
                last.update(reward=float(logs["reward"]),
                            gen_len=float(logs.get("completions/mean_length", 0.0)))
            if logs and "loss" in logs and last:
                steps.append({"step": state.global_step, "wall_s": round(_age(), 2), **last})

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kw: Any) -> None:
            snapshot(model, f"s{state.global_step}")
            whole = not cfg.get("whole_generations") or state.global_step % per_generation == 0
            if _age() >= cfg["seconds"] and whole:
                control.should_training_stop = True

    trainer = GRPOTrainer(model=model, reward_funcs=rr.episode_reward,
                          args=grpo_args(run, cfg, max_tokens), train_dataset=data,
                          processing_class=tok, callbacks=[Clock()], peft_config=_lora(run),
                          rollout_func=rr.rollout_func(recipe.agent, tasks, codec, config,
                                                       rollouts))
    t_loop, loop_start_s = time.perf_counter(), _age()
    trainer.train()
    return {"steps": steps, "saved": saved,
            "points": [{"t_s": t, "policy": policy_at(saved, t)} for t in points],
            "rollouts": rollouts, "wall_s": round(_age(), 1),
            "loop_s": round(time.perf_counter() - t_loop, 1),
            "loop_start_s": round(loop_start_s, 2), "warm_start_s": round(ws_s, 1),
            "warm_start_loss": ws_losses, "batch_size": run.batch_size,
            "group_size": run.group_size, "optimizer_steps_per_generation": per_generation,
            "micro_batch": trainer.args.per_device_train_batch_size,
            "bf16": run.placement.dtype == "bfloat16", "max_tokens": max_tokens}


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
