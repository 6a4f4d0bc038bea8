"""CUDA IPC weight buckets, the parts that need no GPU: layout, packing, message checks."""

from __future__ import annotations

import copy

import msgpack
import pytest
import torch

from earl.stages import weights_ipc as ipc


def _message() -> dict:
    """A well-formed message, as IpcExporter would send it (the handle bytes are made up)."""
    return {
        "v": 1, "gpu": "8d6e7a4c-0000-1111-2222-333344445555", "slot": 0,
        "handle": {"handle": b"\x01" * 66, "storage_size_bytes": 4096,
                   "storage_offset_bytes": 0, "ref_counter_handle": b"/torch_123_456_0",
                   "ref_counter_offset": 3, "event_handle": b"\x00" * 64,
                   "event_sync_required": True},
        "nbytes": 1024,
        "tensors": [["w", "float32", [4, 8], 0], ["b", "bfloat16", [8], 256],
                    ["step", "int64", [], 512]],
    }


def test_layout_aligns_every_tensor_to_256_bytes():
    offsets, total = ipc.layout([(torch.float32, (3,)), (torch.bfloat16, (200,)),
                                 (torch.uint8, (0,)), (torch.int64, ())])
    assert offsets == [0, 256, 768, 768]
    assert total == 1024
    assert ipc.layout([]) == ([], 0)


def test_plan_casts_only_floating_tensors():
    bucket = [("w", torch.zeros(2, 3)), ("ids", torch.zeros(5, dtype=torch.int64))]
    slots, total = ipc.plan(bucket, torch.bfloat16)
    assert [(s.name, s.dtype, s.shape, s.offset) for s in slots] == [
        ("w", torch.bfloat16, (2, 3), 0), ("ids", torch.int64, (5,), 256)]
    assert total == 512


def test_pack_then_views_round_trip_on_cpu():
    bucket = [("w", torch.randn(4, 8)), ("b", torch.randn(8).to(torch.float16)),
              ("mask", torch.tensor([True, False, True]))]
    slots, total = ipc.plan(bucket, torch.bfloat16)
    flat = torch.zeros(total, dtype=torch.uint8)
    ipc._pack(bucket, flat, slots)
    out = ipc.views(flat, slots)
    assert [name for name, _ in out] == ["w", "b", "mask"]
    assert torch.equal(out[0][1], bucket[0][1].to(torch.bfloat16))
    assert torch.equal(out[1][1], bucket[1][1].to(torch.bfloat16))
    assert torch.equal(out[2][1], bucket[2][1])
    out[0][1].zero_()  # views, not copies: they alias the buffer
    assert not flat[:64].any()


def test_check_message_accepts_what_the_exporter_sends():
    checked = ipc.check_message(_message())
    assert checked.nbytes == 1024 and checked.slot == 0
    assert [(t.name, t.dtype, t.shape, t.offset) for t in checked.tensors] == [
        ("w", torch.float32, (4, 8), 0), ("b", torch.bfloat16, (8,), 256),
        ("step", torch.int64, (), 512)]


def _set(message: dict, path: tuple, value: object) -> dict:
    target = message
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return message


_DELETE = object()


@pytest.mark.parametrize(("path", "value", "field"), [
    (("v",), 2, "message.v"),
    (("v",), True, "message.v"),
    (("v",), _DELETE, "message.v"),
    (("gpu",), 0, "message.gpu"),
    (("slot",), -1, "message.slot"),
    (("slot",), _DELETE, "message.slot"),
    (("nbytes",), "1024", "message.nbytes"),
    (("nbytes",), 8192, "message.nbytes"),  # more than the shared storage holds
    (("handle",), [], "message.handle"),
    (("handle", "handle"), "abc", "message.handle.handle"),
    (("handle", "storage_size_bytes"), _DELETE, "message.handle.storage_size_bytes"),
    (("handle", "ref_counter_offset"), 10_000, "message.handle.ref_counter_offset"),
    (("handle", "ref_counter_handle"), b"/torch\x00x", "message.handle.ref_counter_handle"),
    (("handle", "event_handle"), b"\x00" * 8, "message.handle.event_handle"),
    (("handle", "event_sync_required"), 1, "message.handle.event_sync_required"),
    (("tensors",), [], "message.tensors"),
    (("tensors", 0), ["w", "float32", [4, 8]], "message.tensors[0]"),
    (("tensors", 0, 0), 7, "message.tensors[0].name"),
    (("tensors", 1, 1), "complex64", "message.tensors[1].dtype"),
    (("tensors", 1, 1), "torch.nn.Module", "message.tensors[1].dtype"),
    (("tensors", 1, 2), [8, -1], "message.tensors[1].shape[1]"),
    (("tensors", 1, 2), "8", "message.tensors[1].shape"),
    (("tensors", 0, 3), 2, "message.tensors[0].offset"),  # not a multiple of 4
    (("tensors", 2, 3), 1020, "message.tensors[2].offset"),  # int64 ending past nbytes
    (("tensors", 1, 0), "w", "message.tensors"),  # duplicate name
])
def test_check_message_names_the_bad_field(path, value, field):
    message = _set(copy.deepcopy(_message()), path, value)
    with pytest.raises(ValueError) as err:
        ipc.check_message(message)
    assert str(err.value).startswith(f"{field}:")


def test_check_message_rejects_a_non_dict():
    with pytest.raises(ValueError, match="^message:"):
        ipc.check_message([1, 2])  # type: ignore[arg-type]


def test_tensor_past_nbytes_is_refused_even_if_the_storage_is_larger():
    message = _message()
    message["tensors"][0] = ["w", "float32", [1024], 0]  # 4096 bytes: fits storage, not nbytes
    with pytest.raises(ValueError, match=r"message.tensors\[0\].offset: .*past message.nbytes"):
        ipc.check_message(message)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_without_cuda_ipc_says_why_and_how_to_fix():
    assert "CUDA" in ipc.ipc_available()
    with pytest.raises(RuntimeError, match="placement.weights_transport=shm/nccl"):
        ipc.IpcExporter()
    with pytest.raises(RuntimeError, match="placement.weights_transport"):
        ipc.IpcOpener().open(_message())


def test_opener_validates_before_touching_cuda():
    with pytest.raises(ValueError, match="^message.v:"):
        ipc.IpcOpener().open({**_message(), "v": 0})


def test_message_survives_msgpack():
    wire = msgpack.unpackb(msgpack.packb(_message()))
    assert wire == _message()
    assert ipc.check_message(wire).tensors[1].dtype == torch.bfloat16
