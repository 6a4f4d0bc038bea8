"""What a run would start, without starting it: `earl train --dry-run`.

`plan(cfg, machine)` lays a validated run config over a machine and returns, as JSON-ready
data, what the run's spawning would build: each stage's ranks, layout, dtype and devices (GPUs
from `earl.loop.devices.plan_gpus`, CPU slots from `device_roles`), the vLLM engine arguments
of every rollout replica (`earl.stages.vllm_build.engine_args` over the replica's
`EngineConfig`), and the trainer's backend and parallelism (its `TrainerConfig`). The configs
come from `earl.loop.stage_configs`, the functions the run itself spawns from, so the plan is
the run's, not a copy of its rules.

The machine may be another one: `Machine(gpus=8, gpu_memory_mib=81920)` plans an 8-GPU node
from a laptop (`earl train --placement.device=cuda --dry-run --gpus 8 --gpu-memory-gib 80`).

    cfg = load_config(None, ["--placement.device=cuda"], gpus=8)
    plan(cfg, Machine(gpus=8, gpu_memory_mib=81920)).rollout.engine_args[0]["enforce_eager"]

Not here: starting anything, writing files, building the model (the plan names the folder
the run would serve, `<output_dir>/weights_start`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from earl.loop.devices import device_roles, plan_gpus, rollout_memory_mib
from earl.loop.stage_configs import (
    engine_config,
    reference_config,
    trainer_config,
)

if TYPE_CHECKING:
    from earl.config import RunConfig

__all__ = ["Machine", "Plan", "machine", "plan"]

Devices = list[list[int | str]]  # per rank: its GPU indices or CPU slot names ([]: none)


@dataclass(frozen=True, slots=True, kw_only=True)
class Machine:
    """The GPUs a plan is for: how many the driver sees and the memory of each (MiB)."""

    gpus: int
    gpu_memory_mib: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutPlan:
    """The vLLM replicas: `replicas` x `tp` devices, each replica's engine arguments."""

    replicas: int
    tp: int
    dtype: str
    devices: Devices
    where: str
    memory_mib_per_gpu: int | None  # vLLM's budget on each GPU (None: vLLM's default share)
    engine_env: dict[str, str]  # what the replica sets before building vLLM
    engine_args: list[dict[str, object]]  # per replica: vLLM's EngineArgs keywords


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerPlan:
    """The trainer ranks: `dp` x `tp` x `pp` of them, on `backend` with `parallel`."""

    ranks: int
    backend: str
    parallel: str
    dp: int
    tp: int
    pp: int
    dtype: str
    micro_batch_tokens: int
    lora_rank: int
    devices: Devices
    where: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReferencePlan:
    """The reference actors (none without a KL term)."""

    ranks: int
    dtype: str | None
    devices: Devices
    where: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """A run's device plan (`to_json` for `--json`, `describe` for a person)."""

    device: str
    launcher: str
    colocate: bool
    selector: bool
    weights_transport: str
    machine: Machine | None
    gpus_used: int
    rollout: RolloutPlan
    trainer: TrainerPlan
    reference: ReferencePlan
    producers: int
    note: str

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        """A few lines for a person (the JSON has every field)."""
        m, ro, tr, ref = self.machine, self.rollout, self.trainer, self.reference
        head = f"plan: device {self.device}, launcher {self.launcher}" + \
            (", colocated" if self.colocate else "")
        if m is not None:
            head += f"; {m.gpus} GPU(s) of {m.gpu_memory_mib} MiB, {self.gpus_used} used"
        args = ro.engine_args[0] if ro.engine_args else {}
        vllm = ", ".join(f"{k}={args[k]}" for k in (
            "dtype", "enforce_eager", "enable_chunked_prefill", "async_scheduling",
            "gpu_memory_utilization") if k in args)
        def on(where: str, devices: Devices) -> str:
            return f"on {where}" + (f" {devices}" if any(devices) else "")

        lines = [head,
                 (f"  rollout: {ro.replicas} replica(s) x tp {ro.tp} "
                  f"{on(ro.where, ro.devices)}; vLLM {vllm}"),
                 (f"  trainer: {tr.ranks} rank(s), {tr.backend} {tr.parallel}, dp {tr.dp} x "
                  f"tp {tr.tp} x pp {tr.pp}, {tr.dtype}, {on(tr.where, tr.devices)}"),
                 f"  reference: {ref.ranks} actor(s)" +
                 (f", {ref.dtype}, {on(ref.where, ref.devices)}" if ref.ranks else ""),
                 f"  producers: {self.producers} (host)"]
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)


def machine(gpus: int | None = None, gpu_memory_gib: float | None = None) -> Machine:
    """The machine to plan for: the stated GPU count and memory, else this one's GPUs.

    Raises:
        ValueError: no GPU here and none stated, or a count or memory below 1; names the flag.
    """
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be >= 1 (the GPUs of the machine to plan for), got {gpus}")
    if gpu_memory_gib is not None and gpu_memory_gib <= 0:
        raise ValueError(f"--gpu-memory-gib must be > 0 (each GPU's memory, e.g. 80), got "
                         f"{gpu_memory_gib}")
    import torch

    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if (gpus is None or gpu_memory_gib is None) and here == 0:
        raise ValueError("placement.device=cuda, but this machine has no GPU to plan for: "
                         "state the one the run is meant for with --gpus N --gpu-memory-gib G "
                         "(e.g. --gpus 8 --gpu-memory-gib 80)")
    total = int(gpu_memory_gib * 1024) if gpu_memory_gib is not None else \
        int(torch.cuda.get_device_properties(0).total_memory >> 20)
    return Machine(gpus=gpus if gpus is not None else here, gpu_memory_mib=total)


def plan(cfg: RunConfig, machine: Machine | None = None) -> Plan:
    """The device plan of `cfg` on `machine` (needed for placement.device=cuda; see the
    module docstring).

    Raises:
        ValueError: a CUDA placement without a machine, or one whose layout does not fit it.
    """
    from earl.stages.vllm_build import ENGINE_ENV, engine_args

    pl = cfg.placement
    cuda = pl.device == "cuda"
    if cuda and machine is None:
        raise ValueError("plan: placement.device=cuda needs the machine (Machine(gpus=, "
                         "gpu_memory_mib=); earl train --dry-run --gpus N --gpu-memory-gib G)")
    n_ref = cfg.reference_actors
    start = str(Path(cfg.output_dir) / "weights_start")  # what the warm start writes
    devices, where = _devices(cfg, n_ref, machine)
    total = machine.gpu_memory_mib if machine is not None and cuda else None
    ecfg = engine_config(cfg, model=start, max_model_len=_context_window(cfg))
    slot_mib = None
    if cuda and pl.launcher == "local":  # vLLM's budget: the rollout slot's (spawn_replicas)
        slot_mib = rollout_memory_mib(pl, gpu_total_mib=total)
        ecfg.gpu_memory_mib = slot_mib or 0
    args: dict[str, object] = engine_args(ecfg, gpu_total_mib=total)
    tcfg = trainer_config(cfg, model=start)
    used = {g for stage in ("rollout", "trainer", "reference") for own in devices[stage]
            for g in own if isinstance(g, int)}
    return Plan(
        device=pl.device, launcher=pl.launcher, colocate=pl.colocate, selector=cfg.selector.on,
        weights_transport=pl.weights_transport or "auto", machine=machine if cuda else None,
        gpus_used=len(used), producers=pl.producers,
        note="the selector re-plans the rollout's and the trainer's devices, layout and "
             "budgets before each step: shown is the starting placement"
             if cfg.selector.on else "",
        rollout=RolloutPlan(replicas=pl.rollout, tp=pl.rollout_tp, dtype=ecfg.compute.dtype,
                            devices=devices["rollout"], where=where,
                            memory_mib_per_gpu=slot_mib, engine_env=dict(ENGINE_ENV),
                            engine_args=[dict(args) for _ in range(pl.rollout)]),
        trainer=TrainerPlan(ranks=pl.trainer, backend=pl.backend, parallel=tcfg.parallel,
                            dp=pl.trainer // (pl.trainer_tp * pl.trainer_pp), tp=pl.trainer_tp,
                            pp=pl.trainer_pp, dtype=tcfg.compute.dtype,
                            micro_batch_tokens=tcfg.micro_batch_tokens, lora_rank=cfg.lora.rank,
                            devices=devices["trainer"], where=where),
        reference=ReferencePlan(ranks=n_ref, devices=devices["reference"], where=where,
                                dtype=reference_config(cfg, model=start).compute.dtype
                                if n_ref else None))


def _devices(cfg: RunConfig, n_ref: int,
             machine: Machine | None) -> tuple[dict[str, Devices], str]:
    """Each stage's devices per rank, and what they are: GPU indices (CUDA, local launcher),
    none named (Ray picks each rank's GPUs), CPU slot names, or none (the host's cores)."""
    pl = cfg.placement
    ranks = {"rollout": pl.rollout, "trainer": pl.trainer, "reference": n_ref}
    if pl.device == "cuda" and pl.launcher == "ray":
        return {s: [[] for _ in range(n)] for s, n in ranks.items()}, \
            "GPUs Ray picks (rollout_tp per replica, 1 per other rank)"
    if pl.device == "cuda":
        assert machine is not None
        gpus = min(machine.gpus, pl.devices or machine.gpus)  # as the run's Job
        g = plan_gpus(pl, reference=n_ref, gpus=gpus)
        return {s: [list[int | str](own) for own in rs] for s, rs in g.stages().items()}, "GPUs"
    if pl.slot_memory_mib == 0:
        return {s: [[] for _ in range(n)] for s, n in ranks.items()}, "host cores (no slots)"
    roles = device_roles(pl, reference=n_ref)
    per = pl.devices_per_replica() if pl.devices else 1
    return {"rollout": [list[int | str](roles["rollout"][r * per:(r + 1) * per])
                        for r in range(pl.rollout)],
            "trainer": [[n] for n in roles["trainer"]],
            "reference": [[n] for n in roles["reference"]]}, "CPU slots"


def _context_window(cfg: RunConfig) -> int:
    """The context window the rollout would start with, without building the model: as
    `earl.resolve.context_length` over the folder the run starts from."""
    from earl.resolve import context_length

    if cfg.model.max_model_len or not cfg.model.path:
        # the tiny model is built with model.max_model_len or DEFAULT_CONTEXT positions
        return cfg.model.max_model_len or cfg.model.DEFAULT_CONTEXT
    from earl.models.smollm2 import resolve_model

    return context_length(cfg.model, resolve_model(cfg.model.path))
