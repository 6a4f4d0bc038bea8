"""The selector's `Reconfigurer` over a run's real actor groups, and how a run builds it.

`ActorReconfigurer` applies a `Setting` (`earl.loop.selection`) to the run's live actors
(`earl.loop.actors.Actors`): the trainer's micro-batch token budget (the dispatcher plans the
next step with it); a new trainer layout or slots with `reconfigure_trainer` (resharded
checkpoint: parameters and Adam state kept); a new rollout layout, slots or context with
`reconfigure_rollout` (new vLLM replicas with the new ``max_model_len`` and KV budget, the
trainer's weights pushed at the current version), after which the producers sample from the
new group; the reference's devices (planned when it has devices of its own) with
`reconfigure_reference` (its ``ref_logprobs`` in the dock retracted and scored again). The
actor that gives up slots is re-created first, so a slot is free before its new owner starts.

`selection_for_run` makes the cost model of the run's model, its live profile (`RunProfile`,
fed by the `Selection` with each step's measured tokens/s and memory), the policy (the run's
`selector.policy_factory`, else `SearchPolicy` with the knobs of `selector.policy`) and the
`Selection`.
Not here: the decision (`earl.runtime.selector`), when to apply (`earl.loop.selection`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.loop.actors import Actors
from earl.loop.devices import placed
from earl.loop.selection import ReferenceProgress, Selection, Setting
from earl.runtime.layout import Layout
from earl.runtime.selector import (
    CostConfig,
    CostModel,
    Decision,
    ModelShape,
    Parallel,
    Policy,
    PolicyConfig,
    RunProfile,
    SearchPolicy,
)
from earl.runtime.slots import SlotPool

if TYPE_CHECKING:
    from earl.loop.job import Job
    from earl.loop.supervisor import Supervisor
    from earl.observe import Tracer

__all__ = ["ActorReconfigurer", "SlotMemory", "cost_model_of", "device_peak", "make_policy",
           "selection_for_run", "slot_usage"]


class ActorReconfigurer:
    """Re-creates the trainer / rollout / reference groups of a run (see module docstring).

    Args:
        rt: the run's `Runtime`.
        actors: the run's live groups; re-created groups replace the old ones there.
        pool: the slot pool (None: actors run without slots).
        slot_memory: what each slot offers the cost model (with a pool).
        env: environment of re-created actors.
        checkpoint_dir: where resharding checkpoints go.
        kv_bytes_per_token: the rollout's KV bytes per token (sizes its KV budget).
        tracer: the run's `Tracer` (each re-creation is a span on the "selector" track).
        supervisor: the run's `Supervisor`: its restart policies for the re-created groups,
            and it follows each re-created group (`Supervisor.follow`: a rank a move added is
            rebuilt after a restart like the ones the run started with).
    """

    def __init__(self, rt: Any, actors: Actors, *, pool: SlotPool | None,
                 slot_memory: SlotMemory | None = None, env: dict[str, str],
                 checkpoint_dir: Path, kv_bytes_per_token: float, tracer: Tracer,
                 supervisor: Supervisor) -> None:
        self.rt, self.actors, self.pool, self.env, self.tracer = rt, actors, pool, env, tracer
        self.slot_memory, self.supervisor = slot_memory, supervisor
        self.checkpoint_dir, self.kv_bytes = checkpoint_dir, kv_bytes_per_token
        self._n = 0

    async def set_micro_batch_tokens(self, tokens: int) -> None:
        self.actors.set_micro_batch_tokens(tokens)

    async def set_recompute(self, on: bool) -> None:
        await self.actors.trainer.set_recompute.call(on)

    def measure_rollout(self, s: Setting, replicas: int, kv_cache_gb: float) -> None:
        """Read the baseline memory of the rollout replicas just spawned with setting `s`."""
        if self.slot_memory is not None:
            self.slot_memory.measure(s.rollout_slots[:replicas], kv_cache_gb * 1024)

    def kv_cache_gb(self, s: Setting) -> float:
        """KV budget per replica: `kv_tokens` of KV, plus 16 MiB for vLLM's block rounding."""
        return (s.kv_tokens * self.kv_bytes + (16 << 20)) / 2**30

    async def apply(self, old: Setting, new: Setting) -> dict[str, float]:
        from earl.stages.reconfigure import (
            reconfigure_reference,
            reconfigure_rollout,
            reconfigure_trainer,
        )

        times: dict[str, float] = {}
        with self.tracer.span("reconfigure", actor="selector"):
            for actor in _order(new.changed(old), old, new):
                self._n += 1
                if actor == "reference":
                    ranks = len(new.reference_slots)
                    group, t = await reconfigure_reference(
                        self.rt, self.actors.reference, self.actors.dock, ranks=ranks,
                        env=self.env,
                        slot=placed(self.pool, new.reference_slots, ranks, "reference"),
                        restart=self.supervisor.policy("reference"))
                    self.actors.use_reference(group)
                    self.supervisor.follow("reference", ranks)
                elif actor == "trainer":
                    # a slot can hold one rank: ranks beyond the slots run unplaced
                    ranks = new.trainer_tp * new.trainer_dp
                    group, t = await reconfigure_trainer(
                        self.rt, self.actors.trainer,
                        Layout(dp=new.trainer_dp, tp=new.trainer_tp),
                        checkpoint_dir=self.checkpoint_dir / f"reshard-{self._n}", env=self.env,
                        slot=placed(self.pool, new.trainer_slots, ranks, "trainer"),
                        micro_batch_tokens=new.micro_batch_tokens,
                        recompute=new.trainer_recompute)
                    self.actors.use_trainer(group, new.micro_batch_tokens)
                else:
                    # replicas that stay in their slots with their TP keep their processes:
                    # only the difference starts or stops (and their engines rebuild if the
                    # window or KV budget changed)
                    tp, kept = new.rollout_tp, min(new.rollout_replicas, old.rollout_replicas)
                    in_place = (tp == old.rollout_tp and new.rollout_slots[:kept * tp]
                                == old.rollout_slots[:kept * tp])
                    start = kept * tp if in_place else 0
                    version = await self.actors.trainer[0].version.call_one()
                    group, t = await reconfigure_rollout(
                        self.rt, self.actors.rollout, tensor_parallel_size=tp,
                        replicas=new.rollout_replicas, trainer=self.actors.trainer,
                        version=version, env=self.env,
                        slot=placed(self.pool, new.rollout_slots[start:],
                                    new.rollout_replicas - start // tp, "rollout", tp),
                        max_model_len=new.max_model_len, kv_cache_gb=self.kv_cache_gb(new),
                        restart=self.supervisor.policy("rollout"), in_place=in_place)
                    await self.actors.use_rollout(group, version)
                    self.supervisor.follow("rollout", new.rollout_replicas)
                if self.pool is not None:
                    self._release(actor, old, new)
                for k, v in t.as_dict().items():
                    times[f"{actor}/{k}"] = times.get(f"{actor}/{k}", 0.0) + v
        times["total_s"] = sum(v for k, v in times.items() if k.endswith("/total_s"))
        return times

    def rollout_spawn(self, s: Setting) -> tuple[dict[str, Any], int, Any]:
        """The `EngineConfig` changes, replica count and slots that start the rollout group
        with setting `s` (how `Selection.start`'s first plan is applied at spawn)."""
        changes = {"tensor_parallel_size": s.rollout_tp, "max_model_len": s.max_model_len,
                   "kv_cache_gb": self.kv_cache_gb(s)}
        return changes, s.rollout_replicas, placed(self.pool, s.rollout_slots,
                                                   s.rollout_replicas, "rollout", s.rollout_tp)

    def _release(self, actor: str, old: Setting, new: Setting) -> None:
        """Release the slots `actor` gave up: its joined slots (a TP replica's) that no
        replica of `new` runs in (rebuilt in place: kept), then the devices it no longer
        holds."""
        assert self.pool is not None
        tp, kept = new.rollout_tp, set(getattr(new, f"{actor}_slots"))
        joins = {"_".join(new.rollout_slots[r * tp:(r + 1) * tp])
                 for r in range(new.rollout_replicas)}
        for joined in self.pool.joined():
            if joined not in joins and self.pool.owner(joined) == actor:
                self.pool.release(joined)
        for n in getattr(old, f"{actor}_slots"):
            if n not in kept:
                self.pool.release(n)


def _order(actors: list[str], old: Setting, new: Setting) -> list[str]:
    """`actors` in an order where each goes after those holding slots it takes (they give them
    up first); where none is free of that (a swap), the rollout first."""
    def slots(s: Setting, actor: str) -> set[str]:
        return set(getattr(s, f"{actor}_slots"))

    left, out = list(actors), []
    while left:
        free = [a for a in left
                if not slots(new, a) & {n for b in left if b != a for n in slots(old, b)}]
        nxt = free[0] if free else ("rollout" if "rollout" in left else left[0])
        out.append(nxt)
        left.remove(nxt)
    return out


# throughput lost per doubling of TP: CPU slots measured (bench/parallel.py: a TP-2 vLLM replica
# made 0.77x of two TP-1 replicas on the same 2 cores; a TP-2 trainer 0.93x of DP 2), GPUs the
# roofline's NVLink default
CPU_TP_OVERHEAD, GPU_TP_OVERHEAD = 0.25, 0.06
# One CPU core's roofs (this machine's AMD EPYC, torch 2.13, one thread): a 1,024^2 fp32 matmul
# ran 106 GFLOP/s, a 4,096^2 fp32 matrix-vector product streamed 24 GB/s. A device's CPU share
# scales both alike; their ratio puts decode on CPU devices compute bound.
CPU_PEAK_FLOPS, CPU_MEM_BW = 1.06e11, 2.4e10
# One decode step's cost beyond the roofline on one CPU core (vLLM's scheduling and sampling),
# fitted on one layout's measured rates and held out on the others
# (`bench/_selector_calibration.py`, `fit_decode_step`)
CPU_DECODE_STEP_S = 1.34e-3


def cost_model_of(model_dir: str, *, reserve_mib: float, dtype_bytes: int = 4,
                  logit_bytes: float = 8.0, tp_overhead: float = CPU_TP_OVERHEAD,
                  cpu: bool = True) -> CostModel:
    """The cost model of the HF model in `model_dir`, fp32, Adam's two moments, with
    `reserve_mib` of per-process baseline (Python, torch, vLLM) that every slot pays before the
    model's bytes; its roofs are a CPU core's (`cpu`) or an H100's.

    Its memory is the trainer's as it runs: SDPA attention (no scores kept: linear in the
    context, `attention="flash"`) and `logit_bytes` per vocabulary entry per trained token.
    Checked against the kernel's OOM kills of the memory-bound runs
    (`bench/selector_simulate.py`'s `calibration.oom`: the largest micro-batch the trainer
    survived before each kill, within 10%); eager pricing (scores kept) put it 5x lower."""
    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    return CostModel(shape, CostConfig(weight_bytes=dtype_bytes, grad_bytes=dtype_bytes,
                                       optimizer_bytes=2 * dtype_bytes, act_bytes=dtype_bytes,
                                       kv_bytes=dtype_bytes, attention="flash",
                                       logit_bytes=logit_bytes,
                                       reserve_bytes=reserve_mib * 2**20,
                                       tp_overhead=tp_overhead,
                                       **({"peak_flops": CPU_PEAK_FLOPS, "mem_bw": CPU_MEM_BW,
                                           "decode_step_s": CPU_DECODE_STEP_S}
                                          if cpu else {})))


def make_policy(factory: str, cost: CostModel, config: PolicyConfig,
                measured: RunProfile) -> Policy:
    """The run's policy: `factory` ("PATH.py:NAME" or "module:NAME", called with the cost
    model, the knobs and the live profile), or `SearchPolicy` when it is empty.

    Raises:
        ValueError: the factory cannot be imported; names the field.
        TypeError: it returns something without `decide`.
    """
    if not factory:
        return SearchPolicy(cost, config, measured=measured)
    from earl.recipe import load_function

    made = load_function(factory, what="selector.policy_factory")(cost, config, measured)
    if not callable(getattr(made, "decide", None)):
        raise TypeError(f"selector.policy_factory: {factory} returned "
                         f"{type(made).__name__}, which has no decide(); return an "
                         "earl.runtime.selector.Policy")
    return made  # type: ignore[no-any-return]


def slot_usage(pool: SlotPool | None) -> dict[str, float]:
    """Per slot: MiB charged now and the peak since it was made, since the rollout replica in
    it was measured (`SlotMemory.measure`) or since its trainer or reference step was
    (`device_peak`; cgroup slots only)."""
    out: dict[str, float] = {}
    if pool is None:
        return out
    for name in pool.budgets():
        if (peak := pool.memory_peak_mib(name)) is not None:
            out[f"selector/slot/{name}/peak_mib"] = peak
            out[f"selector/slot/{name}/used_mib"] = pool.memory_used_mib(name) or 0.0
    return out


class SlotMemory:
    """What each slot offers the cost model (the selector's `slots` input), in bytes.

    The cost model's per-process reserve is the trainer's baseline (Python, torch: what its
    process holds before the model's working set). A slot whose process holds more before its
    working set (vLLM) offers that much less. `measure` reads a rollout slot's baseline once
    its replica is up; from then on the slot's peak, less the KV cache, raises it (a replica's
    process grows with the shapes it has run: the gauntlet's grew from 0.6 to 1.2 GiB before
    oneDNN's primitive cache was capped). A slot not measured yet offers its whole budget. The
    `kept` slots (the reference's) are not offered: the selector does not move them.
    """

    def __init__(self, pool: SlotPool, trainer: tuple[str, ...],
                 kept: tuple[str, ...] = ()) -> None:
        self.pool, self.kept = pool, frozenset(kept)
        self.base = {n: pool.memory_used_mib(n) or 0.0 for n in trainer}
        self.reserve = max(self.base.values(), default=600.0)
        self._working: dict[str, tuple[float, str | None]] = {}  # slot -> KV MiB, its owner

    def measure(self, names: tuple[str, ...], working_mib: float = 0.0) -> None:
        """Read the baseline of `names`' processes now, less `working_mib` each (the KV cache
        a rollout replica allocates at start: the cost model counts it), and follow their
        peaks while the same owner holds them."""
        for n in names:
            self.base[n] = (self.pool.memory_used_mib(n) or 0.0) - working_mib
            self.pool.reset_memory_peak(n)
            self._working[n] = (working_mib, self.pool.owner(n))

    def __call__(self) -> Mapping[str, float]:
        for n, (working, owner) in list(self._working.items()):  # the peaks followed
            if self.pool.owner(n) != owner:  # its replica left the slot: the baseline too
                del self._working[n]
                self.base.pop(n, None)
            elif (peak := self.pool.memory_peak_mib(n)) is not None:
                self.base[n] = max(self.base[n], peak - working)
        return {n: b - max(0.0, self.base.get(n, self.reserve) - self.reserve) * 2**20
                for n, b in self.pool.budgets().items() if n not in self.kept}


def selection_for_run(job: Job, actors: Actors) -> tuple[Selection, ActorReconfigurer]:
    """The `Selection` of a run and its reconfigurer over `actors`, built once the trainer is
    up and before the rollout replicas are (`Selection.start` spawns them with its first
    plan).

    What the slots offer the cost model is `SlotMemory`'s; `kept` slots are not offered (a
    reference the selector does not plan). Without slots (placement.slot_memory_mib = 0) the
    policy plans for one notional slot per actor rank with an even share of the memory this
    machine has available now.
    """
    import time

    import psutil

    pl, pool, sel = job.cfg.placement, job.slots, job.cfg.selector
    rollout_names, trainer_names = job.roles["rollout"], job.roles["trainer"]
    # the reference is planned (and moved) where it has devices of its own
    reference = job.roles["reference"] if job.n_reference > 0 and pool is not None else ()
    slots: Callable[[], Mapping[str, float]]
    slot_memory: SlotMemory | None = None
    if pool is not None:
        slots = slot_memory = SlotMemory(pool, trainer_names,
                                         kept=() if reference else job.roles["reference"])
        reserve = slot_memory.reserve
    else:
        share = float(psutil.virtual_memory().available
                      / (len(rollout_names) + len(trainer_names)))

        def even_share() -> Mapping[str, float]:
            return dict.fromkeys(rollout_names + trainer_names, share)
        slots, reserve = even_share, sel.reserve_mib
    model_dir = str(job.start)
    tp_overhead = sel.tp_overhead if sel.tp_overhead >= 0 else (
        GPU_TP_OVERHEAD if pl.device == "cuda" else CPU_TP_OVERHEAD)
    cost = cost_model_of(model_dir, reserve_mib=reserve, tp_overhead=tp_overhead,
                         cpu=pl.device != "cuda")
    kvb = cost.kv_bytes_per_token(Parallel())
    positions = int(json.loads((Path(model_dir) / "config.json").read_text())
                    .get("max_position_embeddings", job.max_model_len))
    window = pl.context_window or job.max_model_len
    setting = Setting(trainer_dp=pl.trainer, micro_batch_tokens=pl.micro_batch_tokens,
                      rollout_replicas=pl.rollout, max_model_len=window,
                      kv_tokens=int(pl.kv_cache_gb * 2**30 / kvb),
                      trainer_slots=trainer_names, rollout_slots=rollout_names,
                      reference_slots=reference)
    reconf = ActorReconfigurer(
        job.rt, actors, pool=pool, slot_memory=slot_memory, env=job.env,
        checkpoint_dir=job.out / "reshard", kv_bytes_per_token=kvb, tracer=job.tracer,
        supervisor=job.supervisor)

    def trace(d: Decision) -> None:
        now = time.perf_counter()
        job.tracer.add(f"selector: {'switch' if d.changed else 'keep'}", actor="selector",
                       start=now, end=now, **d.trace_event(0.0)["args"])  # type: ignore[arg-type]

    def record(row: dict[str, float | int | str]) -> None:
        if job.metrics is not None:
            job.metrics.log({**row, **slot_usage(pool)})

    stages = ("reference", "train") if job.n_reference > 0 else ("train",)
    dock = actors.dock

    async def queues() -> Mapping[str, int]:
        """Samples in the dock not yet consumed by each stage (its backlog), and under "lost"
        the samples the dock lost (awaiting re-production)."""
        st = await dock.statistics()
        return {**{s: max(0, st.samples - st.consumed.get(s, 0)) for s in stages},
                "lost": st.lost}

    job.log(f"selector on: slots {dict(slots())}, reserve {reserve:.0f} MiB/process, model "
            f"positions {positions}, rollout window {window}")
    knobs = dataclasses.replace(  # replicas split whole groups; a batch waiting is balanced;
        # the rollout decodes one batch at a time
        sel.policy, dp_divides=sel.policy.dp_divides or job.cfg.batch_size // job.cfg.group_size,
        queue_target=sel.policy.queue_target or job.cfg.batch_size,
        rollout_seqs=sel.policy.rollout_seqs or job.cfg.batch_size,
        max_context=sel.policy.max_context or positions,
        **({"actors": {**sel.policy.actors, "reference": "reference"},
            "dp_only": (*sel.policy.dp_only, "reference")} if reference else {}))
    profile = RunProfile(cost)
    selection = Selection(make_policy(sel.policy_factory, cost, knobs, profile), reconf,
                          setting=setting, slots=slots, queues=queues, max_context=positions,
                          record=record, trace=trace, log=job.log,
                          initial_context=sel.initial_context or positions,
                          profile=profile, equal_devices=job.cfg.placement.devices > 0,
                          context_steps=sel.context_steps,
                          device_peak=device_peak(pool) if pool is not None else None,
                          reference_progress=_reference_progress(actors) if reference
                          else None)
    return selection, reconf


def device_peak(pool: SlotPool) -> Callable[[tuple[str, ...]], float | None]:
    """The largest memory peak charged to any of the named slots since the last call (cgroup
    slots; None otherwise); then each starts a new peak (`SlotPool.reset_memory_peak`)."""
    def peak(names: tuple[str, ...]) -> float | None:
        got = [p for n in names if (p := pool.memory_peak_mib(n)) is not None]
        for n in names:
            pool.reset_memory_peak(n)
        return max(got, default=None)
    return peak


def _reference_progress(actors: Actors) -> Callable[[], Awaitable[ReferenceProgress]]:
    """Tokens scored and busy seconds of the live reference group, summed over its ranks; its
    ranks' largest memory peak since the last reading; its padded tokens per forward pass."""
    budget: list[int] = []  # padded tokens per forward pass, read once

    async def progress() -> ReferenceProgress:
        group = actors.reference
        assert group is not None
        if not budget:  # every group a move re-creates keeps the run's reference config
            budget.append(int((await group[0].config.call_one())["token_budget"]))
        tokens, busy, peaks = await asyncio.gather(
            group.tokens_scored.call(), group.busy_seconds.call(), group.memory_peak_mib.call())
        return ReferenceProgress(sum(tokens), sum(busy), max(peaks, default=0.0), budget[0])
    return progress
