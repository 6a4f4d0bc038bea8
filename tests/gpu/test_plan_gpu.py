"""The device plan on a GPU machine (issue 52): `earl train --dry-run` reads this GPU's memory
for the plan of an 8-GPU node, and validates a plan for this machine against the GPUs it sees,
as a run does. Starts nothing; needs no vLLM."""

from __future__ import annotations

import pytest
import torch

from earl.config import load_config
from earl.plan import machine, plan

pytestmark = pytest.mark.gpu

LAYOUT_8 = ["--placement.device=cuda", "--placement.rollout=2", "--placement.rollout_tp=2",
            "--placement.trainer=4", "--placement.trainer_tp=2", "--algorithm.kl_coef=0"]


def test_an_8_gpu_plan_takes_this_gpus_memory() -> None:
    m = machine(gpus=8)  # the memory not stated: this GPU's
    total = torch.cuda.get_device_properties(0).total_memory >> 20
    assert (m.gpus, m.gpu_memory_mib) == (8, total)
    p = plan(load_config(None, [*LAYOUT_8, "--placement.rollout_slot_memory_mib=16384"],
                         gpus=8), m)
    assert p.rollout.devices == [[0, 1], [2, 3]]
    assert p.trainer.devices == [[4], [5], [6], [7]] and p.gpus_used == 8
    args = p.rollout.engine_args[0]
    assert (args["enforce_eager"], args["enable_chunked_prefill"], args["async_scheduling"],
            args["dtype"]) == (False, True, True, "bfloat16")
    assert args["gpu_memory_utilization"] == round(16384 / total, 4)


def test_a_colocated_plan_for_this_machine_is_validated_against_its_gpus() -> None:
    cfg = load_config(None, ["--placement.device=cuda", "--placement.colocate=true",
                             "--algorithm.kl_coef=0"])  # validated against the visible GPUs
    p = plan(cfg, machine())
    assert p.rollout.devices == [[0]] and p.trainer.devices == [[0]]
    assert p.rollout.memory_mib_per_gpu == \
        int((torch.cuda.get_device_properties(0).total_memory >> 20) * 0.5)
    assert p.rollout.engine_args[0]["enable_sleep_mode"] is True
