"""`earl train --dry-run`: print the resolved config and the device plan; start nothing.

    earl train --dry-run                                      # this machine, as configured
    earl train --placement.device=cuda --placement.rollout=2 --placement.rollout_tp=2 \
        --placement.trainer=4 --placement.trainer_tp=2 \
        --dry-run --gpus 8 --gpu-memory-gib 80 --json         # an 8-GPU node, from a laptop

`--gpus` and `--gpu-memory-gib` state the machine the run is meant for (default: this one's
GPUs); the config is validated against it as a run validates against the GPUs it sees. With
`--json` the one line printed is `{"dry_run": true, "config": {...}, "plan": {...}}`
(`earl.plan.Plan`). Not here: the plan itself (`earl.plan`).
"""

from __future__ import annotations

import json
import sys

__all__ = ["dry_run"]


def dry_run(config: str | None, overrides: list[str], *, as_json: bool, gpus: int | None,
            gpu_memory_gib: float | None) -> int:
    """Print the plan of the run `config` + `overrides` would start; returns the exit code
    (2 for a config or a machine that does not fit, with the error on stderr and, with
    `as_json`, as a JSON line)."""
    import yaml

    from earl.config import load_config, to_dict
    from earl.plan import machine, plan

    try:
        cfg = load_config(config, overrides, gpus=gpus)
        cuda = cfg.placement.device == "cuda"
        if not cuda and (gpus is not None or gpu_memory_gib is not None):
            raise ValueError("--gpus and --gpu-memory-gib describe the GPUs of a "
                             "placement.device=cuda run; add --placement.device=cuda, or drop "
                             "them")
        p = plan(cfg, machine(gpus, gpu_memory_gib) if cuda else None)
    except (ValueError, TypeError) as exc:
        line = f"earl train --dry-run: {exc}"
        print(line, file=sys.stderr, flush=True)
        if as_json:
            print(json.dumps({"error": line, "exit_code": 2}), flush=True)
        return 2
    if as_json:
        print(json.dumps({"dry_run": True, "config": to_dict(cfg), "plan": p.to_json()}),
              flush=True)
    else:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False).rstrip())
        print(p.describe())
        print("dry run: nothing started (--json prints every field)")
    return 0
