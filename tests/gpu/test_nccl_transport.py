"""NCCL transport between two processes, each on its own GPU (NCCL refuses two ranks on one
GPU: "Duplicate GPU detected", seen on a lent one-GPU H100; skipped without 2 GPUs)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from earl.runtime.transport import get_transport

pytestmark = pytest.mark.gpu


def _send(address: str) -> None:
    from earl.runtime.transport import connect

    torch.cuda.set_device(1)
    sender = connect(address)
    x = torch.arange(1 << 20, dtype=torch.float32, device="cuda")
    sender.send(b"hdr", [x])
    torch.cuda.synchronize()


@pytest.mark.timeout(120)
def test_nccl_moves_cuda_tensors():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
    receiver = get_transport("nccl").listen()
    child = mp.get_context("spawn").Process(target=_send, args=(receiver.address,))
    child.start()
    frame = receiver.recv(timeout=60)
    assert frame.header == b"hdr" and frame.buffers == []
    (t,) = frame.tensors
    assert t.is_cuda and t.numel() == 4 << 20
    assert torch.equal(t.view(torch.float32).cpu(), torch.arange(1 << 20, dtype=torch.float32))
    child.join(60)
    assert child.exitcode == 0
