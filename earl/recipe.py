"""Recipes: what is specific to one task, on top of the general RL loop.

A `Recipe` names an agent coroutine `async def agent(rollout, sample) -> float`, where its
training samples come from (`TaskSource`), how it is evaluated (held-out samples and a metric),
and optional extras (a supervised warm start, a `Critic`, default config values). The loop
(`earl.loop`) knows nothing about any task; the shipped recipes are the packages under
`earl/recipes/` (`earl train --recipe NAME` finds them by scanning that folder, so adding one
touches no list), written against the public API only, the same path a user's agent takes with
`earl train --agent PATH.py:NAME --tasks FILE.jsonl`.

Samples travel to producer actors over the wire, so they must be plain data (None, bool,
numbers, str, lists and dicts of those). The agent (and a critic factory) must be importable by
the producer process: a module-level function (`module:name` or `path/to/file.py:name`), not a
closure.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import json
import pkgutil
import random
import sys
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

if TYPE_CHECKING:
    from earl.agents.chat import ChatCodec
    from earl.runtime.types import Trajectory
    from earl.stages.batch_types import Episode

__all__ = [
    "Critic", "EvalSet", "IterTasks", "ListTasks", "Recipe", "SeedTasks", "TaskSource",
    "agent_ref", "critic_ref", "load_agent", "load_critic", "load_function", "load_jsonl",
    "load_recipe", "load_reward", "mean_reward", "native_dtype", "recipe_names",
    "turn_targets",
]

Sample = object
Metric = Callable[[list["Episode"]], dict[str, float]]
# Warm start data: (token ids, soft-target rows (position, token, weight)) per transcript.
WarmStartData = tuple[list[Any], list[Any]]
WarmStart = Callable[["ChatCodec", int, int], Awaitable[WarmStartData]]
# A reply the critic rates above the one a turn took: (trajectory index, turn index, reply
# tokens, its advantage).
BetterReply = tuple[int, int, tuple[int, ...], float]


class TaskSource(Protocol):
    """Training samples by cursor: `sample(k)` is deterministic, so a resumed run continues
    exactly where it stopped (the cursor is part of the checkpoint)."""

    def sample(self, k: int) -> Sample: ...


class Critic(Protocol):
    """Per-turn credit that learns from the batches it scores: a recipe's own value estimate
    (e.g. the Tic-Tac-Toe recipe's table over board observations). Each producer builds one
    with the recipe's factory and keeps it for the run; it is used with `algorithm.name=ppo`
    and `algorithm.critic=recipe`.

    `turn_rewards[i]` holds trajectory i's per-turn rewards (the agent's, or its final reward
    on the last turn). `advantages` gives one advantage per turn and is called before `update`
    on the same batch. `better_actions` names replies the critic rates above the one taken,
    best first (`algorithm.self_imitation` trains on up to that many; [] if it cannot say).
    `state_dict` is plain data (str keys, numbers, lists): it goes into the run's checkpoint
    and `load_state_dict` restores it on resume.
    """

    def advantages(self, trajs: Sequence[Trajectory],
                   turn_rewards: Sequence[Sequence[float]]) -> list[list[float]]: ...

    def update(self, trajs: Sequence[Trajectory],
               turn_rewards: Sequence[Sequence[float]]) -> None: ...

    def better_actions(self, trajs: Sequence[Trajectory]) -> list[BetterReply]: ...

    def state_dict(self) -> dict[str, object]: ...

    def load_state_dict(self, d: dict[str, object]) -> None: ...


@dataclass(frozen=True, slots=True)
class SeedTasks:
    """An environment's seed generator: sample k is the integer `offset + k`."""

    offset: int = 0

    def sample(self, k: int) -> Sample:
        return self.offset + k


@dataclass(frozen=True, slots=True)
class ListTasks:
    """A finite list of samples, reshuffled every epoch with `seed` (a JSONL file's lines)."""

    items: Sequence[Sample]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("ListTasks needs at least one sample; the task list is empty")

    def sample(self, k: int) -> Sample:
        n = len(self.items)
        epoch, i = divmod(k, n)
        return self.items[_epoch_order(self.seed * 1_000_003 + epoch, n)[i]]


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, n: int) -> tuple[int, ...]:
    """range(n) shuffled with `seed`: kept, since shuffling per sample costs O(n) each (0.5 s
    for 1,000 sessions of `earl stress` on a 2,000-line task file)."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return tuple(order)


class IterTasks:
    """A Python iterable or generator of samples, consumed lazily and remembered, so the
    cursor-addressed `sample(k)` works and a resume fast-forwards to its cursor."""

    def __init__(self, items: Iterable[Sample]) -> None:
        self._it: Iterator[Sample] = iter(items)
        self._seen: list[Sample] = []

    def sample(self, k: int) -> Sample:
        while len(self._seen) <= k:
            try:
                self._seen.append(next(self._it))
            except StopIteration:
                if not self._seen:
                    raise ValueError("the tasks iterable yielded no sample") from None
                return self._seen[k % len(self._seen)]
        return self._seen[k]


@dataclass(frozen=True, slots=True)
class EvalSet:
    """Held-out samples. `samples(split, step, n)` gives the samples of one evaluation: split
    is "start" (before RL), "validation" (every `eval_every` steps) or "final"; `make`
    generates `n` of them (e.g. fresh game seeds), `items` is a fixed set used whole."""

    items: Sequence[Sample] = ()
    make: Callable[[str, int, int], Sequence[Sample]] | None = None

    def samples(self, split: str, step: int, n: int) -> list[Sample]:
        if self.make is not None:
            return list(self.make(split, step, n))
        return list(self.items)

    def __bool__(self) -> bool:
        return self.make is not None or bool(self.items)


def mean_reward(episodes: list[Episode]) -> dict[str, float]:
    """The default eval metric: mean reward (failed episodes score 0), the failure rate and
    `accuracy` = share of episodes with reward >= 1."""
    n = max(len(episodes), 1)
    rewards = [0.0 if e.failed or e.reward is None else e.reward for e in episodes]
    return {"episodes": float(len(episodes)), "reward": sum(rewards) / n,
            "accuracy": sum(r >= 1.0 for r in rewards) / n,
            "failed_rate": sum(e.failed for e in episodes) / n}


@dataclass(kw_only=True, slots=True)
class Recipe:
    """One trainable task.

    Attributes:
        name: shown in logs and the result.
        agent: `async def agent(rollout, sample) -> float`, defined at module level.
        tasks: training samples by cursor.
        eval: held-out samples (empty: evaluate on fresh training samples).
        metric: episodes -> named scores; `target_key` is the one stop rules and model
            selection read.
        target_key: the metric the `target` stop rule compares against.
        max_tokens: per-turn generation cap.
        max_total_tokens: per-trajectory cap (prompt included), None = the model's context.
        shared_group_task: a GRPO group's members share one sample (True) or each gets its
            own (False: e.g. one seed per game with a critic).
        failed_reward: the reward of an episode whose agent raised or timed out.
        warm_start: optional supervised warm start data `(codec, n, seed) -> (ids, targets)`.
        critic: optional `() -> Critic`, defined at module level (each producer imports it
            and builds its own); used when the config says `algorithm.critic: recipe`.
        config: default values of `RunConfig` fields for this recipe (YAML-shaped nesting),
            applied before the user's config file and overrides.
    """

    name: str
    agent: Callable[..., Awaitable[float | None]]
    tasks: TaskSource
    eval: EvalSet = field(default_factory=EvalSet)
    metric: Metric = mean_reward
    target_key: str = "reward"
    max_tokens: int = 64
    max_total_tokens: int | None = None
    shared_group_task: bool = True
    failed_reward: float = 0.0
    warm_start: WarmStart | None = None
    critic: Callable[[], Critic] | None = None
    config: dict[str, object] = field(default_factory=dict)


def agent_ref(fn: Callable[..., object]) -> str:
    """The "module:name" (or "file.py:name") a producer process imports `fn` by.

    Raises:
        TypeError: `fn` is not a coroutine function defined at module level.
    """
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"agent {getattr(fn, '__qualname__', fn)!r} must be an `async def` "
                        "coroutine function: async def agent(rollout, sample) -> float")
    return _module_ref(fn, "agent", "`async def`")


def critic_ref(fn: Callable[[], Critic]) -> str:
    """The "module:name" a producer process imports a recipe's critic factory by.

    Raises:
        TypeError: `fn` is not a function defined at module level.
    """
    return _module_ref(fn, "critic", "`def`")


def _module_ref(fn: Callable[..., object], what: str, define: str) -> str:
    qual = getattr(fn, "__qualname__", repr(fn))
    if "<locals>" in qual or "." in qual:
        raise TypeError(f"{what} {qual!r} is not defined at module level; producer processes "
                        f"import it by name, so define it with {define} at the top of a module")
    module = fn.__module__
    if module == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        if not path:
            raise TypeError(f"{what} {qual!r} lives in an interactive __main__; put it in a file")
        return f"{Path(path).resolve()}:{qual}"
    return f"{module}:{qual}"


def load_agent(ref: str) -> Callable[..., Awaitable[float | None]]:
    """Import the agent `ref` ("path/to/file.py:NAME" or "package.module:NAME").

    Raises:
        ValueError: the file or module does not exist, or does not define NAME, or NAME is
            not an `async def` function; the message names the file and the fix.
    """
    fn = load_function(ref, what="--agent")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"--agent: {ref} is a {type(fn).__name__}, not an `async def` "
                         "function; write `async def agent(rollout, sample) -> float`")
    return fn  # type: ignore[return-value]


def load_reward(ref: str) -> Callable[[object, str], float]:
    """Import a reward rule `def reward(sample, response: str) -> float` by reference: it
    scores the agent's final assistant text and replaces the reward the agent returned."""
    fn = load_function(ref, what="--reward")
    if inspect.iscoroutinefunction(fn) or len(inspect.signature(fn).parameters) != 2:
        raise ValueError(f"--reward: {ref} must be a plain function of two arguments: "
                         "def reward(sample, response: str) -> float")
    return fn  # type: ignore[return-value]


def load_critic(ref: str) -> Critic:
    """Import a critic factory by reference (`critic_ref` of a `Recipe.critic`) and call it:
    each producer builds its own critic this way."""
    return cast("Critic", load_function(ref, what="critic")())


def load_function(ref: str, *, what: str) -> Callable[..., object]:
    """Import NAME from "path/to/file.py:NAME" or "package.module:NAME".

    Raises:
        ValueError: the file or module does not exist or does not define a callable NAME.
    """
    path, sep, name = ref.rpartition(":")
    if not sep or not path or not name:
        raise ValueError(f"{what} {ref!r} must look like PATH.py:NAME or module:NAME")
    if path.endswith(".py"):
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise ValueError(f"{what}: file {path!r} does not exist; pass PATH.py:NAME")
        mod_name = f"earl_user_{abs(hash(str(file)))}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec = importlib.util.spec_from_file_location(mod_name, file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = module
            try:
                spec.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[mod_name]
                raise ValueError(f"{what}: importing {path!r} failed: "
                                 f"{type(exc).__name__}: {exc}") from exc
        where = path
    else:
        try:
            module = importlib.import_module(path)
        except ImportError as exc:
            raise ValueError(f"{what}: cannot import module {path!r} ({exc}); pass "
                             "PATH.py:NAME for a file") from exc
        where = f"module {path!r}"
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        defined = sorted(k for k, v in vars(module).items()
                         if inspect.isfunction(v) and not k.startswith("_"))
        raise ValueError(f"{what}: {where} does not define {name!r}; its functions: "
                         f"{defined or 'none'}")
    return fn  # type: ignore[no-any-return]


def load_jsonl(path: str | Path, *, what: str = "--tasks") -> list[Sample]:
    """Read one sample per line of a JSONL file (blank lines skipped).

    Raises:
        ValueError: the file is missing or empty, or a line is not valid JSON (names the line).
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what}: file {str(p)!r} does not exist; pass a JSONL file with one "
                         "JSON sample per line")
    out: list[Sample] = []
    with p.open(encoding="utf-8", errors="strict") as f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    out.append(json.loads(line, parse_constant=_no_constant))
                except (json.JSONDecodeError, ValueError) as exc:
                    raise ValueError(f"{what}: {p}:{lineno} is not valid JSON ({exc}); write "
                                     "one JSON value per line, e.g. "
                                     '{"question": "2+2?", "answer": 4}') from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{what}: {p} is not UTF-8 text ({exc.reason}); pass a JSONL file"
                             ) from None
    if not out:
        raise ValueError(f"{what}: {p} holds no samples; write one JSON sample per line")
    return out


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def recipe_names() -> tuple[str, ...]:
    """The shipped recipes: every package under `earl/recipes/` (found, not imported)."""
    recipes = importlib.import_module("earl.recipes")
    return tuple(sorted(m.name for m in pkgutil.iter_modules(recipes.__path__)
                        if m.ispkg and not m.name.startswith("_")))


def load_recipe(name: str) -> Recipe:
    """A shipped recipe by name (`earl train --recipe NAME`): `earl.recipes.<name>.recipe`.

    Raises:
        ValueError: no package `earl/recipes/<name>/` (the message lists the shipped ones).
    """
    names = recipe_names()
    if name not in names:
        raise ValueError(f"--recipe {name!r} unknown; choose one of {', '.join(names)} (or "
                         "pass --agent PATH.py:NAME --tasks FILE.jsonl)")
    module = importlib.import_module(f"earl.recipes.{name}")
    recipe = module.recipe
    assert isinstance(recipe, Recipe)
    return recipe


def turn_targets(trajectories: Iterable[Trajectory]) -> WarmStartData:
    """Warm-start data that imitates `trajectories`: each one's token ids, and a target row
    (position, token, weight 1) for every token of its assistant turns. Failed trajectories
    and those without a turn are left out."""
    import numpy as np

    ids_out: list[Any] = []
    tgt_out: list[Any] = []
    for t in trajectories:
        if t.failed or not t.turn_spans:
            continue
        rows = [(pos, t.token_ids[pos], 1.0) for start, end in t.turn_spans
                for pos in range(start, end)]
        ids_out.append(np.asarray(t.token_ids, dtype=np.int64))
        tgt_out.append(np.asarray(rows, dtype=np.float64))
    return ids_out, tgt_out


def native_dtype() -> str:
    """"bfloat16" where this CPU computes it natively (AVX512-BF16 or AMX), else "float32":
    a recipe's `placement.dtype` for a real model on CPU."""
    import re

    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = set(re.findall(r"\w+", f.read()))
    except OSError:
        return "float32"
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & flags else "float32"
