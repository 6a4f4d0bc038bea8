"""Trainer benchmark: packed varlen attention vs block-diagonal mask vs padding vs one-by-one,
and the full train step against the machine's matmul peak.

    python bench/trainer.py --json [--quick] [--threads 2]

For tiny Qwen2 models (~0.2M, ~0.8M, ~1.8M parameters; --quick: 0.8M only, 32 samples) and 64 samples of
50-400 tokens cut into 4096-token micro-batches, prints one JSON object with, per model:
- ``fwd_bwd_tok_s``: tokens/s of forward + log-probs + backward, per attention layout:
  ``varlen`` (EARL default: packed row, causal SDPA per sample), ``mask`` (packed row, one SDPA
  with a block-diagonal mask: T^2 work), ``padded`` (the usual right-padded [B, L] batch with a
  padding mask), ``per_sample`` (one forward per sample, no padding, no packing);
- ``varlen_vs_padded``, ``varlen_vs_mask``: speed-up ratios;
- ``train_step_tok_s``: `TorchTrainer.train_step` (PPO loss, entropy, AdamW, clipping) tokens/s;
- ``mfu``: model FLOPs/s of that train step (6 x params x tokens, plus attention) divided by
  ``peak_gflops``, the fp32 matmul GFLOP/s measured here with the same threads (the physical
  limit for this CPU).
Cases run interleaved, round after round; each number is the best round (least disturbed
by other work on a shared machine), the peak included.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable

import _results
from _machine import matmul_gflops

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _bench_model(hidden: int, layers: int, rounds: int, seed: int, samples: int
                 ) -> dict[str, object]:
    import torch
    from transformers import AutoModelForCausalLM

    from earl.models.tiny import build_tiny_model
    from earl.packing import pack, packed_forward, plan_micro_batches, set_attention, token_logprobs
    from earl.stages.compute import Compute
    from earl.stages.trainer_batch import TrainBatch
    from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

    rng = random.Random(seed)
    lengths = [rng.randint(50, 400) for _ in range(samples)]
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(7, 263, (n,), generator=g) for n in lengths]
    plan = plan_micro_batches(lengths, 4096)
    folder = build_tiny_model(tempfile.mkdtemp(prefix="earl-bench-"), hidden=hidden,
                              layers=layers, intermediate=3 * hidden, max_positions=512)
    model = AutoModelForCausalLM.from_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())

    def packed(mode: str) -> Callable[[], None]:
        def run() -> None:
            set_attention(model, mode)  # type: ignore[arg-type]
            for mb in plan:
                p = pack([seqs[i] for i in mb])
                token_logprobs(packed_forward(model, p), p).sum().backward()
        return run

    def padded() -> None:
        model.set_attn_implementation("sdpa")
        for mb in plan:
            width = max(lengths[i] for i in mb)
            ids = torch.zeros(len(mb), width, dtype=torch.long)
            am = torch.zeros(len(mb), width, dtype=torch.long)
            for r, i in enumerate(mb):
                ids[r, :lengths[i]], am[r, :lengths[i]] = seqs[i], 1
            logits = model(input_ids=ids, attention_mask=am, use_cache=False).logits[:, :-1]
            lp = logits.gather(-1, ids[:, 1:, None])[..., 0] - torch.logsumexp(logits, -1)
            (lp * am[:, 1:]).sum().backward()

    def per_sample() -> None:
        model.set_attn_implementation("sdpa")
        for s in seqs:
            p = pack([s])
            token_logprobs(model(input_ids=s[None], use_cache=False).logits[0], p).sum().backward()

    batch = TrainBatch.from_samples([
        {"input_ids": s, "loss_mask": torch.ones(len(s)), "advantages": torch.randn(len(s), generator=g),
         "rollout_logprobs": -torch.rand(len(s), generator=g)} for s in seqs])
    trainer = TorchTrainer(TrainerConfig(  # the threads this bench set (torch's, as they are)
        model=str(folder), micro_batch_tokens=4096,
        compute=Compute(threads=torch.get_num_threads()),
        loss={"entropy_coef": 0.01}))  # type: ignore[arg-type]

    def train_step() -> None:
        trainer.train_step(batch)

    peaks: list[float] = []
    cases = {"varlen": packed("varlen"), "mask": packed("mask"), "padded": padded,
             "per_sample": per_sample, "train_step": train_step,
             "peak": lambda: peaks.append(matmul_gflops(reps=3))}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in cases.items():
            model.zero_grad(set_to_none=True)
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    tokens = sum(lengths)
    del times["peak"]
    tok_s = {k: round(tokens / min(v)) for k, v in times.items()}
    step = tok_s.pop("train_step")
    avg_ctx = sum(n * n for n in lengths) / tokens / 2
    flops_per_token = 6 * params + 12 * layers * hidden * avg_ctx  # fwd+bwd, attention included
    return {"params": params, "tokens": tokens, "micro_batches": len(plan),
            "fwd_bwd_tok_s": tok_s,
            "varlen_vs_padded": round(tok_s["varlen"] / tok_s["padded"], 2),
            "varlen_vs_mask": round(tok_s["varlen"] / tok_s["mask"], 2),
            "train_step_tok_s": step,
            "train_step_gflops": round(step * flops_per_token / 1e9, 2),
            "peak_gflops": round(max(peaks), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print only the JSON object")
    ap.add_argument("--quick", action="store_true", help="one model, 32 samples, 2 rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=None)
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    import torch

    torch.set_num_threads(args.threads)
    rounds = args.rounds or (2 if args.quick else 3)
    shapes = [(128, 4)] if args.quick else [(64, 4), (128, 4), (192, 4)]
    models = {}
    for hidden, layers in shapes:
        r = _bench_model(hidden, layers, rounds, seed=0, samples=32 if args.quick else 64)
        r["mfu"] = round(float(r["train_step_gflops"]) / float(r["peak_gflops"]), 3)  # type: ignore[arg-type]
        models[f"h{hidden}_l{layers}"] = r
        if not args.json:
            print(f"h{hidden} l{layers}: {r}", file=sys.stderr)
    main_key = "h128_l4"
    out = {"threads": args.threads, "rounds": rounds,
           "peak_gflops": models[main_key]["peak_gflops"],
           "varlen_vs_padded": models[main_key]["varlen_vs_padded"],
           "train_step_tok_s": models[main_key]["train_step_tok_s"],
           "mfu": models[main_key]["mfu"],
           "mfu_basis": "relative to the fp32 matmul GFLOP/s measured in this run (peak_gflops), "
                        "not to a datasheet peak",
           "models": models}
    print(json.dumps(out))
    if args.save:
        _results.save("trainer", out, quick=args.quick, begun=begun)
    return 0


if __name__ == "__main__":
    sys.exit(main())
