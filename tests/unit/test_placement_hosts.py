"""`placement.hosts` (which Ray node each stage goes to) and the ray launcher's GPU bundles:
parsed, checked with the field named, and refused where they cannot work."""

from __future__ import annotations

import pytest

from earl.config import PlacementConfig, RunConfig, from_dict, parse_overrides
from earl.runtime import RuntimeConfig


def _placement(*overrides: str) -> PlacementConfig:
    return from_dict(RunConfig, parse_overrides(list(overrides))).placement


def test_hosts_name_a_ray_resource_per_stage() -> None:
    pl = _placement("--placement.launcher=ray",
                    "--placement.hosts=rollout=earl_host_b, trainer=earl_host_a,reference=earl_host_a")
    assert pl.host_resources() == {"rollout": "earl_host_b", "trainer": "earl_host_a",
                                   "reference": "earl_host_a"}
    assert _placement("--placement.launcher=ray").host_resources() == {}


@pytest.mark.parametrize(("hosts", "words"), [
    ("rollouts=earl_host_b", ["'placement.hosts'", "'rollouts' is not a stage", "'rollout'"]),
    ("rollout", ["'placement.hosts'", "STAGE=RESOURCE"]),
    ("rollout=", ["'placement.hosts'", "STAGE=RESOURCE"]),
    ("trainer=a,trainer=b", ["'placement.hosts'", "named twice"]),
])
def test_bad_hosts_are_refused_with_the_fix(hosts: str, words: list[str]) -> None:
    with pytest.raises(ValueError) as e:
        _placement("--placement.launcher=ray", f"--placement.hosts={hosts}")
    for w in words:
        assert w in str(e.value)


def test_hosts_need_the_ray_launcher() -> None:
    with pytest.raises(ValueError, match="'placement.hosts'.*launcher=ray"):
        _placement("--placement.hosts=rollout=earl_host_b")
    with pytest.raises(ValueError, match="ray_resources.*launcher='ray'"):
        RuntimeConfig(ray_resources={"rollout": "earl_host_b"})
    with pytest.raises(ValueError, match="ray_gpus.*launcher='ray'"):
        RuntimeConfig(ray_gpus={"trainer": 1.0})


def test_cuda_under_ray_asks_each_rank_its_gpus() -> None:
    pl = _placement("--placement.launcher=ray", "--placement.device=cuda",
                    "--placement.rollout_tp=2")
    assert pl.ray_gpus() == {"rollout": 2.0, "trainer": 1.0, "reference": 1.0}
    assert _placement("--placement.launcher=ray").ray_gpus() == {}
