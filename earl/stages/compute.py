"""What every stage's process computes with, declared once: `Compute`.

`Compute` is the run's `Hardware` (the device kind, the compute dtype and the CPU threads, which
`earl.placement.PlacementConfig` declares for the whole run) and the run's seed (`Seeded`, which
`earl.config.RunConfig` declares). The trainer's, the reference's and each rollout replica's
config reference one (`TrainerConfig.compute`, `ReferenceConfig.compute`,
`EngineConfig.compute`), built by `earl.loop.stage_configs` from the run's config with "auto"
resolved; none of them declares these fields again.

Two stage settings that the run's placement also holds (the selector re-sets them) are sections
declared here once and inherited by both: the trainer's `Packing` (`TrainerConfig`) and a
rollout replica's `KvCache` (`EngineConfig`). A stage config takes a section of the run's whole
with `fields_of`, never field by field.

Not here: where each rank runs (`earl.loop.devices`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from earl.runtime.errors import need

__all__ = ["DEVICES", "DTYPES", "Compute", "Hardware", "KvCache", "Packing", "Seeded", "fields_of"]

DEVICES = ("cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16")  # "auto": Hardware.compute_dtype


@dataclass(kw_only=True, slots=True)
class Hardware:
    """What a process computes on, and in what precision.

    Attributes:
        device: "cpu" or "cuda" (on CUDA: the first GPU the process sees, its slot's).
        dtype: "float32", "bfloat16" (the trainer: bf16 autocast over fp32 master weights), or
            "auto": bfloat16 on CUDA (which vLLM's fast attention kernels need), float32 on CPU
            (`compute_dtype`).
        threads: torch/OpenMP threads of each actor process.
    """

    device: str = "cpu"
    dtype: str = "auto"
    threads: int = 1

    def __post_init__(self) -> None:
        need(self.device in DEVICES, "device", f"{self.device!r} unknown; choose one of {DEVICES}")
        need(self.dtype in DTYPES, "dtype", f"{self.dtype!r} unknown; choose one of {DTYPES}")
        need(self.threads >= 1, "threads", "must be >= 1")

    def compute_dtype(self, device: str | None = None) -> str:
        """`dtype` resolved for `device` (default: `self.device`): "auto" is "bfloat16" on
        CUDA and "float32" on CPU (where the trainer's and vLLM's bf16 is not faster on every
        machine, and sampling log-probs then match the trainer's exactly)."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if (device or self.device) == "cuda" else "float32"


@dataclass(kw_only=True)
class Seeded:
    """The run's seed: the task order, the warm start's data, the trainer's and vLLM's random
    generators. A base without slots of its own, so that `Compute` can join it to `Hardware`
    (two slotted bases cannot be combined)."""

    seed: int = 0


@dataclass(kw_only=True, slots=True)
class Compute(Hardware, Seeded):
    """What a stage's process computes with: the run's `Hardware` and seed, one section that
    every stage config references. A stage resolves "auto" (`resolved`) when its config is
    built, so its `dtype` is what it computes in.

    Example:
        >>> Compute(device="cuda").resolved().dtype
        'bfloat16'
    """

    def __post_init__(self) -> None:
        Hardware.__post_init__(self)

    @classmethod
    def of(cls, hardware: Hardware, seed: int) -> Compute:
        """The section for `hardware` (a run's placement) and the run's `seed`, resolved."""
        return cls(**fields_of(Hardware, hardware), seed=seed).resolved()

    def resolved(self) -> Compute:
        """This section with "auto" replaced by the dtype it means on this device."""
        return dataclasses.replace(self, dtype=self.compute_dtype())

    @classmethod
    def coerce(cls, value: Compute | dict[str, object]) -> Compute:
        """`value` as a resolved `Compute` (a dict: its fields, as `dataclasses.asdict` gave)."""
        out = cls(**value) if isinstance(value, dict) else value  # type: ignore[arg-type]
        return out.resolved()


@dataclass(kw_only=True)
class Packing:
    """How the trainer packs a step's samples into forward/backward passes: `TrainerConfig`
    and the run's placement (`placement.micro_batch_tokens`, `placement.shared_prefix`) are
    each one. Without slots, like `Seeded`, so that a slotted config can join it.

    Attributes:
        micro_batch_tokens: token budget of one packed forward/backward. 4096: on CPU the
            fastest per token of those measured for the tiny default (~15% faster than one
            65536-token pass), and the trainer's working set follows it, not the batch's
            tokens; a GPU wants 16-64K (`--placement.micro_batch_tokens`).
        shared_prefix: run a prefix that several samples of a micro-batch share (a GRPO
            group's prompt) once per forward (`earl.packing_prefix`: exact; fewer tokens when
            the prompt is most of a sample).
    """

    micro_batch_tokens: int = 4096
    shared_prefix: bool = False


@dataclass(kw_only=True)
class KvCache:
    """A rollout replica's KV-cache budget: `EngineConfig` and the run's placement
    (`placement.kv_cache_gb`) are each one.

    Attributes:
        kv_cache_gb: KV-cache budget per tensor-parallel worker, in GiB (fractions allowed;
            on CUDA vLLM fills its GPU budget instead and this is not used).
    """

    kv_cache_gb: float = 0.25


def fields_of(section: type, config: object) -> dict[str, Any]:
    """The fields of `section` as `config` (a config that is one, e.g. the run's placement)
    holds them: the keyword arguments that give a stage config, also one, the run's values.

    Example:
        >>> fields_of(Packing, Packing(micro_batch_tokens=4096))
        {'micro_batch_tokens': 4096, 'shared_prefix': False}
    """
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(section)}
