"""CUDA IPC weight buckets between two processes on one GPU (skipped without CUDA).

The parent plays the trainer (`IpcExporter`), a spawned child plays the rollout (`IpcOpener`);
messages cross a Pipe as the plain dicts they are. The parent keeps its buffers until the
child has answered, as the trainer does.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

import pytest
import torch

pytestmark = pytest.mark.gpu

TIMEOUT_S = 120.0


def _rollout(conn: Connection) -> None:
    """The child: open each message, answer checksums computed on the GPU, or the ValueError."""
    import torch

    from earl.stages.weights_ipc import IpcOpener

    opener = IpcOpener()
    try:
        while conn.poll(TIMEOUT_S):
            message = conn.recv()
            if message is None:
                break
            try:
                tensors = opener.open(message)
            except ValueError as err:
                conn.send({"error": str(err)})
                continue
            sums = {name: t.double().sum().item() for name, t in tensors}
            answer = {"sums": sums, "dtypes": {name: str(t.dtype) for name, t in tensors},
                      "devices": sorted({t.device.type for _, t in tensors}),
                      "mapped": opener.statistics().mapped}
            del tensors
            torch.cuda.synchronize()  # done reading before the trainer may overwrite
            conn.send(answer)
    finally:
        opener.close()
        conn.close()


@pytest.fixture
def ask() -> Iterator[Callable[[object], dict]]:
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_rollout, args=(child_end,), daemon=True)
    child.start()
    child_end.close()

    def send(message: object) -> dict:
        parent.send(message)
        if not parent.poll(TIMEOUT_S):
            raise TimeoutError(f"the rollout child did not answer in {TIMEOUT_S} s "
                               f"(alive={child.is_alive()}, exitcode={child.exitcode})")
        return parent.recv()

    try:
        yield send
    finally:
        try:
            parent.send(None)
        except (BrokenPipeError, OSError):
            pass
        child.join(60)
        if child.is_alive():
            child.kill()
            child.join(10)
        parent.close()
    assert child.exitcode == 0, f"the rollout child exited with {child.exitcode}"


def _expected(bucket: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None) -> dict:
    out = {}
    for name, t in bucket:
        cast = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        out[name] = cast.double().sum().item()
    return out


def _bucket(scale: float) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    return [("w", torch.randn(64, 128, device="cuda", generator=g) * scale),
            ("b", torch.randn(300, device="cuda", generator=g) * scale + 1),
            ("ids", torch.arange(17, device="cuda") * int(scale))]


def _assert_sums(answer: dict, expected: dict) -> None:
    assert "error" not in answer, answer
    assert answer["sums"] == pytest.approx(expected, rel=1e-9, abs=1e-9)


@pytest.mark.timeout(300)
def test_two_pushes_reuse_one_mapping_and_see_new_values(ask):
    from earl.stages.weights_ipc import IpcExporter

    exporter = IpcExporter(torch.device("cuda", torch.cuda.current_device()))
    try:
        first = _bucket(1.0)
        msg1 = exporter.export(first, 0, dtype=torch.bfloat16)
        answer = ask(msg1)
        _assert_sums(answer, _expected(first, torch.bfloat16))
        assert answer["dtypes"] == {"w": "torch.bfloat16", "b": "torch.bfloat16",
                                    "ids": "torch.int64"}
        assert answer["devices"] == ["cuda"] and answer["mapped"] == 1

        second = _bucket(3.0)  # new values, same shapes: the same buffer is overwritten
        msg2 = exporter.export(second, 0, dtype=torch.bfloat16)
        assert msg2["handle"] == msg1["handle"]
        answer = ask(msg2)
        _assert_sums(answer, _expected(second, torch.bfloat16))
        assert answer["mapped"] == 1

        kept = exporter.export(first, 1)  # no cast: fp32 stays fp32, in a second buffer
        answer = ask(kept)
        _assert_sums(answer, _expected(first, None))
        assert answer["dtypes"]["w"] == "torch.float32" and answer["mapped"] == 2

        bigger = [*first, ("extra", torch.ones(1 << 20, device="cuda"))]
        grown = exporter.export(bigger, 0)  # no longer fits: slot 0 gets a new buffer
        assert grown["handle"] != msg1["handle"]
        answer = ask(grown)
        _assert_sums(answer, _expected(bigger, None))
        assert answer["mapped"] == 2  # the child let slot 0's old buffer go
    finally:
        exporter.close()


@pytest.mark.timeout(300)
def test_child_refuses_to_read_past_nbytes(ask):
    from earl.stages.weights_ipc import IpcExporter

    exporter = IpcExporter()
    try:
        bucket = _bucket(1.0)
        message = exporter.export(bucket, 0)

        past = copy.deepcopy(message)
        past["tensors"][0][2] = [64, 128 * 64]  # "w" grown to run past the buffer
        assert ask(past)["error"].startswith("message.tensors[0].offset:")

        huge = copy.deepcopy(message)
        huge["nbytes"] = message["handle"]["storage_size_bytes"] + 256
        huge["tensors"][2][3] = huge["nbytes"] - 256
        assert ask(huge)["error"].startswith("message.nbytes:")

        elsewhere = copy.deepcopy(message)
        elsewhere["gpu"] = "00000000-0000-0000-0000-000000000000"
        assert ask(elsewhere)["error"].startswith("message.gpu:")

        _assert_sums(ask(message), _expected(bucket, None))  # the child is still fine
    finally:
        exporter.close()
