"""Where a run's actors go: `PlacementConfig`, the ``placement`` section of a `RunConfig`.

How many actors of each stage, on which device (CPU cores or GPUs), in which precision, whether
stages have devices of their own or share them in turn (``colocate``), and which transports
carry the data plane and the weights. The GPU plan itself is `earl.loop.devices`; this module
only describes and checks, and imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from earl.runtime.errors import need
from earl.stages.compute import DEVICES, DTYPES, Hardware, KvCache, Packing

__all__ = ["BACKENDS", "DEVICES", "DTYPES", "LAUNCHERS", "STAGE_GROUPS", "TRANSPORTS", "WEIGHT_TRANSPORTS",
           "PlacementConfig"]

TRANSPORTS = ("", "shm", "ucx", "zmq")  # placement.transport ("": by locality)
LAUNCHERS = ("local", "ray")
STAGE_GROUPS = ("rollout", "trainer", "reference", "producer", "dock")  # actor groups of a run
# placement.weights_transport: "" picks per replica (see PlacementConfig)
WEIGHT_TRANSPORTS = ("", "shm", "ucx", "zmq", "gloo", "nccl", "ipc")
BACKENDS = ("torch", "megatron")  # placement.backend: the trainer's engine


@dataclass(kw_only=True, slots=True)
class PlacementConfig(Hardware, Packing, KvCache):
    """Where actors run and how many of each; the recipe never depends on it. Its `device`,
    `dtype` and `threads` are `earl.stages.compute.Hardware`'s: every stage's `Compute` is them
    (and the run's seed). Its `micro_batch_tokens` and `shared_prefix` are the trainer's
    (`earl.stages.compute.Packing`), its `kv_cache_gb` each rollout replica's (`KvCache`).

    `rollout`: vLLM rollout replicas; `reference`: reference actors (started only when
    `algorithm.kl_coef` > 0); `producers`: producer actors running agent coroutines
    (each a warehouse shard of the dock, and a rank of its index: a group's id picks the rank
    that owns it); `launcher`: "local" processes or "ray".
    `slot_memory_mib`: each rollout replica, trainer rank and reference actor runs in its own
    device slot with this memory budget (a cgroup: the kernel's OOM killer enforces it; 0 = no
    slots); `rollout_slot_memory_mib` overrides it for the rollout replicas (0 = the same).
    `devices`: the run's devices (0 = one per actor rank). On CPU (with `slot_memory_mib`) N
    slots of `slot_memory_mib` each and an equal share of this process's cores, so N devices
    over 2 cores bind like N small accelerators; the ranks take them as
    `earl.loop.devices.device_roles` says, and with `--selector on` the devices no rank holds
    at the start are the selector's to hand out (it moves devices between the rollout and the
    trainer as it re-plans). On CUDA a device is a GPU: the run uses the first N visible ones.
    `context_window`: the rollout's max_model_len at the start (0 = model.max_model_len; longer
    trajectories are truncated). With the selector on it re-sets it, `micro_batch_tokens` and
    `kv_cache_gb` as contexts grow.

    `device`: "cuda" places every stage on GPUs: each rollout replica, trainer rank and
    reference actor gets its own GPU(s) in a device slot (`earl.loop.devices.plan_gpus`);
    `rollout_slot_memory_mib` is then vLLM's budget on each of its GPUs (0 = vLLM's default
    share). `rollout_tp`: GPUs (or CPU workers) per rollout replica (vLLM tensor parallel);
    `trainer_tp`: the trainer's tensor-parallel degree, `trainer_pp` its pipeline stages
    (backend=megatron), its `trainer` ranks forming trainer / (trainer_tp x trainer_pp)
    data-parallel replicas.

    `hosts` (launcher=ray): where each stage goes, as "rollout=earl_host_b,trainer=earl_host_a"
    — per actor group (`STAGE_GROUPS`), a Ray custom resource that the nodes meant for it were
    started with (`ray start --resources='{"earl_host_b": 100}'`); groups not named go where
    Ray puts them. Under Ray with device=cuda each rank's bundle asks for its GPUs (rollout:
    rollout_tp; trainer and reference: 1) and Ray picks them (no device slots).
    `transport`: "" picks each data-plane pair's transport by locality (shm on one host; ucx,
    else zmq, across hosts: `earl.runtime.transport.choose`); "shm", "ucx" or "zmq" forces one
    for every pair (the network ones need the run's secret: a TCP or Ray run has one).

    `colocate`: rollout, trainer and reference share the same devices in turn (verl's and
    slime's default) instead of each having its own, alternating a rollout and a training phase
    (`earl.loop.colocation`); on GPUs the replicas and reference actors take the trainer ranks'
    GPUs (rollout x rollout_tp and reference at most trainer), and `rollout_slot_memory_mib` is
    vLLM's share while awake (0: half of each GPU).
    `weights_transport`: how trainer -> rollout weights travel: "" picks per replica (CPU:
    shm on the same host, else ucx or zmq; CUDA: "ipc", CUDA IPC handles, to a replica on the
    trainer's own GPU, else "nccl"); "shm", "ucx", "zmq", "gloo" (a torch.distributed gloo
    pair per replica), "nccl" (the same over NCCL, GPU to GPU) or "ipc" force one.
    `backend`: the trainer's engine: "torch" (HF model; DDP, FSDP2, DTensor TP) or "megatron"
    (megatron-core GPTModel converted from the HF checkpoint and back for the rollout; DDP
    and megatron's tensor parallel over `trainer_tp` and pipeline stages over `trainer_pp`;
    needs the `megatron` extra).
    """

    rollout: int = 1
    producers: int = 1
    reference: int = 1
    trainer: int = 1
    launcher: str = "local"
    slot_memory_mib: int = 0
    devices: int = 0
    rollout_slot_memory_mib: int = 0
    context_window: int = 0
    rollout_tp: int = 1
    trainer_tp: int = 1
    trainer_pp: int = 1
    hosts: str = ""
    transport: str = ""
    colocate: bool = False
    weights_transport: str = ""
    backend: str = "torch"

    def __post_init__(self) -> None:
        Hardware.__post_init__(self)
        need(self.rollout_tp >= 1, "rollout_tp", "must be >= 1 (GPUs per rollout replica)")
        need(self.trainer_tp >= 1, "trainer_tp", "must be >= 1 (1 = no tensor parallel)")
        need(self.trainer % self.trainer_tp == 0, "trainer_tp",
             f"{self.trainer_tp} does not divide placement.trainer={self.trainer} ranks; set "
             f"trainer to a multiple of it (data-parallel replicas x trainer_tp)")
        need(self.trainer_pp >= 1, "trainer_pp", "must be >= 1 (1 = no pipeline stages)")
        need(self.trainer_pp == 1 or self.backend == "megatron", "trainer_pp",
             "pipeline stages are megatron's: set placement.backend=megatron, or trainer_pp=1")
        need(self.trainer % (self.trainer_tp * self.trainer_pp) == 0, "trainer_pp",
             f"trainer_tp {self.trainer_tp} x trainer_pp {self.trainer_pp} does not divide "
             f"placement.trainer={self.trainer} ranks; set trainer to a multiple of it "
             "(data-parallel replicas x trainer_tp x trainer_pp)")
        need(self.device != "cuda" or self.slot_memory_mib == 0, "slot_memory_mib",
             "host-memory slots are for CPU runs; with placement.device=cuda each rank's slot "
             "is its GPU(s): leave it 0 (rollout_slot_memory_mib sets vLLM's GPU budget)")
        need(self.rollout >= 1, "rollout", "needs at least 1 rollout actor")
        need(self.trainer >= 1, "trainer", "needs at least 1 trainer rank")
        need(self.reference >= 0, "reference", "must be >= 0")
        need(self.producers >= 1, "producers", "needs at least 1 producer actor")
        need(self.launcher in LAUNCHERS, "launcher",
             f"{self.launcher!r} unknown; choose one of {LAUNCHERS}")
        need(self.slot_memory_mib == 0 or self.slot_memory_mib >= 64, "slot_memory_mib",
             "must be 0 (no slots) or at least 64 MiB")
        need(self.rollout_slot_memory_mib == 0 or self.rollout_slot_memory_mib >= 64,
             "rollout_slot_memory_mib", "must be 0 (= slot_memory_mib) or >= 64 MiB")
        need(self.devices >= 0, "devices", "must be >= 0 (0 = one device per actor rank)")
        need(self.devices == 0 or self.device == "cuda" or self.slot_memory_mib > 0, "devices",
             "CPU devices are slots with a memory budget: set placement.slot_memory_mib too "
             "(e.g. 1500), or devices=0")
        need(self.devices == 0 or self.rollout_slot_memory_mib == 0, "rollout_slot_memory_mib",
             "with placement.devices every device has slot_memory_mib (devices move between "
             "stages): leave rollout_slot_memory_mib 0")
        ranks = self.rollout * self.devices_per_replica() + self.trainer
        need(self.devices == 0 or self.devices >= ranks, "devices",
             f"{self.devices} devices cannot hold rollout {self.rollout} replica(s) of "
             f"{self.devices_per_replica()} device(s) + trainer {self.trainer} ranks: raise "
             f"placement.devices to at least {ranks}, or lower those")
        need(self.slot_memory_mib == 0 or self.launcher == "local", "slot_memory_mib",
             "slots are cgroups on this host: use placement.launcher=local or slot_memory_mib=0")
        need(self.micro_batch_tokens >= 64, "micro_batch_tokens", "must be >= 64 tokens")
        need(self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0 (GiB, fractions allowed)")
        need(self.context_window == 0 or self.context_window >= 64, "context_window",
             "must be 0 (= model.max_model_len) or >= 64 tokens")
        need(not self.hosts or self.launcher == "ray", "hosts",
             "places stages on Ray nodes: use placement.launcher=ray, or leave hosts empty")
        self.host_resources()  # checks its form
        need(self.transport in TRANSPORTS, "transport",
             f"{self.transport!r} is not a data-plane transport; use one of {TRANSPORTS[1:]}, "
             "or leave it empty to pick by locality")
        need(self.weights_transport in WEIGHT_TRANSPORTS, "weights_transport",
             f"{self.weights_transport!r} unknown; use one of {WEIGHT_TRANSPORTS[1:]}, or leave "
             "it empty to pick per replica")
        need(self.weights_transport not in ("nccl", "ipc") or self.device == "cuda",
             "weights_transport", f"{self.weights_transport!r} moves CUDA tensors: use it with "
             "placement.device=cuda, or gloo/shm/ucx/zmq on CPU")
        need(self.weights_transport != "ipc" or self.colocate, "weights_transport",
             "'ipc' hands GPU memory to a process on the same GPU: set placement.colocate=true, "
             "or use nccl between GPUs")
        need(self.backend in BACKENDS, "backend",
             f"{self.backend!r} unknown; choose one of {BACKENDS}")
        need(not (self.colocate and self.device == "cuda" and self.launcher == "ray"),
             "colocate", "colocated GPU slots are made on this host: use "
             "placement.launcher=local, or colocate=false under Ray")
        if self.colocate and self.device == "cuda":
            need(self.rollout * self.rollout_tp <= self.trainer, "colocate",
                 f"the rollout's rollout {self.rollout} x rollout_tp {self.rollout_tp} GPUs "
                 f"must fit on the trainer's {self.trainer}: raise placement.trainer or lower "
                 "placement.rollout / rollout_tp")
            need(self.trainer_tp == self.trainer_pp == 1, "colocate",
                 "colocated ranks move their weights to host memory between phases, which "
                 "is built for one rank or DDP: set placement.trainer_tp=1 and trainer_pp=1")
            need(self.reference <= self.trainer, "colocate",
                 f"placement.reference={self.reference} actors need one trainer GPU each: "
                 f"lower it to at most placement.trainer={self.trainer}")

    def devices_per_replica(self) -> int:
        """Devices one rollout replica takes: its `rollout_tp` GPUs, or CPU devices (joined
        into one slot for the replica and its TP workers); without `devices`, on CPU, one
        slot (its TP workers share its cores)."""
        return self.rollout_tp if self.device == "cuda" or self.devices else 1

    def host_resources(self) -> dict[str, str]:
        """`hosts` as actor group -> Ray custom resource (empty: Ray places every group)."""
        out: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in self.hosts.split(","))):
            group, eq, resource = (x.strip() for x in item.partition("="))
            need(bool(eq and resource), "hosts",
                 f"{item!r} is not STAGE=RESOURCE; write e.g. 'rollout=earl_host_b'")
            need(group in STAGE_GROUPS, "hosts",
                 f"{group!r} is not a stage; name one of {STAGE_GROUPS}")
            need(group not in out, "hosts", f"{group!r} is named twice; name it once")
            out[group] = resource
        return out

    def ray_gpus(self) -> dict[str, float]:
        """GPUs per rank of each group's Ray bundles (none on CPU)."""
        if self.device != "cuda":
            return {}
        return {"rollout": float(self.rollout_tp), "trainer": 1.0, "reference": 1.0}
