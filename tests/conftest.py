"""Shared test configuration: skip GPU tests without CUDA, keep runs hermetic."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

_TORCH_SET_NUM_THREADS = torch.set_num_threads  # torch's own, before any test can replace it

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """An in-process vLLM engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) replaces
    `torch.set_num_threads` with a no-op for the rest of the process (a module fixture's engine
    does so before this test's fixtures run); each test ends with torch's own back."""
    yield
    torch.set_num_threads = _TORCH_SET_NUM_THREADS
