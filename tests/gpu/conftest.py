"""Shared by the GPU tests: the tiny model folder they build once per module."""

from __future__ import annotations

from pathlib import Path

import pytest

from earl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=512)
