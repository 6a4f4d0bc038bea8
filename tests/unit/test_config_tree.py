"""A config field is declared once: the run's config tree (`RunConfig` and its sections) and the
stage configs built from it (`TrainerConfig`, `ReferenceConfig`, `EngineConfig`,
`ProducerConfig`) never declare the same leaf name twice, except the names in `SAME_NAME`.

A section shared by several configs (`earl.stages.compute.Compute`, `LossConfig`) is one
declaration however many configs reference it, and so is a field a config inherits.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections import defaultdict

import pytest

from earl.config import RunConfig
from earl.stages.producer import ProducerConfig
from earl.stages.reference import ReferenceConfig
from earl.stages.trainer_config import TrainerConfig
from earl.stages.vllm_engine import EngineConfig

ROOTS = (RunConfig, TrainerConfig, ReferenceConfig, EngineConfig, ProducerConfig)

# Leaf names declared by more than one config: the classes that declare each, and why.
# "different": they mean different things. "resolved": the stage's value is computed when the
# stage is spawned, from the run's setting (whose 0 or "recipe" means "look it up") or from a
# fact only the live run has; the stage's is not the setting itself. No entry is a copy made
# by hand (issue 51): a setting a stage shares with the run is a section both are (`Packing`,
# `KvCache`, `ProducerSettings`) or reference (`Compute`, `LossConfig`).
SAME_NAME: dict[str, tuple[str, frozenset[str], str]] = {
    "steps": ("different", frozenset({"WarmStartConfig", "RunConfig"}),
              "warm_start.steps: supervised steps before RL; steps: RL steps"),
    "batch_size": ("different", frozenset({"WarmStartConfig", "RunConfig"}),
                   "transcripts per supervised warm-start step; trajectories per RL step"),
    "lr": ("different", frozenset({"WarmStartConfig", "OptimConfig"}),
           "the supervised warm start's learning rate; RL's"),
    "seed": ("different", frozenset({"ModelConfig", "Seeded"}),
             "the built-in tiny model's initial weights; the run's (each Compute's) seed"),
    "max_model_len": ("resolved", frozenset({"ModelConfig", "EngineConfig"}),
                      "the model's context (0: its positions); a replica's window, resolved"),
    "model": ("resolved", frozenset({"TrainerConfig", "ReferenceConfig", "EngineConfig",
                                     "ProducerConfig"}),
              "the live run's starting policy (each stage's input), which no run field holds"),
    "critic": ("resolved", frozenset({"AlgorithmConfig", "ProducerConfig"}),
               "'recipe' or 'none'; with 'recipe', the recipe's factory as an import reference"),
    "rollout": ("different", frozenset({"PlacementConfig", "ProducerConfig"}),
                "how many rollout replicas; the name of their actor group"),
    "context_window": ("resolved", frozenset({"PlacementConfig", "ProducerConfig"}),
                       "the rollout's window as spawned: the placement's, the model's when 0"),
}


def _sections(tp: object) -> list[type]:
    """The config classes an annotation holds (a dataclass, or one inside `X | None`)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return [tp]
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        return [c for a in typing.get_args(tp) for c in _sections(a)]
    return []


def _owner(cls: type, name: str) -> type:
    """The class of `cls`'s MRO that declares field `name` (a subclass inherits it)."""
    return next(k for k in cls.__mro__ if name in vars(k).get("__annotations__", {}))


def declarations(roots: tuple[type, ...] = ROOTS) -> dict[str, set[str]]:
    """Leaf name -> the config classes that declare it, over `roots` and every section under
    them (nested configs are walked, not counted as leaves)."""
    out: dict[str, set[str]] = defaultdict(set)
    seen: set[type] = set()
    todo = list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            inner = _sections(hints[f.name])
            if inner:
                todo.extend(inner)
            else:
                out[f.name].add(_owner(cls, f.name).__name__)
    return out


def twice(roots: tuple[type, ...] = ROOTS) -> dict[str, list[str]]:
    """Names declared by more than one config class, with the classes."""
    return {n: sorted(cs) for n, cs in sorted(declarations(roots).items()) if len(cs) > 1}


def test_a_leaf_is_declared_once_or_listed_with_why() -> None:
    unlisted = {n: cs for n, cs in twice().items()
                if n not in SAME_NAME or set(cs) - SAME_NAME[n][1]}
    assert not unlisted, ("declared in more than one config (reference one section instead, "
                          f"or list the name and classes in SAME_NAME with why): {unlisted}")


def test_the_table_lists_only_what_is_still_declared_twice() -> None:
    found = twice()
    stale = {n: sorted(cs) for n, (_, cs, _) in SAME_NAME.items()
             if set(found.get(n, ())) != cs}
    assert not stale, f"no longer declared by exactly these: update SAME_NAME for {stale}"
    assert all(kind in ("different", "resolved") and why for kind, _, why in SAME_NAME.values())


def test_what_every_stage_computes_with_is_one_section() -> None:
    """device, dtype, threads, seed and the log-prob temperature: declared once each."""
    decl = declarations()
    assert decl["device"] == decl["dtype"] == decl["threads"] == {"Hardware"}
    assert decl["temperature"] == {"LossConfig"}
    assert "Seeded" in decl["seed"]
    for cfg in (TrainerConfig, ReferenceConfig, EngineConfig):
        names = {f.name for f in dataclasses.fields(cfg)}
        assert "compute" in names and not names & {"device", "dtype", "threads", "seed",
                                                   "temperature"}, cfg.__name__


def test_a_setting_a_stage_shares_with_the_run_is_one_section_taken_whole() -> None:
    """The trainer's packing, a replica's KV budget and what producers play are declared once;
    the stage configs built from a run hold the run's values (CLI names unchanged)."""
    from earl.config import load_config
    from earl.loop.stage_configs import engine_config, trainer_config
    from earl.stages.compute import fields_of
    from earl.stages.producer_settings import ProducerSettings

    decl = declarations()
    assert decl["micro_batch_tokens"] == decl["shared_prefix"] == {"Packing"}
    assert decl["kv_cache_gb"] == {"KvCache"}
    for f in dataclasses.fields(ProducerSettings):
        assert decl[f.name] == {"ProducerSettings"}, f.name
    cfg = load_config(None, ["--placement.micro_batch_tokens=1024", "--placement.shared_prefix",
                             "true", "--placement.kv_cache_gb=0.5", "--tool_timeout_s=7",
                             "--dump_share=0.5", "--max_tokens=12"])
    t = trainer_config(cfg, model="m")
    assert (t.micro_batch_tokens, t.shared_prefix) == (1024, True)
    assert engine_config(cfg, model="m", max_model_len=256).kv_cache_gb == 0.5
    got = ProducerConfig(**fields_of(ProducerSettings, cfg), model="m")
    assert (got.tool_timeout_s, got.dump_share, got.max_tokens) == (7.0, 0.5, 12)
    with pytest.raises(ValueError, match="tool_timeout_s"):  # a section checks its own values
        load_config(None, ["--tool_timeout_s=0"])


def test_the_walk_finds_a_copied_field() -> None:
    """The check can fail: a stage config that copies a run field is caught."""

    @dataclasses.dataclass
    class Copying:
        device: str = "cpu"
        temperature: float = 1.0

    found = twice((RunConfig, Copying))
    assert found["device"] == ["Copying", "Hardware"]
    assert found["temperature"] == ["Copying", "LossConfig"]


def test_a_moved_key_is_refused_naming_its_new_place() -> None:
    from earl.config import load_config

    with pytest.raises(ValueError, match=r"placement\.threads_per_actor \(now placement\.threads\)"):
        load_config(None, ["--placement.threads_per_actor=2"])
