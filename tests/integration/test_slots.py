"""Device slots on CPU: real cgroup limits on real actor processes (runtime/slots.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from earl.placement import PlacementConfig
from earl.runtime import Actor, ActorDied, Runtime, endpoint
from earl.runtime.slots import Slot, SlotPool, bind_process


class Hog(Actor):
    """Allocates and touches memory on request; reports where it runs."""

    def __init__(self) -> None:
        self.held: list[bytes] = []

    @endpoint
    async def hog(self, mib: int) -> int:
        for _ in range(mib // 8):
            self.held.append(b"\x01" * (8 << 20))  # written, so every page is really charged
        return len(self.held) * 8

    @endpoint
    async def where(self) -> dict[str, object]:
        groups = Path("/proc/self/cgroup").read_text()
        return {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                "cgroups": groups, "omp": os.environ.get("OMP_NUM_THREADS", "")}


def _pool() -> SlotPool:
    pool = SlotPool()
    if pool.memory_enforcement != "cgroup" or pool.cpu_enforcement != "cpuset":
        pool.close()
        pytest.skip("cgroup v1 memory/cpuset not writable here (slots fall back to rlimit/affinity)")
    return pool


@pytest.mark.timeout(90)
async def test_memory_hog_is_oom_killed_in_its_slot_and_the_run_survives() -> None:
    with _pool() as pool:
        pool.create("hogslot", cores=(0,), memory_mib=200)
        async with Runtime() as rt:
            bystander = await rt.spawn("bystander", Hog)
            hog = await rt.spawn("hog", Hog, slot=pool.assign("hogslot", "hog"))
            assert await hog.hog.call_one(64) == 64  # well inside the budget
            with pytest.raises(ActorDied):  # the call in flight fails at once...
                await hog.hog.call_one(400)
            await rt.wait_status(hog, "dead", timeout=10)
            oom = r"hog\[0\] died: pid \d+ out of memory in slot hogslot \(limit 200 MiB\)"
            with pytest.raises(ActorDied, match=oom):  # ...and the death is reported as an OOM
                await hog.hog.call_one(1)
            assert await bystander.hog.call_one(256) == 256  # unlimited neighbour: fine
            await rt.stop(hog)
            # the slot moves to another actor; the new one starts with a clean budget
            pool.release("hogslot")
            other = await rt.spawn("other", Hog, slot=pool.assign("hogslot", "other"))
            assert await other.hog.call_one(64) == 64
            assert pool.budgets() == {"hogslot": 200 * 2**20}
            used = pool.memory_used_mib("hogslot")
            assert used is not None and 64 <= used <= 200
            with pytest.raises(ValueError, match="still runs pids"):
                pool.release("hogslot")
        mem_dir = pool["hogslot"].memory_cgroup
    assert not os.path.exists(mem_dir)  # cgroups removed at close


@pytest.mark.timeout(90)
async def test_a_joined_slot_spans_its_devices_for_one_rank() -> None:
    """A rank that needs two devices (a TP-2 vLLM replica) runs in one slot with both
    devices' cores, memory and CPU shares; the parts are its owner's and are not offered as
    devices meanwhile; the joined slot goes when its rank has stopped."""
    ncpu = len(os.sched_getaffinity(0))
    with _pool() as pool:
        pool.create("dev0", cores=(0,), memory_mib=200, cpu_share=0.5)
        pool.create("dev1", cores=(1 % ncpu,), memory_mib=300, cpu_share=0.5)
        pool.create("dev2", cores=(0,), memory_mib=200, cpu_share=0.5)
        both = pool.join(("dev0", "dev1"), "rollout")
        assert both.name == "dev0_dev1" and both.memory_mib == 500 and both.cpu_share == 1.0
        assert both.cores == tuple(sorted({0, 1 % ncpu}))
        quota = Path(both.cpu_cgroup, "cpu.cfs_quota_us").read_text()
        assert int(quota) == 100_000  # one core's worth: the two shares together
        assert both.env()["EARL_SLOT_CPU_SHARE"] == "1"  # vLLM's TP workers may share cores
        assert set(pool.budgets()) == {"dev0", "dev1", "dev2"}  # not a device of its own
        with pytest.raises(ValueError, match="assigned to 'rollout'"):
            pool.join(("dev1", "dev2"), "trainer")
        async with Runtime() as rt:
            g = await rt.spawn("hog", Hog, slot=both)
            assert await g.hog.call_one(352) == 352  # more than one part's budget
            assert pool.pids("dev0_dev1") and not pool.pids("dev0")
            with pytest.raises(ValueError, match="still runs pids"):
                pool.release("dev0_dev1")
            with pytest.raises(ValueError, match="part of joined"):
                pool.release("dev0")
            await rt.stop(g)
        mem_dir = both.memory_cgroup
        pool.release("dev0_dev1")
        assert not os.path.exists(mem_dir) and "dev0_dev1" not in pool.joined()
        pool.release("dev1")  # the part moves on: another owner may take it
        assert pool.join(("dev1",), "trainer").name == "dev1"


@pytest.mark.timeout(60)
async def test_actor_affinity_equals_its_slot_cores() -> None:
    with _pool() as pool:
        ncpu = os.cpu_count() or 1
        core = ncpu - 1
        slot = pool.create("pinned", cores=(core,), memory_mib=512)
        async with Runtime() as rt:
            g = await rt.spawn("pinned", Hog, slot=pool.assign("pinned", "pinned"))
            info = await g.where.call_one()
            assert info["cores"] == [core]
            assert slot.cpuset_cgroup.split("/sys/fs/cgroup/cpuset", 1)[1] in str(info["cgroups"])
            assert info["omp"] == "1"
            assert pool.pids("pinned") == [info["pid"]]


class Spinner(Actor):
    """Burns CPU on request (in two threads: more than a small share allows)."""

    @endpoint
    async def spin(self, seconds: float) -> None:
        import asyncio
        import time

        def burn() -> None:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass

        await asyncio.gather(asyncio.to_thread(burn), asyncio.to_thread(burn))


@pytest.mark.timeout(60)
async def test_a_cpu_share_throttles_the_actor_to_its_quota() -> None:
    """A slot of 0.2 cores: the kernel's CFS quota throttles an actor that tries to use more
    (cpu.stat's throttle counters), its threads see one OpenMP thread, and the cgroup goes
    with the pool."""
    with _pool() as pool:
        slot = pool.create("small", cpu_share=0.2, memory_mib=512)
        if not slot.cpu_cgroup:
            pytest.skip("cgroup v1 cpu controller not writable here")
        assert slot.limits_enforced and slot.env(parent={})["OMP_NUM_THREADS"] == "1"
        quota = Path(slot.cpu_cgroup, "cpu.cfs_quota_us").read_text().split()[0]
        assert int(quota) == 20_000  # of a 100 ms period
        async with Runtime() as rt:
            g = await rt.spawn("small", Spinner, slot=pool.assign("small", "small"))
            assert len(pool.pids("small")) == 1
            await g.spin.call_one(1.0)
            stat = dict(line.split() for line in
                        Path(slot.cpu_cgroup, "cpu.stat").read_text().splitlines())
            assert int(stat["nr_throttled"]) > 0 and int(stat["throttled_time"]) > 0
        cpu_dir = slot.cpu_cgroup
    assert not os.path.exists(cpu_dir)


_BURN = "import time\nend = time.perf_counter() + {s}\nwhile time.perf_counter() < end: pass"


def _burn_in(slot: Slot, seconds: float) -> float:
    """Wall seconds of a child process that spins one thread for `seconds` inside `slot`."""
    t0 = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _BURN.format(s=seconds)])
    bind_process(slot, child.pid)
    assert child.wait(timeout=30) == 0
    return time.perf_counter() - t0


@pytest.mark.timeout(60)
def test_a_slots_cpu_usage_counts_its_time_and_its_quotas_throttling() -> None:
    """A half-core slot's process gets about half of the wall time (the CFS quota caps it at
    0.5) and is throttled; a slot without a share counts CPU time and has no quota to report."""
    with _pool() as pool:
        half = pool.create("half", cores=(0,), cpu_share=0.5)
        whole = pool.create("whole", cores=(0,))
        if not half.cpu_cgroup or not half.cpuacct_cgroup or not whole.cpuacct_cgroup:
            pytest.skip("cgroup v1 cpu/cpuacct controllers not writable here")
        wall = _burn_in(half, 1.5)
        got = pool.cpu_usage("half")
        assert got is not None and 0.3 * wall <= got.cpu_s <= 0.8 * wall, (got, wall)
        assert got.nr_throttled is not None and got.nr_throttled > 0
        assert got.nr_periods is not None and got.nr_periods >= got.nr_throttled
        assert got.throttled_s is not None and got.throttled_s > 0
        _burn_in(whole, 0.3)
        free = pool.cpu_usage("whole")
        assert free is not None and free.cpu_s > 0
        assert (free.nr_periods, free.nr_throttled, free.throttled_s) == (None, None, None)
        acct_dir = half.cpuacct_cgroup
    assert not os.path.exists(acct_dir)  # the accounting group goes with the pool


def test_a_cpu_share_beyond_the_slots_cores_is_refused() -> None:
    with SlotPool(use_cgroups=False) as pool:
        with pytest.raises(ValueError, match="cpu_share 1.5 must be in"):
            pool.create("two", cores=(0,), cpu_share=1.5)
        slot = pool.create("half", cores=(0,), cpu_share=0.5)
        assert slot.cpu_share == 0.5 and not slot.limits_enforced  # no cgroup: advisory
        assert pool.cpu_usage("half") is None  # nothing counts its CPU time


@pytest.mark.timeout(60)
async def test_fallback_pins_with_affinity_and_says_limits_are_rlimit() -> None:
    with SlotPool(use_cgroups=False) as pool:
        slot = pool.create("fb", cores=(0,), memory_mib=4096)
        assert (slot.memory_enforcement, slot.cpu_enforcement) == ("rlimit", "affinity")
        async with Runtime() as rt:
            g = await rt.spawn("fb", Hog, slot=slot)
            assert (await g.where.call_one())["cores"] == [0]


def test_groups_left_by_a_dead_pool_are_swept() -> None:
    _pool().close()  # skips where cgroups are not writable
    own = Path("/proc/self/cgroup").read_text()
    mem = next(line.split(":", 2)[2] for line in own.splitlines()
               if "memory" in line.split(":")[1].split(","))
    stale = os.path.join("/sys/fs/cgroup/memory", mem.lstrip("/"), "earl-999999999")
    os.makedirs(stale, exist_ok=True)  # as if pool of pid 999999999 crashed
    SlotPool().close()
    assert not os.path.exists(stale)


class TinyTrainer(Actor):
    """A real forward+backward of a 4-layer Qwen2 (fp32, SDPA) inside whatever slot it is in."""

    def __init__(self) -> None:
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        cfg = Qwen2Config(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=384, vocab_size=320,
                          max_position_embeddings=4096, attn_implementation="sdpa")
        self.model = Qwen2ForCausalLM(cfg).float().train()
        self.params = sum(p.numel() for p in self.model.parameters())

    @endpoint
    async def step(self, context: int, seqs: int) -> int:
        import torch

        ids = torch.randint(0, 320, (seqs, context))
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.model.zero_grad(set_to_none=True)
        return ids.numel()

    @endpoint
    async def n_params(self) -> int:
        return self.params


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_the_policys_micro_batch_fits_a_real_slot_and_three_times_it_is_killed() -> None:
    from earl.runtime.selector import (
        ContextTracker,
        CostConfig,
        CostModel,
        ModelShape,
        PolicyConfig,
        SearchPolicy,
    )

    with _pool() as pool:
        pool.create("train0", cores=(0,), memory_mib=1024)
        async with Runtime() as rt:
            g = await rt.spawn("trainer", TinyTrainer, slot=pool.assign("train0", "trainer"))
            await g.step.call_one(64, 1)  # allocator and autograd warmed up
            idle = pool.memory_used_mib("train0")
            assert idle is not None
            shape = ModelShape(hidden=128, layers=4, heads=4, kv_heads=2, intermediate=384,
                               vocab=320, params=await g.n_params.call_one())
            cost = CostModel(shape, CostConfig(weight_bytes=0, grad_bytes=4, act_bytes=4,
                                               optimizer_bytes=0, logit_bytes=8,
                                               reserve_bytes=idle * 2**20))
            policy = SearchPolicy(cost, PolicyConfig(actors={"trainer": "train"}, colocated=True,
                                               tp_max=1, pp_max=1, headroom=0.2))
            d = policy.decide(step=0, when="prep", contexts=ContextTracker().observe([2048]),
                              slots=pool.budgets())
            mb = d.plan.actor("trainer").micro_batch_tokens
            seqs = mb // 2048
            assert seqs >= 2, d.reason  # the budget is not trivial
            assert await g.step.call_one(2048, seqs) == mb  # the plan's budget runs...
            peak = pool.memory_peak_mib("train0")
            assert peak is not None
            print(f"slot 1024 MiB: idle {idle:.0f} MiB, plan {seqs} x 2048 tokens, predicted "
                  f"{d.plan.actor('trainer').predicted_bytes / 2**20:.0f} MiB, peak {peak:.0f} MiB")
            assert peak <= 1024
            with pytest.raises(ActorDied):  # ...three times it does not
                await g.step.call_one(2048, 3 * seqs)
            await rt.wait_status(g, "dead", timeout=10)
            with pytest.raises(ActorDied, match="out of memory in slot train0"):
                await g.step.call_one(64, 1)


@pytest.mark.timeout(90)
async def test_a_rollout_slot_offers_less_as_its_process_grows_and_all_once_it_leaves() -> None:
    """`SlotMemory` follows a measured slot's peak: what its process grew to after the
    baseline is no longer offered to the cost model; a new owner gets the whole budget."""
    from earl.loop.selection_actors import SlotMemory

    with _pool() as pool:
        pool.create("rollout0", cores=(0,), memory_mib=512)
        pool.create("trainer0", cores=(0,), memory_mib=512)
        async with Runtime() as rt:
            g = await rt.spawn("rollout", Hog, slot=pool.assign("rollout0", "rollout"))
            memory = SlotMemory(pool, ("trainer0",))
            memory.measure(("rollout0",))
            before = memory()["rollout0"]
            await g.hog.call_one(96)
            grown = memory()["rollout0"]
            assert 90 <= (before - grown) / 2**20 <= 200, (before, grown)
            assert memory()["trainer0"] == 512 * 2**20
            await rt.stop(g)
            pool.release("rollout0")
            pool.assign("rollout0", "trainer")  # the slot changed hands: its baseline went too
            assert memory()["rollout0"] == 512 * 2**20


def test_a_gpu_slot_sets_device_visibility_and_leaves_host_memory_alone() -> None:
    with SlotPool(use_cgroups=False) as pool:
        s = pool.create("gpu0", gpus=(0,), memory_mib=80 * 1024, cores=(0,))
        assert s.memory_enforcement == "device" and not s.memory_cgroup
        assert s.env() == {"CUDA_VISIBLE_DEVICES": "0", "OMP_NUM_THREADS": "1"}
        assert s.limits_enforced


def test_run_slots_share_the_cores_equally_when_there_are_more_slots_than_cores() -> None:
    from earl.loop.devices import run_slots

    ncpu = len(os.sched_getaffinity(0))
    few = PlacementConfig(rollout=1, trainer=1, slot_memory_mib=256)
    many = PlacementConfig(rollout=ncpu + 1, trainer=ncpu, slot_memory_mib=256)
    with run_slots(few) as pool:
        shares = {pool[n].cpu_share for n in pool.budgets()}
        assert shares == ({None} if ncpu >= 2 else {0.5})
    with run_slots(many) as pool:
        names = list(pool.budgets())
        assert len(names) == 2 * ncpu + 1
        assert {pool[n].cpu_share for n in names} == {ncpu / (2 * ncpu + 1)}


def test_the_reference_runs_in_its_own_slot_which_the_selector_does_not_plan() -> None:
    from earl.loop.devices import run_slots
    from earl.loop.selection_actors import SlotMemory

    pl = PlacementConfig(rollout=1, trainer=1, slot_memory_mib=256)
    with run_slots(pl, reference=2) as pool:
        budgets = pool.budgets()
        assert list(budgets) == ["rollout0", "trainer0", "reference0", "reference1"]
        assert budgets["reference1"] == budgets["trainer0"] == 256 * 2**20
        kept = ("reference0", "reference1")
        assert set(SlotMemory(pool, ("trainer0",), kept)()) == {"rollout0", "trainer0"}


def test_placement_devices_are_equal_slots_the_ranks_take_in_order_and_the_rest_are_free(
) -> None:
    """`placement.devices` N: N slots "device<i>" of equal memory and CPU share (cores / N);
    rollout, then trainer ranks take the first, the reference the last; the others are free
    for the selector, which is offered every device but the reference's."""
    from earl.loop.devices import device_roles, run_slots
    from earl.loop.selection_actors import SlotMemory

    pl = PlacementConfig(rollout=1, trainer=1, devices=5, slot_memory_mib=256)
    roles = device_roles(pl, reference=1)
    assert roles == {"rollout": ("device0",), "trainer": ("device1",),
                     "reference": ("device4",), "free": ("device2", "device3")}
    ncpu = len(os.sched_getaffinity(0))
    with run_slots(pl, reference=1) as pool:
        budgets = pool.budgets()
        assert list(budgets) == [f"device{i}" for i in range(5)]
        assert set(budgets.values()) == {256 * 2**20}
        shares = {pool[n].cpu_share for n in budgets}
        assert shares == ({ncpu / 5} if ncpu < 5 else {None})
        offered = SlotMemory(pool, roles["trainer"], roles["reference"])()
        assert set(offered) == {"device0", "device1", "device2", "device3"}
    with pytest.raises(ValueError, match=r"placement\.devices.*at least 4"):
        device_roles(PlacementConfig(rollout=1, trainer=2, devices=3, slot_memory_mib=256),
                     reference=1)
    with pytest.raises(ValueError, match="devices"):
        PlacementConfig(devices=4)  # a CPU device is a slot: it needs a memory budget
    with pytest.raises(ValueError, match="rollout_slot_memory_mib"):
        PlacementConfig(devices=4, slot_memory_mib=256, rollout_slot_memory_mib=512)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(400)
def test_earl_train_runs_the_reference_in_its_slot(tmp_path: Path) -> None:
    """With slots and a KL term, the reference actor's process is in the memory cgroup of its
    slot "reference0" (as the trainer's and the replica's are in theirs)."""
    import json
    import subprocess
    import sys
    import time

    with SlotPool() as pool:
        if pool.memory_enforcement != "cgroup":
            pytest.skip("needs writable cgroup v1 memory (root)")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.Popen(
        [sys.executable, "-m", "earl.cli", "train", "--recipe", "tictactoe", "--steps=3",
         "--warm_start.steps=5", "--eval_games=4", "--eval_every=0", "--json",
         "--algorithm.kl_coef=0.05", "--placement.reference=1",
         "--placement.slot_memory_mib=1500", "--output-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    slots: set[str] = set()
    want = {"reference0", "trainer0", "rollout0"}
    while run.poll() is None and not want <= slots:
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                groups = (proc / "cgroup").read_text().splitlines()
            except OSError:
                continue
            slots.update(x.rsplit("/", 1)[1] for x in groups
                         if ":memory:" in x and f"earl-{run.pid}/" in x)
        time.sleep(0.5)
    out, err = run.communicate(timeout=380)
    assert run.returncode == 0, err[-3000:]
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 3
    assert want <= slots
