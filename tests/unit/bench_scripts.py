"""Import a script of the repository's bench/ folder as a module, for unit tests of the models
that live there (bench/ holds scripts run as `python bench/NAME.py`, not an import package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load(name: str) -> ModuleType:
    """`bench/<name>.py`, imported once as the module `bench_<name>`."""
    key = f"bench_{name}"
    if str(BENCH) not in sys.path:  # as when run as a script: its helpers (`_results`) import
        sys.path.insert(0, str(BENCH))
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[key] = module  # dataclasses look their module up while it runs
        spec.loader.exec_module(module)
    return sys.modules[key]
