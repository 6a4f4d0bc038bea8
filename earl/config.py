"""Typed run configuration: a tree of `@dataclass(kw_only=True, slots=True)` configs.

A run is described by one `RunConfig`. It is filled from defaults, then an optional YAML file,
then `--key.sub=value` overrides, and validated once on load; every error names the dotted field
and says how to fix it. *What* runs (model, env, algorithm) is kept apart from *where* it runs
(`placement`). This module does not start anything and imports nothing heavy.

Example:
    cfg = load_config("run.yaml", ["--algorithm.lr=3e-4", "--max_policy_lag=0"])
"""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy model. `path` empty means the built-in tiny char-level model."""

    path: str = ""
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    max_model_len: int = 512


@dataclass(kw_only=True, slots=True)
class EnvConfig:
    """The environment the agent plays in."""

    name: str = "tictactoe"
    opponent: str = "random"


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Supervised warm start on random legal games (a random legal player, not an expert)."""

    steps: int = 120
    batch_size: int = 32
    lr: float = 3e-3


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Policy-gradient recipe: per-move credit, PPO-clip, entropy and KL control."""

    name: str = "grpo"
    lr: float = 1e-3
    # Annealing: once the run's progress (the larger of elapsed / time limit and step / steps)
    # passes lr_anneal_from, the LR falls linearly to lr_final * lr at the end (1.0: constant).
    lr_anneal_from: float = 0.5
    lr_final: float = 0.1
    epochs: int = 1
    clip: float = 0.2
    entropy_coef: float = 0.0
    kl_coef: float = 0.15
    gamma: float = 1.0
    reward_win: float = 1.0
    reward_draw: float = 1.0
    reward_loss: float = -1.0
    normalize_std: bool = False
    critic: str = "tabular"
    critic_lambda: float = 0.5
    critic_alpha: float = 0.2
    critic_q_weight: float = 2.0
    self_imitation: int = 16
    max_grad_norm: float = 1.0
    temperature: float = 1.0


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    """Where actors run and how many of each; the recipe never depends on it."""

    rollout: int = 1
    reference: int = 1
    trainer: int = 1
    device: str = "cpu"
    threads_per_actor: int = 1


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """One training run. `batch_size` counts trajectories per step (whole groups).

    `select_best`: the final policy is the one with the best periodic (validation) eval; the
    reported final eval uses fresh game seeds. `time_limit_minutes` bounds the training loop;
    start-up, the final eval and the plots add ~0.3-0.5 min, so the default run ends within 10 min.
    """

    seed: int = 0
    steps: int = 2000
    batch_size: int = 64
    group_size: int = 8
    max_policy_lag: int = 1
    time_limit_minutes: float = 9.0
    target_win_draw: float = 0.97
    eval_games: int = 200
    eval_every: int = 20
    select_best: bool = True
    checkpoint_every: int = 25
    dump_trajectories: bool = True
    output_dir: str = "runs/latest"
    model: ModelConfig = field(default_factory=ModelConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)


ENVS = ("tictactoe",)
OPPONENTS = ("random",)
ALGORITHMS = ("grpo", "ppo")
DEVICES = ("cpu", "cuda")
CRITICS = ("tabular", "none")


def _fields(cls: type) -> dict[str, typing.Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: object, tp: object, where: str) -> object:
    """Checks (and for CLI strings, parses) `value` against the annotated type `tp`."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"config field {where!r} must be a mapping of {tp.__name__} fields, "
                            f"got {type(value).__name__}")
        return from_dict(tp, value, prefix=where + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"config field {where!r} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError(f"config field {where!r} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise TypeError(f"config field {where!r} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise TypeError(f"config field {where!r} must be a string, got {value!r}")
    if isinstance(tp, types.UnionType):  # pragma: no cover - no unions in the tree today
        return value
    raise TypeError(f"config field {where!r} has unsupported type {tp!r}")


def from_dict(cls: type, data: dict[str, object], *, prefix: str = "") -> typing.Any:
    """Builds config `cls` from a nested dict; unknown keys raise ValueError naming them."""
    known = _fields(cls)
    unknown = sorted(set(data) - set(known))
    if unknown:
        names = ", ".join(prefix + k for k in unknown)
        raise ValueError(f"unknown config key(s) {names}; valid keys under "
                         f"{prefix.rstrip('.') or 'the top level'}: {', '.join(known)}")
    kwargs = {k: _coerce(v, known[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def to_dict(cfg: object) -> dict[str, typing.Any]:
    """The config tree as plain nested dicts (for YAML/JSON dumps and checkpoints)."""
    return dataclasses.asdict(cfg)  # type: ignore[call-overload]


def parse_overrides(args: list[str]) -> dict[str, object]:
    """`["--a.b=1", "--c", "x"]` -> `{"a": {"b": 1}, "c": "x"}`; values are parsed as YAML."""
    out: dict[str, object] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ValueError(f"override {arg!r} must look like --key.sub=value")
        key, eq, raw = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(args):
                raise ValueError(f"override --{key} needs a value: --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        i += 1
        value = yaml.safe_load(raw) if raw.strip() else ""
        node = out
        parts = key.replace("-", "_").split(".")
        for part in parts[:-1]:
            nxt = node.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise ValueError(  # noqa: TRY004 - a bad override string, not a type
                    f"override --{key} conflicts with an earlier --{part}=...")
            node = nxt
        node[parts[-1]] = value
    return out


def _merge(base: dict[str, object], extra: dict[str, object]) -> dict[str, object]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)  # type: ignore[arg-type]
        else:
            out[k] = v
    return out


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: list[str] | None = None) -> RunConfig:
    """Defaults <- YAML file <- CLI overrides, then `validate`.

    Raises:
        ValueError: unknown keys, bad values, impossible placements (message names the field).
        TypeError: a value of the wrong type.
    """
    data: dict[str, object] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--config {str(p)!r} does not exist; pass a YAML file path")
        loaded = yaml.safe_load(p.read_text()) or {}
        if not isinstance(loaded, dict):
            raise TypeError(f"config file {str(p)!r} must hold a mapping at the top level")
        data = loaded
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    cfg = from_dict(RunConfig, data)
    validate(cfg)
    return cfg


def lr_scale(a: AlgorithmConfig, progress: float) -> float:
    """The LR multiplier at `progress` in [0, 1] of the run (see `lr_anneal_from`)."""
    if progress <= a.lr_anneal_from or a.lr_anneal_from >= 1:
        return 1.0
    frac = min((progress - a.lr_anneal_from) / (1 - a.lr_anneal_from), 1.0)
    return 1.0 - frac * (1.0 - a.lr_final)


def validate(cfg: RunConfig) -> None:
    """Raises ValueError naming the field and the fix for any impossible setting."""
    def need(ok: bool, name: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"config field {name!r}: {msg}")

    need(cfg.steps >= 1, "steps", "must be >= 1")
    need(cfg.group_size >= 2, "group_size", "must be >= 2 (advantages compare within a group)")
    need(cfg.batch_size >= cfg.group_size, "batch_size",
         f"must be >= group_size ({cfg.group_size})")
    need(cfg.batch_size % cfg.group_size == 0, "batch_size",
         f"{cfg.batch_size} is not divisible by group_size {cfg.group_size}; "
         f"use a multiple such as {cfg.batch_size // cfg.group_size * cfg.group_size or cfg.group_size}")
    need(cfg.max_policy_lag >= 0, "max_policy_lag", "must be >= 0 (0 = synchronous)")
    need(cfg.eval_games >= 2 and cfg.eval_games % 2 == 0, "eval_games",
         "must be an even number >= 2 (games alternate first and second move)")
    need(cfg.time_limit_minutes > 0, "time_limit_minutes", "must be > 0")
    need(0.0 <= cfg.target_win_draw <= 1.0, "target_win_draw", "must be in [0, 1] (0 = off)")
    need(cfg.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
    need(cfg.env.name in ENVS, "env.name", f"{cfg.env.name!r} unknown; choose one of {ENVS}")
    need(cfg.env.opponent in OPPONENTS, "env.opponent",
         f"{cfg.env.opponent!r} unknown; choose one of {OPPONENTS}")
    a = cfg.algorithm
    need(a.name in ALGORITHMS, "algorithm.name", f"{a.name!r} unknown; choose one of {ALGORITHMS}")
    need(a.lr > 0, "algorithm.lr", "must be > 0")
    need(0 <= a.lr_anneal_from <= 1, "algorithm.lr_anneal_from",
         "must be in [0, 1] (the run's progress where annealing starts; 1 = never)")
    need(0 < a.lr_final <= 1, "algorithm.lr_final", "must be in (0, 1] (a fraction of lr)")
    need(a.epochs >= 1, "algorithm.epochs", "must be >= 1")
    need(a.critic in CRITICS, "algorithm.critic", f"{a.critic!r} unknown; choose one of {CRITICS}")
    need(0 <= a.critic_lambda <= 1, "algorithm.critic_lambda", "must be in [0, 1]")
    need(0 < a.critic_alpha <= 1, "algorithm.critic_alpha", "must be in (0, 1]")
    need(a.critic_q_weight >= 0, "algorithm.critic_q_weight", "must be >= 0 (0 = no Q table)")
    need(a.self_imitation >= 0, "algorithm.self_imitation", "must be >= 0 (0 = off)")
    need(a.self_imitation == 0 or (a.critic == "tabular" and a.critic_q_weight > 0),
         "algorithm.self_imitation", "needs algorithm.critic=tabular with critic_q_weight > 0 "
         "(or set it to 0)")
    need(a.clip > 0, "algorithm.clip", "must be > 0")
    need(0 < a.gamma <= 1, "algorithm.gamma", "must be in (0, 1]")
    need(a.temperature > 0, "algorithm.temperature", "must be > 0 for exploration")
    need(a.kl_coef >= 0 and a.entropy_coef >= 0, "algorithm.kl_coef",
         "kl_coef and entropy_coef must be >= 0")
    w = cfg.warm_start
    need(w.steps >= 0, "warm_start.steps", "must be >= 0 (0 = no warm start)")
    need(w.batch_size >= 1, "warm_start.batch_size", "must be >= 1")
    m = cfg.model
    if m.path:
        mp = Path(m.path)
        need(mp.is_dir(), "model.path", f"folder {m.path!r} does not exist; pass an HF model "
             "folder or leave it empty for the built-in tiny model")
        need((mp / "config.json").is_file(), "model.path",
             f"{m.path!r} has no config.json; it must be a Hugging Face model folder")
    need(m.hidden >= 32 and m.hidden % 32 == 0 and m.layers >= 1, "model.hidden",
         "tiny model needs hidden a multiple of 32 (vLLM CPU head size) and layers >= 1")
    need(m.max_model_len >= 64, "model.max_model_len", "must be >= 64 tokens")
    pl = cfg.placement
    need(pl.device in DEVICES, "placement.device", f"{pl.device!r} unknown; choose one of {DEVICES}")
    need(pl.rollout >= 1, "placement.rollout", "needs at least 1 rollout actor")
    need(pl.trainer >= 1, "placement.trainer", "needs at least 1 trainer rank")
    need(pl.reference >= 0, "placement.reference", "must be >= 0")
    need(pl.reference >= 1 or a.kl_coef == 0, "placement.reference",
         "algorithm.kl_coef > 0 needs a reference actor; set placement.reference=1 or kl_coef=0")
    need(pl.threads_per_actor >= 1, "placement.threads_per_actor", "must be >= 1")
    groups = cfg.batch_size // cfg.group_size
    need(groups % pl.trainer == 0, "placement.trainer",
         f"{pl.trainer} trainer ranks cannot split {groups} groups per step evenly; "
         "use a trainer count that divides batch_size/group_size")
    need(pl.rollout <= cfg.batch_size, "placement.rollout",
         f"{pl.rollout} rollout actors for {cfg.batch_size} trajectories per step leaves some idle")
    if pl.device == "cuda":
        import torch

        need(torch.cuda.is_available(), "placement.device",
             "'cuda' requested but no CUDA device is visible; use placement.device=cpu")
        n = torch.cuda.device_count()
        need(pl.rollout + pl.trainer + pl.reference <= max(n, 1) * 4, "placement",
             f"{pl.rollout + pl.trainer + pl.reference} actors do not fit on {n} GPU(s)")
