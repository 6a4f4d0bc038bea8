"""Colocated stages without processes or GPUs: the `placement.colocate` and
`placement.weights_transport` checks, the shared-GPU plan and its slots
(`earl.loop.devices`), and `earl.loop.colocation.Colocation` taking turns over fake actor
groups whose endpoint calls record their order."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from earl.config import RunConfig, from_dict, parse_overrides
from earl.loop import devices
from earl.loop.colocation import Colocation
from earl.loop.devices import COLOCATED_SHARE, gpu_slots, plan_gpus
from earl.observe import Tracer
from earl.placement import PlacementConfig
from earl.runtime.errors import FieldError

pytestmark = pytest.mark.timeout(30)

H100_MIB = 81559

# ------------------------------------------------------------------ config checks


@pytest.mark.parametrize(("kwargs", "field", "words"), [
    ({"weights_transport": "ipc"}, "weights_transport", "placement.device=cuda"),
    ({"weights_transport": "ipc", "colocate": True}, "weights_transport",
     "placement.device=cuda"),
    ({"weights_transport": "nccl"}, "weights_transport", "placement.device=cuda"),
    ({"weights_transport": "ipc", "device": "cuda"}, "weights_transport",
     "placement.colocate=true"),
    ({"weights_transport": "tcp"}, "weights_transport", "unknown"),
    ({"device": "cuda", "colocate": True, "trainer": 1, "rollout": 2}, "colocate",
     "raise placement.trainer"),
    ({"device": "cuda", "colocate": True, "trainer": 2, "rollout_tp": 4}, "colocate",
     "rollout_tp"),
    ({"device": "cuda", "colocate": True, "trainer": 2, "trainer_tp": 2}, "colocate",
     "trainer_tp=1"),
    ({"device": "cuda", "colocate": True, "trainer": 1, "reference": 2}, "colocate",
     "placement.reference=2"),
    ({"device": "cuda", "colocate": True, "launcher": "ray"}, "colocate", "launcher=local"),
])
def test_placement_refuses_weight_transports_and_colocated_layouts_that_cannot_work(
        kwargs: dict[str, Any], field: str, words: str) -> None:
    with pytest.raises(FieldError) as e:
        PlacementConfig(**kwargs)
    assert e.value.field == field
    assert words in e.value.message


@pytest.mark.parametrize("kwargs", [
    {"colocate": True},  # CPU: the phases alternate on the same cores
    {"colocate": True, "rollout": 4, "trainer": 1, "trainer_tp": 1},  # no GPU plan on CPU
    {"colocate": True, "launcher": "ray"},
    {"device": "cuda", "colocate": True, "rollout": 2, "rollout_tp": 2, "trainer": 4,
     "reference": 4},
    {"device": "cuda", "colocate": True, "weights_transport": "ipc"},
    {"device": "cuda", "weights_transport": "nccl"},
    {"device": "cuda", "trainer": 2, "trainer_tp": 2},  # tp is fine without colocate
    {"weights_transport": "gloo"}, {"weights_transport": "shm"}, {"weights_transport": ""},
])
def test_placement_accepts_layouts_that_fit(kwargs: dict[str, Any]) -> None:
    pl = PlacementConfig(**kwargs)
    assert all(getattr(pl, k) == v for k, v in kwargs.items())


def test_run_config_refuses_the_selector_with_colocation_naming_the_field() -> None:
    with pytest.raises(ValueError, match=r"config field 'placement\.colocate'.*--selector off"):
        from_dict(RunConfig, parse_overrides(["--placement.colocate=true", "--selector", "on"]))
    cfg = from_dict(RunConfig, parse_overrides(["--placement.colocate=true", "--selector", "off"]))
    assert cfg.placement.colocate and not cfg.selector.on
    with pytest.raises(ValueError, match=r"'placement\.weights_transport'.*unknown"):
        from_dict(RunConfig, parse_overrides(["--placement.weights_transport=tcp"]))


# ------------------------------------------------------------------ shared GPUs


@pytest.mark.parametrize(("placement", "reference", "gpus", "rollout", "trainer", "ref"), [
    ({"rollout": 1, "trainer": 1}, 0, 1, ((0,),), ((0,),), ()),
    ({"rollout": 1, "trainer": 1}, 1, 1, ((0,),), ((0,),), ((0,),)),
    ({"rollout": 2, "rollout_tp": 2, "trainer": 4}, 0, 4,
     ((0, 1), (2, 3)), ((0,), (1,), (2,), (3,)), ()),
    ({"rollout": 1, "rollout_tp": 2, "trainer": 4, "reference": 2}, 2, 8,
     ((0, 1),), ((0,), (1,), (2,), (3,)), ((0,), (1,))),
    ({"rollout": 3, "trainer": 4}, 1, 4, ((0,), (1,), (2,)), ((0,), (1,), (2,), (3,)),
     ((0,),)),
])
def test_colocated_stages_share_the_trainer_ranks_gpus(
        placement: dict[str, int], reference: int, gpus: int, rollout: Any, trainer: Any,
        ref: Any) -> None:
    pl = PlacementConfig(device="cuda", colocate=True, **placement)  # type: ignore[arg-type]
    plan = plan_gpus(pl, reference=reference, gpus=gpus)
    assert (plan.rollout, plan.trainer, plan.reference) == (rollout, trainer, ref)
    used = {g for ranks in plan.stages().values() for own in ranks for g in own}
    assert used == set(range(pl.trainer))  # nothing beyond the trainer's GPUs


def test_colocated_plan_refuses_more_trainer_ranks_than_gpus() -> None:
    pl = PlacementConfig(device="cuda", colocate=True, rollout=2, trainer=4)
    with pytest.raises(ValueError, match=r"'placement\.trainer': 4 colocated ranks need 4 "
                                         r"GPUs, but 3 are visible"):
        plan_gpus(pl, reference=0, gpus=3)
    # the same ranks with GPUs of their own would need 6: colocated, 4 are enough
    assert plan_gpus(pl, reference=1, gpus=4).used == 2 + 4 + 1
    with pytest.raises(ValueError, match="= 7 GPUs, but 4 are visible"):
        plan_gpus(PlacementConfig(device="cuda", rollout=2, trainer=4), reference=1, gpus=4)


def test_colocated_slots_share_gpus_and_give_vllm_half_of_each(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "gpu_memory_mib", lambda: H100_MIB)
    pl = PlacementConfig(device="cuda", colocate=True, rollout=2, rollout_tp=2, trainer=4)
    pool = gpu_slots(pl, reference=2, gpus=4)
    try:
        visible = {n: s.env(parent={})["CUDA_VISIBLE_DEVICES"] for n, s in
                   ((n, pool[n]) for n in ("rollout0", "rollout1", "trainer0", "trainer1",
                                           "trainer2", "trainer3", "reference0", "reference1"))}
        assert visible == {"rollout0": "0,1", "rollout1": "2,3", "trainer0": "0",
                           "trainer1": "1", "trainer2": "2", "trainer3": "3",
                           "reference0": "0", "reference1": "1"}
        half = int(H100_MIB * COLOCATED_SHARE)
        assert half == 40779
        assert [pool[f"rollout{r}"].memory_mib for r in range(2)] == [half, half]
        assert pool["rollout0"].memory_enforcement == "device"
        assert pool["trainer0"].memory_mib is None and pool["reference0"].memory_mib is None
        assert pool.statistics().slots == 8
    finally:
        pool.close()


def test_rollout_slot_memory_overrides_the_colocated_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_cuda() -> int:
        raise AssertionError("gpu_memory_mib read although the budget is set")

    monkeypatch.setattr(devices, "gpu_memory_mib", no_cuda)
    pl = PlacementConfig(device="cuda", colocate=True, rollout=1, trainer=2,
                         rollout_slot_memory_mib=30_000)
    pool = gpu_slots(pl, reference=0, gpus=2)
    try:
        assert pool["rollout0"].memory_mib == 30_000
        assert pool["rollout0"].env(parent={})["CUDA_VISIBLE_DEVICES"] == "0"
        assert pool["trainer0"].env(parent={})["CUDA_VISIBLE_DEVICES"] == "0"
        assert pool["trainer1"].env(parent={})["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        pool.close()
    # without colocate vLLM keeps its default share: the GPU's size is not needed either
    pool = gpu_slots(PlacementConfig(device="cuda"), reference=0, gpus=2)
    try:
        assert pool["rollout0"].memory_mib is None
        assert pool["rollout0"].env(parent={})["CUDA_VISIBLE_DEVICES"] == "0"
        assert pool["trainer0"].env(parent={})["CUDA_VISIBLE_DEVICES"] == "1"
    finally:
        pool.close()


# ------------------------------------------------------------------ taking turns


class FakeEndpoint:
    """One endpoint of a fake actor group: `call()` logs "<group>.<name>", waits, returns."""

    def __init__(self, log: list[str], name: str, result: list[Any], delay: float) -> None:
        self.log, self.name, self.result, self.delay = log, name, result, delay
        self.fail: BaseException | None = None  # raised (once) after the wait

    async def call(self) -> list[Any]:
        self.log.append(self.name)
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            err, self.fail = self.fail, None
            raise err
        return self.result


def fake_actors(log: list[str], delay: float = 0.0) -> SimpleNamespace:
    """Two trainer ranks (100 + 50 bytes moved) and two rollout replicas (one released)."""
    moved = [{"total": 100.0, "params": 60.0}, {"total": 50.0, "params": 30.0}]
    trainer = SimpleNamespace(offload=FakeEndpoint(log, "trainer.offload", moved, delay),
                              onload=FakeEndpoint(log, "trainer.onload", moved, delay))
    rollout = SimpleNamespace(sleep=FakeEndpoint(log, "rollout.sleep", [True, False], delay),
                              wake=FakeEndpoint(log, "rollout.wake", [True, False], delay))
    return SimpleNamespace(trainer=trainer, rollout=rollout)


def colocation(log: list[str], delay: float = 0.0, tracer: Tracer | None = None) -> Colocation:
    return Colocation(fake_actors(log, delay), tracer)  # type: ignore[arg-type]


async def test_the_first_rollout_offloads_the_trainer_without_waking_vllm() -> None:
    log: list[str] = []
    c = colocation(log, delay=0.05)
    assert (c.phase, c.switches, c.last) == ("", 0, {})
    async with c.rollout(0):
        assert log == ["trainer.offload"]
        assert (c.phase, c.switches) == ("rollout", 1)
    assert log == ["trainer.offload"]  # leaving a phase moves nothing
    assert c.last["trainer_bytes"] == 150.0 and c.last["rollout_released"] == 0.0
    assert 0.04 <= c.last["seconds"] < 5


async def test_phases_alternate_in_the_order_that_frees_memory_first() -> None:
    log: list[str] = []
    tracer = Tracer(enabled=True)
    c = colocation(log, tracer=tracer)
    async with c.rollout(0):
        pass
    async with c.train(0, None):  # type: ignore[arg-type]
        assert log[1:] == ["rollout.sleep", "trainer.onload"]
        assert c.phase == "train"
    assert c.last["rollout_released"] == 1.0 and c.last["trainer_bytes"] == 150.0
    async with c.rollout(1):
        assert log[3:] == ["trainer.offload", "rollout.wake"]
    assert c.switches == 3 and c.last["rollout_released"] == 1.0
    assert [e["name"] for e in tracer.events] == ["colocate_rollout", "colocate_train",
                                                  "colocate_rollout"]


async def test_reentering_the_same_phase_does_not_switch_again() -> None:
    log: list[str] = []
    c = colocation(log)
    for b in range(3):
        async with c.rollout(b):
            pass
    async with c.using():  # an evaluation uses the rollout's devices: already there
        pass
    assert (log, c.switches) == (["trainer.offload"], 1)
    for _ in range(2):
        async with c.train(2, None):  # type: ignore[arg-type]
            pass
    assert c.switches == 2
    async with c.using():  # after training an evaluation brings vLLM back
        assert c.phase == "rollout"
    assert c.switches == 3
    assert log == ["trainer.offload", "rollout.sleep", "trainer.onload", "trainer.offload",
                   "rollout.wake"]


async def test_concurrent_rollouts_share_one_switch_and_play_at_once() -> None:
    log: list[str] = []
    c = colocation(log, delay=0.05)  # the second arrives while the first is switching

    async def play(b: int) -> None:
        async with c.rollout(b):
            log.append(f"enter{b}")
            await asyncio.sleep(0.1)
            log.append(f"exit{b}")

    await asyncio.gather(play(0), play(1))
    assert log.count("trainer.offload") == 1 and c.switches == 1
    assert log[0] == "trainer.offload"
    assert set(log[1:3]) == {"enter0", "enter1"}  # both play before either ends
    assert set(log[3:]) == {"exit0", "exit1"}


async def test_training_waits_until_every_playing_batch_exits() -> None:
    log: list[str] = []
    c = colocation(log, delay=0.01)

    async def play(b: int, seconds: float) -> None:
        async with c.rollout(b):
            log.append(f"enter{b}")
            await asyncio.sleep(seconds)
            log.append(f"exit{b}")

    async def train() -> None:
        await asyncio.sleep(0.05)  # requested while both batches play
        log.append("train requested")
        async with c.train(0, None):  # type: ignore[arg-type]
            log.append("train")

    await asyncio.gather(play(0, 0.1), play(1, 0.3), train())
    assert log.index("train requested") < log.index("exit0")
    assert log.index("rollout.sleep") > max(log.index("exit0"), log.index("exit1"))
    assert log[-3:] == ["rollout.sleep", "trainer.onload", "train"]


async def test_a_batch_waits_while_training_runs() -> None:
    log: list[str] = []
    c = colocation(log, delay=0.01)

    async def train() -> None:
        async with c.train(0, None):  # type: ignore[arg-type]
            log.append("train")
            await asyncio.sleep(0.2)
            log.append("trained")

    async def play() -> None:
        await asyncio.sleep(0.05)  # requested while training runs
        log.append("play requested")
        async with c.rollout(1):
            log.append("play")

    await asyncio.gather(train(), play())
    assert log == ["rollout.sleep", "trainer.onload", "train", "play requested", "trained",
                   "trainer.offload", "rollout.wake", "play"]


async def test_a_failed_switch_raises_and_leaves_the_devices_free_for_the_next_phase() -> None:
    log: list[str] = []
    actors = fake_actors(log, delay=0.01)
    c = Colocation(actors)  # type: ignore[arg-type]
    actors.trainer.offload.fail = RuntimeError("offload failed")
    with pytest.raises(RuntimeError, match="offload failed"):
        async with c.rollout(0):
            pytest.fail("the phase began although its switch failed")
    assert (c.phase, c.switches) == ("", 0)
    # nothing holds a phase: training can begin at once, then rollouts again
    async with asyncio.timeout(5):
        async with c.train(0, None):  # type: ignore[arg-type]
            pass
        actors.rollout.wake.fail = RuntimeError("wake failed")
        with pytest.raises(RuntimeError, match="wake failed"):
            async with c.rollout(1):
                pass
        assert c.phase == "train"
        async with c.rollout(1):
            assert c.phase == "rollout"
        async with c.train(1, None):  # type: ignore[arg-type]
            pass
    assert c.switches == 3  # the failed switch is not counted


async def test_a_failed_switch_lets_a_waiting_batch_switch_in_its_place() -> None:
    log: list[str] = []
    actors = fake_actors(log, delay=0.05)
    c = Colocation(actors)  # type: ignore[arg-type]
    actors.trainer.offload.fail = RuntimeError("offload failed")

    async def play(b: int) -> str:
        async with c.rollout(b):
            return "played"

    async with asyncio.timeout(5):
        out = await asyncio.gather(play(0), play(1), return_exceptions=True)
    assert sorted(map(str, out)) == ["offload failed", "played"]
    assert log == ["trainer.offload", "trainer.offload"] and c.switches == 1
    async with asyncio.timeout(5), c.train(0, None):  # type: ignore[arg-type]
        assert c.phase == "train"


async def test_an_error_inside_a_phase_releases_it() -> None:
    log: list[str] = []
    c = colocation(log)
    with pytest.raises(ValueError, match="agent failed"):
        async with c.rollout(0):
            raise ValueError("agent failed")
    async with asyncio.timeout(5), c.train(0, None):  # type: ignore[arg-type]
        assert c.phase == "train"
    with pytest.raises(TimeoutError):  # a cancelled batch (a deadline) leaves its phase too
        async with asyncio.timeout(0.05), c.rollout(1):
            await asyncio.sleep(60)
    async with asyncio.timeout(5), c.train(1, None):  # type: ignore[arg-type]
        assert c.phase == "train"


def test_a_spooled_trace_holds_no_event_in_memory(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A long traced run's driver holds none of its trace: each event goes to the spool file
    as it comes, and the trace is assembled from it (valid Chrome JSON, names, order)."""
    import json

    tracer = Tracer(enabled=True, spool=tmp_path / ".trace.jsonl")
    for i in range(1000):
        with tracer.span("step", actor="trainer", step=i):
            pass
    tracer.add("restart", actor="producer", start=0.0, end=0.0, rank=0)
    assert tracer.events == [] and len((tmp_path / ".trace.jsonl").read_text().splitlines()) == 1001
    trace = json.loads(tracer.write(tmp_path / "trace.json").read_text())["traceEvents"]
    assert [e["args"]["name"] for e in trace if e["ph"] == "M"] == ["trainer", "producer"]
    spans = [e for e in trace if e["ph"] == "X"]
    assert [e["args"].get("step") for e in spans[:3]] == [0, 1, 2] and len(spans) == 1001
    empty = Tracer(enabled=True, spool=tmp_path / "empty.jsonl")
    assert json.loads(empty.write(tmp_path / "e.json").read_text())["traceEvents"] == []
