"""Shared by the GPU tests: the tiny model folder they build once per module, and a guard that
fails a test which leaves a process group behind (then tears it down, so the next test starts
clean instead of skipping on "a process group already exists")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from process_groups import left_behind, tear_down

from earl.models.tiny import build_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), max_positions=512)


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    # autouse: set up before the test's own fixtures, so torn down after theirs
    yield
    left = left_behind()
    tear_down()
    if left:
        pytest.fail(f"the test left {' and '.join(left)} behind; tear it down in the test "
                    "(a fixture) so later GPU tests get a clean process", pytrace=False)
