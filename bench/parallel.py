"""Parallelism benchmark: TP=1 vs TP=2 for rollout (vLLM on CPU) and training (DTensor over gloo),
and the seconds a live reconfiguration takes, by phase.

    python bench/parallel.py --json [--quick] [--parts rollout,train,reconfig]

Prints one JSON object:
- ``rollout_tok_s``: vLLM generation tokens/s on one model (``params``), 64 prompts x
  ``gen_tokens``, greedy: ``tp1`` (best of 1 and 2 OpenMP threads: the baseline's best
  configuration) and ``tp2`` (2 worker processes, one core each); ``tp2_vs_tp1``.
- ``train_tok_s``: `TorchTrainer.train_step` tokens/s on the same model: ``tp1`` (one rank,
  best of 1 and 2 threads), ``dp2`` (DDP over 2 ranks) and ``tp2`` (TP over 2 ranks), each
  rank one thread; ``tp2_vs_tp1``.
- ``reconfig_trainer_s``: `reconfigure_trainer` DP=2 -> TP=2 through the actor runtime, by phase
  (save, stop, spawn, load, push of the weights into a rollout replica), and
  ``reconfig_rollout_s``: `reconfigure_rollout` TP=1 -> TP=2 (stop, spawn, push).
Each throughput is the best of ``reps`` rounds (least disturbed on a shared 2-core machine);
reconfiguration is one run (it spawns processes: seconds, noisy).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

import _results

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = {"hidden": 512, "layers": 4, "heads": 8, "kv_heads": 4, "intermediate": 1536,
         "vocab_size": 320, "max_positions": 1024}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _prompts(n: int = 64) -> list[list[int]]:
    return [[1] + [7 + (i * 13 + j * 7) % 300 for j in range(16 + i % 32)] for i in range(n)]


async def _rollout(model: str, tp: int, threads: int, gen: int, reps: int) -> float:
    from earl.engine import SamplingParams
    from earl.stages.compute import Compute
    from earl.stages.vllm_engine import EngineConfig, VLLMEngine

    cfg = EngineConfig(model=model, compute=Compute(dtype="float32", threads=threads),
                       max_model_len=512, kv_cache_gb=0.25, tensor_parallel_size=tp)
    params = SamplingParams(max_tokens=gen, temperature=0.0)
    best = 0.0
    async with VLLMEngine(cfg) as eng:
        await eng.generate_batch(_prompts(8), params)  # warm-up
        for _ in range(reps):
            t = time.perf_counter()
            gens = await eng.generate_batch(_prompts(), params)
            best = max(best, sum(len(g.token_ids) for g in gens) / (time.perf_counter() - t))
    return best


def _rollout_child(model: str, tp: int, threads: int, gen: int, reps: int, conn) -> None:  # type: ignore[no-untyped-def]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    conn.send(asyncio.run(_rollout(model, tp, threads, gen, reps)))


def _batch(samples: int = 32):  # type: ignore[no-untyped-def]
    import torch

    from earl.stages.trainer_batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    out = []
    for k in range(samples):
        n = 64 + (k * 37) % 192
        mask = torch.zeros(n)
        mask[n // 4:] = 1
        out.append({"input_ids": torch.randint(7, 300, (n,), generator=g), "loss_mask": mask,
                    "advantages": torch.full((n,), 1.0 if k % 2 else -1.0)})
    return TrainBatch.from_samples(out)


def _train_child(model: str, rank: int, world: int, tp: int, threads: int, url: str | None,
                 reps: int, conn) -> None:  # type: ignore[no-untyped-def]
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    from earl.stages.compute import Compute
    from earl.stages.optim import OptimConfig
    from earl.stages.trainer_torch import TorchTrainer, TrainerConfig

    torch.set_num_threads(threads)
    t = TorchTrainer(TrainerConfig(model=model, tp=tp, dist_url=url, optim=OptimConfig(lr=1e-5),
                                   micro_batch_tokens=2048, compute=Compute(threads=threads)),
                     rank=rank, world_size=world)
    batch = _batch()
    dp = world // tp
    mine = batch.split(dp)[rank // tp] if dp > 1 else batch
    t.train_step(mine)  # warm-up
    best = 0.0
    for _ in range(reps):
        m = t.train_step(mine)
        best = max(best, m["tokens"] / m["step_time_s"])  # tokens of all replicas per second
    t.close()
    if conn is not None:
        conn.send(best)


def _run_ranks(model: str, world: int, tp: int, threads: int, reps: int) -> float:
    from earl.stages.trainer_dist import free_dist_url

    ctx = mp.get_context("spawn")
    url = free_dist_url() if world > 1 else None
    pipes, procs = [], []
    for r in range(world):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_train_child, args=(model, r, world, tp, threads, url, reps, b))
        p.start()
        pipes.append(a)
        procs.append(p)
    out = [a.recv() for a in pipes]
    for p in procs:
        p.join(60)
    return float(out[0])


def _spawned(target, *args) -> float:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(*args, b))
    p.start()
    v = a.recv()
    p.join(60)
    return float(v)


async def _reconfig(model: str, out: Path) -> dict[str, dict[str, float]]:
    from earl.runtime import Runtime
    from earl.runtime.layout import Layout
    from earl.stages.compute import Compute
    from earl.stages.reconfigure import reconfigure_rollout, reconfigure_trainer
    from earl.stages.rollout import RolloutActor
    from earl.stages.trainer import TrainerActor, TrainerConfig, free_dist_url
    from earl.stages.vllm_engine import EngineConfig

    env = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    async with Runtime() as rt:
        trainer, rollout = await asyncio.gather(
            rt.spawn("trainer", TrainerActor,
                     TrainerConfig(model=model, parallel="fsdp", dist_url=free_dist_url(),
                                   compute=Compute(threads=1)), n=2, env=env),
            rt.spawn("rollout", RolloutActor,
                     EngineConfig(model=model, compute=Compute(dtype="float32"),
                                  max_model_len=512, kv_cache_gb=0.25), n=1, env=env))
        batch = _batch(8).split(2)
        await asyncio.gather(*(trainer[r].train_step.call_one(batch[r]) for r in range(2)))
        trainer, tt = await reconfigure_trainer(rt, trainer, Layout(dp=1, tp=2),
                                                checkpoint_dir=out / "reshard", env=env,
                                                rollout=rollout)
        rollout, rt_ = await reconfigure_rollout(rt, rollout, tensor_parallel_size=2,
                                                 trainer=trainer, env=env)
        await trainer.close.call()
        await rollout.close.call()
    return {"trainer_dp2_to_tp2": tt.as_dict(), "rollout_tp1_to_tp2": rt_.as_dict()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object (default)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds, shorter generations")
    ap.add_argument("--parts", default="rollout,train,reconfig",
                    help="comma-separated subset of rollout, train, reconfig")
    _results.add_flag(ap)
    args = ap.parse_args(argv)
    begun = _results.start()
    parts = set(args.parts.split(","))
    if not parts <= {"rollout", "train", "reconfig"}:
        ap.error(f"--parts: unknown {sorted(parts - {'rollout', 'train', 'reconfig'})}")
    reps, gen = (2, 32) if args.quick else (4, 64)

    import torch

    from earl.models.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="earl-bench-parallel-"))
    model = str(build_tiny_model(tmp / "model", **MODEL))  # type: ignore[arg-type]
    n_params = sum(t.numel() for t in __import__("safetensors.torch", fromlist=["load_file"])
                   .load_file(f"{model}/model.safetensors").values())
    res: dict[str, object] = {"params": n_params, "cpus": len(os.sched_getaffinity(0)),
                              "torch": torch.__version__}
    t0 = time.perf_counter()
    if "rollout" in parts:
        _bench_rollout(res, model, gen, reps, t0)
    if "train" in parts:
        _bench_train(res, model, reps, t0)
    if "reconfig" in parts:
        rc = asyncio.run(_reconfig(model, tmp))
        res["reconfig_trainer_s"] = {k: round(v, 3) for k, v in rc["trainer_dp2_to_tp2"].items()}
        res["reconfig_rollout_s"] = {k: round(v, 3) for k, v in rc["rollout_tp1_to_tp2"].items()}
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(res))
    if args.save:
        _results.save("parallel", res, quick=args.quick, begun=begun)
    return 0


def _bench_rollout(res: dict[str, object], model: str, gen: int, reps: int, t0: float) -> None:
    ro = {f"tp1_threads{k}": round(_spawned(_rollout_child, model, 1, k, gen, reps), 1)
          for k in (1, 2)}
    ro["tp1"] = max(ro["tp1_threads1"], ro["tp1_threads2"])
    ro["tp2"] = round(_spawned(_rollout_child, model, 2, 1, gen, reps), 1)
    ro["tp2_vs_tp1"] = round(ro["tp2"] / ro["tp1"], 3)
    res["rollout_tok_s"] = ro
    _log(f"rollout {ro} ({time.perf_counter() - t0:.0f} s)")


def _bench_train(res: dict[str, object], model: str, reps: int, t0: float) -> None:
    tr = {f"tp1_threads{k}": round(_run_ranks(model, 1, 1, k, reps), 1) for k in (1, 2)}
    tr["tp1"] = max(tr["tp1_threads1"], tr["tp1_threads2"])
    tr["dp2"] = round(_run_ranks(model, 2, 1, 1, reps), 1)
    tr["tp2"] = round(_run_ranks(model, 2, 2, 1, reps), 1)
    tr["tp2_vs_tp1"] = round(tr["tp2"] / tr["tp1"], 3)
    res["train_tok_s"] = tr
    _log(f"train {tr} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    raise SystemExit(main())
