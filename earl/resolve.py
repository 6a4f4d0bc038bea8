"""What a run trains: the recipe (a shipped one, or a user's agent and tasks), the agent
reference producer processes import, and the starting model folder.

Everything here runs in the driver before any actor starts, so a missing file, a missing
function or a malformed JSONL line is reported before anything is spawned. It does not start
actors (`earl.run`) or define recipes (`earl.recipe`, `earl.recipes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from earl.config import ModelConfig, RunConfig
from earl.recipe import Recipe

__all__ = ["absolute_ref", "model_folder", "resolve_recipe"]


def resolve_recipe(cfg: RunConfig, *, agent: Callable[..., Any] | None = None,
                   tasks: Iterable[object] | None = None) -> tuple[Recipe, str]:
    """The recipe to train and the agent reference producers import.

    `--agent PATH.py:NAME --tasks FILE.jsonl`: the user's agent on the file's samples (eval on
    `--eval-tasks`, metric: mean reward and accuracy). Python callers may pass the agent
    function and any iterable of samples instead. Otherwise the shipped recipe `cfg.recipe`.
    Errors (missing file, no such function, a malformed JSONL line, `algorithm.critic=recipe`
    for a recipe without a critic) are raised here, before any actor starts.
    """
    from earl.recipe import (
        EvalSet,
        IterTasks,
        ListTasks,
        agent_ref,
        critic_ref,
        load_agent,
        load_jsonl,
        load_recipe,
    )

    if agent is not None or cfg.agent:
        fn = agent if agent is not None else load_agent(cfg.agent)
        ref = agent_ref(fn) if agent is not None else absolute_ref(cfg.agent)
        if tasks is not None:
            source: Any = IterTasks(tasks)
        elif cfg.tasks:
            source = ListTasks(load_jsonl(cfg.tasks), seed=cfg.seed)
        else:
            raise ValueError("an agent needs tasks: pass --tasks FILE.jsonl (or tasks=...)")
        recipe = Recipe(name=getattr(fn, "__name__", "agent"), agent=fn, tasks=source,
                        max_tokens=cfg.max_tokens or 64)
    else:
        recipe = load_recipe(cfg.recipe)
        ref = agent_ref(recipe.agent)
    if cfg.reward:
        from earl.recipe import load_reward

        load_reward(cfg.reward)  # a bad reference fails here, before any actor starts
    if cfg.eval_tasks:
        items = load_jsonl(cfg.eval_tasks, what="--eval-tasks")
        if cfg.eval_games > len(items):
            raise ValueError(f"config field 'eval_games': {cfg.eval_games} but --eval-tasks "
                             f"{cfg.eval_tasks} has {len(items)} samples; pass --eval_games <= "
                             f"{len(items)}, or 0 to evaluate all of them")
        recipe = dataclasses.replace(recipe, eval=EvalSet(items=items[:cfg.eval_games or None]))
    if cfg.max_tokens:
        recipe = dataclasses.replace(recipe, max_tokens=cfg.max_tokens)
    if cfg.algorithm.critic == "recipe":
        if recipe.critic is None:
            raise ValueError(f"algorithm.critic=recipe: the recipe {recipe.name!r} has no critic "
                             "(Recipe.critic); set algorithm.critic=none")
        critic_ref(recipe.critic)  # not importable by a producer: fails here, before any actor
    return recipe, ref


def absolute_ref(ref: str) -> str:
    """`PATH.py:NAME` with an absolute path (producers run in another working folder)."""
    path, _, name = ref.rpartition(":")
    return f"{Path(path).resolve()}:{name}" if path.endswith(".py") else ref


def model_folder(cfg: RunConfig, out: Path) -> str:
    """The starting model: `model.path`, or a seeded tiny char-level model built once."""
    if cfg.model.path:
        from earl.models.smollm2 import resolve_model

        return str(resolve_model(cfg.model.path))
    from earl.models.tiny import build_tiny_model

    m = cfg.model
    path = out / f"tiny_h{m.hidden}_l{m.layers}_s{m.seed}_hd32"
    if not (path / "config.json").is_file():
        # A larger init scale than HF's 0.02 shortens the warm start's copy-the-digit plateau.
        heads = max(m.hidden // 32, 1)  # vLLM's CPU attention needs head_dim >= 32
        build_tiny_model(path, seed=m.seed, hidden=m.hidden, layers=m.layers, heads=heads,
                         kv_heads=heads, intermediate=3 * m.hidden,
                         max_positions=m.max_model_len or m.DEFAULT_CONTEXT, init_std=0.1)
    return str(path)


def context_length(model: ModelConfig, model_dir: str | Path) -> int:
    """The rollout's context window: `model.max_model_len`, or the model's own positions
    (`max_position_embeddings` in its config.json) capped at `ModelConfig.DEFAULT_CONTEXT`."""
    if model.max_model_len:
        return model.max_model_len
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return min(int(cfg.get("max_position_embeddings", model.DEFAULT_CONTEXT)),
               model.DEFAULT_CONTEXT)
