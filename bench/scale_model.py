"""Analytic model of intermediate-data movement per RL step: single controller vs EARL's dispatcher.

    python bench/scale_model.py          # docs/design/data-plane.md's table (also: earl bench scale_model)
    python bench/scale_model.py --gpus 1024 --model-params 230e9 --context-len 32768

A model at a scale this machine cannot run, not a measurement, and no part of the runtime: it
imports nothing from EARL.

Per step, the experience of ``prompts x samples_per_prompt`` sequences of ``context_len`` tokens
flows through the stages of a PPO/GRPO step (verl-style columns, bytes per token):

1. rollout -> dock: ids, attention mask, position ids, response mask (int64) + log-probs.
2. reference log-probs and 3. old-policy log-probs: inputs are ids, mask, positions;
   the output is one float32 per token.
4. policy update: ids, mask, positions, response mask, old/ref log-probs, advantages.

A *single controller* gathers every output into one driver and scatters every input to every
rank of the consuming worker group -- in a TP x PP (x CP) model each rank of a DP replica
receives the full replica batch -- so all bytes pass through one process at ``driver_GBps``
(one Python process: (de)serialization and copies, not the NIC, bound it).

EARL's dispatcher fetches each replica's share once, straight from the warehouses, into the
replica's leader (all replicas in parallel, at node NIC speed), then broadcasts it inside the
replica (pipelined, so the time is size / link bandwidth regardless of the group size).

Not here: compute time, rollout generation, weight sync.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import asdict, dataclass

import _results

# bytes per token of each stage's inputs (scattered) and outputs (gathered), verl dtypes
ROLLOUT_OUT = 8 * 4 + 4  # input_ids, attention_mask, position_ids, response_mask + logprobs
LOGPROB_IN, LOGPROB_OUT = 8 * 3, 4
UPDATE_IN = 8 * 4 + 4 * 3  # + old_logprobs, ref_logprobs, advantages


@dataclass(kw_only=True, slots=True)
class ScaleConfig:
    gpus: int = 1024
    model_params: float = 230e9
    prompts: int = 512
    samples_per_prompt: int = 16
    context_len: int = 32768
    tp: int | None = None  # derived from the model size when None
    pp: int | None = None
    cp: int = 1
    gpus_per_node: int = 8
    gpu_mem_GB: float = 80.0
    bytes_per_param: float = 16.0  # bf16 weights + grads, fp32 master + Adam moments
    driver_GBps: float = 1.0  # end-to-end rate of one Python driver process
    node_nic_GBps: float = 50.0  # 400 Gb/s per node
    intra_node_GBps: float = 150.0  # NVLink-class, per direction, achieved

    def __post_init__(self) -> None:
        for f in ("gpus", "prompts", "samples_per_prompt", "context_len", "cp", "gpus_per_node"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        for f in ("model_params", "driver_GBps", "node_nic_GBps", "intra_node_GBps"):
            if getattr(self, f) <= 0:
                raise ValueError(f"{f} must be > 0, got {getattr(self, f)}")


@dataclass(frozen=True, slots=True)
class ScaleResult:
    tp: int
    pp: int
    dp: int
    replica_ranks: int
    tokens: int
    volume_TB: float  # bytes through the single controller per step
    single_controller_s: float
    dispatcher_s: float
    driver_bytes_dispatcher: int  # metadata only


def model_parallel(cfg: ScaleConfig) -> tuple[int, int]:
    """(tp, pp): TP up to one node, then the smallest power-of-two PP that fits the model."""
    if cfg.tp is not None and cfg.pp is not None:
        return cfg.tp, cfg.pp
    need = math.ceil(cfg.model_params * cfg.bytes_per_param / (0.8 * cfg.gpu_mem_GB * 1e9))
    tp = cfg.tp or min(cfg.gpus_per_node, 1 << max(0, (need - 1).bit_length()))
    pp = cfg.pp or 1 << max(0, (math.ceil(need / tp) - 1).bit_length())
    return tp, pp


def estimate(cfg: ScaleConfig) -> ScaleResult:
    tp, pp = model_parallel(cfg)
    r = tp * pp * cfg.cp
    if cfg.gpus % r:
        raise ValueError(f"gpus={cfg.gpus} is not a multiple of tp*pp*cp={r}; change the layout")
    dp = cfg.gpus // r
    tokens = cfg.prompts * cfg.samples_per_prompt * cfg.context_len
    scattered = 2 * LOGPROB_IN + UPDATE_IN  # per token, to every rank of a replica
    gathered = ROLLOUT_OUT + 2 * LOGPROB_OUT
    volume = tokens * (gathered + r * scattered)
    single = volume / (cfg.driver_GBps * 1e9)
    share = tokens / dp * scattered  # each replica's inputs, fetched once
    spans_nodes = r > cfg.gpus_per_node
    bcast_bw = cfg.node_nic_GBps if spans_nodes else cfg.intra_node_GBps
    dispatcher = share / (cfg.node_nic_GBps * 1e9) + share / (bcast_bw * 1e9)
    return ScaleResult(tp=tp, pp=pp, dp=dp, replica_ranks=r, tokens=tokens,
                       volume_TB=volume / 1e12, single_controller_s=single,
                       dispatcher_s=dispatcher, driver_bytes_dispatcher=0)


SCENARIOS = [
    ScaleConfig(gpus=64, model_params=7e9, prompts=256, context_len=8192),
    ScaleConfig(gpus=256, model_params=32e9, prompts=512, context_len=16384),
    ScaleConfig(gpus=1024, model_params=230e9, prompts=512, context_len=32768),
]


def table(configs: list[ScaleConfig] = SCENARIOS) -> str:
    """A markdown table of `estimate` for each config (docs/design/data-plane.md's scale table)."""
    rows = [
        ("| GPUs | model | context | batch (seqs) | TPxPP | data through driver | "
        "single controller | EARL dispatcher |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        e = estimate(c)
        rows.append(
            f"| {c.gpus} | {c.model_params / 1e9:.0f}B | {c.context_len // 1024}K | "
            f"{c.prompts * c.samples_per_prompt} | {e.tp}x{e.pp} | {e.volume_TB:.2f} TB | "
            f"{_dur(e.single_controller_s)} | {_dur(e.dispatcher_s)} |"
        )
    return "\n".join(rows)


def _dur(s: float) -> str:
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.1f} s" if s >= 1 else f"{s * 1e3:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="intermediate-data volume and transfer time")
    ap.add_argument("--gpus", type=int)
    ap.add_argument("--model-params", type=float, help="e.g. 230e9")
    ap.add_argument("--context-len", type=int)
    ap.add_argument("--prompts", type=int)
    ap.add_argument("--driver-GBps", type=float)
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    given = {k: v for k, v in vars(args).items() if v is not None and k != "save"}
    configs = [ScaleConfig(**given)] if given else SCENARIOS
    print(table(configs))
    if args.save:
        _results.save("scale_model", {"scenarios": [
            {"config": asdict(c), "estimate": asdict(estimate(c))} for c in configs]},
            quick=False, begun=begun)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
