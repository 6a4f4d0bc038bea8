"""Trainer -> rollout weight buckets over CUDA IPC, for a trainer and a vLLM on the same GPU.

Colocated placement (the way verl, slime and AReaL feed a colocated vLLM): the trainer copies a
bucket into one flat ``uint8`` CUDA buffer it keeps per bucket index (`IpcExporter`), exports
that buffer's CUDA IPC handle once, and sends a small plain message over an RPC. The rollout
process maps the handle (`IpcOpener`, once per handle), gets tensors that *view the trainer's
buffer*, loads them and replies; only after that reply may the trainer export into the same
index again. The message is msgpack-safe (dict, list, str, int, bytes, bool): nothing is
pickled and nothing in it names code.

Message, version 1 (`IpcMessage`)::

    {"v": 1,
     "gpu": "<uuid of the physical GPU, str(torch.cuda.get_device_properties(i).uuid)>",
     "slot": <bucket index: a new handle for a slot unmaps the slot's old one>,
     "handle": {"handle": bytes, "storage_size_bytes": int, "storage_offset_bytes": int,
                "ref_counter_handle": bytes, "ref_counter_offset": int,
                "event_handle": bytes (64), "event_sync_required": bool},
     "nbytes": <bytes of the buffer that the tensors use>,
     "tensors": [[name, dtype_name, shape (list[int]), offset (int, bytes)], ...]}

``handle`` holds the fields of ``UntypedStorage._share_cuda_()`` except the sender's device
index: processes see different ``CUDA_VISIBLE_DEVICES``, so the receiver finds its own index
of the GPU from ``gpu``. Each tensor starts on a 256-byte boundary (`layout`).

Receiver checks (`check_message`, pure, before anything is mapped): every field's type, the
dtype against `DTYPES`, each offset aligned to its element size, offset + bytes <= ``nbytes``
<= ``storage_size_bytes``, the ref-counter slot within torch's counter file. The handle itself
cannot be checked before mapping: the trainer is trusted to send the handle it exported.

This module does not decide when to push, does not touch vLLM (the caller loads the tensors),
and does not move weights between GPUs (`earl.stages.weights`: shm, ucx, zmq, nccl).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypedDict

import torch

__all__ = ["ALIGN", "DTYPES", "CheckedMessage", "IpcExporter", "IpcHandle", "IpcMessage",
           "IpcOpener", "IpcOpenerStats", "TensorSlot", "check_message", "gpu_uuid",
           "ipc_available", "layout", "plan", "views"]

VERSION = 1
ALIGN = 256
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# torch's CUDA IPC ref-counter file holds this many int64 slots (CUDA_IPC_REF_COUNTER_FILE_SIZE);
# the receiver decrements the slot it is given, so an offset past it would write out of bounds.
_REF_COUNTER_SLOTS = 10000
_EVENT_HANDLE_BYTES = 64
_MAX_HANDLE_BYTES = 4096
_FIX_PLACEMENT = "use placement.weights_transport=shm/nccl when trainer and rollout do not share one"


class IpcHandle(TypedDict):
    """The fields of ``UntypedStorage._share_cuda_()`` the receiver needs to map a buffer."""

    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


class IpcMessage(TypedDict):
    """One pushed bucket; see the module docstring for the meaning of each field."""

    v: int
    gpu: str
    slot: int
    handle: IpcHandle
    nbytes: int
    tensors: list[list[str | int | list[int]]]


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor of a bucket lives in the flat buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel * dtype.itemsize


@dataclass(frozen=True, slots=True)
class CheckedMessage:
    """An `IpcMessage` that passed `check_message`, its dtypes resolved."""

    gpu: str
    slot: int
    handle: IpcHandle
    nbytes: int
    tensors: tuple[TensorSlot, ...]


@dataclass(frozen=True, slots=True)
class IpcOpenerStats:
    """`IpcOpener.statistics()`: buffers mapped now, and messages opened so far."""

    mapped: int
    opens: int


def ipc_available() -> str:
    """Returns ``""`` when CUDA IPC can be used in this process, else the reason it cannot."""
    if not torch.cuda.is_available():
        return "no CUDA device is visible to this process"
    return ""


def layout(specs: Sequence[tuple[torch.dtype, Sequence[int]]]) -> tuple[list[int], int]:
    """Plans a flat buffer: each tensor at the next `ALIGN`-byte boundary.

    Args:
        specs: ``(dtype, shape)`` of each tensor, in bucket order.

    Returns:
        The byte offset of each tensor and the buffer's total size (a multiple of `ALIGN`).
    """
    offsets, end = [], 0
    for dtype, shape in specs:
        offsets.append(end)
        end += -(-_nbytes(dtype, shape) // ALIGN) * ALIGN
    return offsets, end


def views(flat: torch.Tensor, slots: Sequence[TensorSlot]) -> list[tuple[str, torch.Tensor]]:
    """Tensors that view ``flat`` (1-D ``uint8``) at the given slots; nothing is copied."""
    out = []
    for slot in slots:
        window = flat[slot.offset:slot.offset + slot.nbytes]
        assert window.numel() == slot.nbytes, "slot past the buffer: check_message missed it"
        out.append((slot.name, window.view(slot.dtype).view(slot.shape)))
    return out


def _fail(field: str, problem: str, fix: str) -> ValueError:
    return ValueError(f"{field}: {problem}; {fix}")


_RESEND = "send the message IpcExporter.export returned, unchanged"


def _get(obj: Mapping[str, object], key: str, field: str) -> object:
    if key not in obj:
        raise _fail(f"{field}.{key}", "missing", _RESEND)
    return obj[key]


def _int(value: object, field: str, lo: int, hi: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(field, f"expected an int, got {type(value).__name__}", _RESEND)
    if value < lo or (hi is not None and value >= hi):
        bound = f"[{lo}, {hi})" if hi is not None else f">= {lo}"
        raise _fail(field, f"{value} is out of range {bound}", _RESEND)
    return value


def _bytes(value: object, field: str, lo: int, hi: int) -> bytes:
    if not isinstance(value, bytes):
        raise _fail(field, f"expected bytes, got {type(value).__name__}", _RESEND)
    if not lo <= len(value) <= hi:
        raise _fail(field, f"{len(value)} bytes, expected {lo}..{hi}", _RESEND)
    return value


def _check_handle(raw: object) -> IpcHandle:
    field = "message.handle"
    if not isinstance(raw, Mapping):
        raise _fail(field, f"expected a dict, got {type(raw).__name__}", _RESEND)
    counter = _bytes(_get(raw, "ref_counter_handle", field), f"{field}.ref_counter_handle",
                     1, _MAX_HANDLE_BYTES)
    if b"\0" in counter:  # torch reads it as a C string naming a shared-memory file
        raise _fail(f"{field}.ref_counter_handle", "contains a NUL byte", _RESEND)
    sync = _get(raw, "event_sync_required", field)
    if not isinstance(sync, bool):
        raise _fail(f"{field}.event_sync_required", f"expected a bool, got {type(sync).__name__}",
                    _RESEND)
    return IpcHandle(
        handle=_bytes(_get(raw, "handle", field), f"{field}.handle", 1, _MAX_HANDLE_BYTES),
        storage_size_bytes=_int(_get(raw, "storage_size_bytes", field),
                                f"{field}.storage_size_bytes", 1),
        storage_offset_bytes=_int(_get(raw, "storage_offset_bytes", field),
                                  f"{field}.storage_offset_bytes", 0),
        ref_counter_handle=counter,
        ref_counter_offset=_int(_get(raw, "ref_counter_offset", field),
                                f"{field}.ref_counter_offset", 0, _REF_COUNTER_SLOTS),
        event_handle=_bytes(_get(raw, "event_handle", field), f"{field}.event_handle",
                            _EVENT_HANDLE_BYTES, _EVENT_HANDLE_BYTES),
        event_sync_required=sync,
    )


def _check_tensor(raw: object, field: str, nbytes: int) -> TensorSlot:
    if not isinstance(raw, list | tuple) or len(raw) != 4:
        raise _fail(field, "expected [name, dtype_name, shape, offset]", _RESEND)
    name, dtype_name, shape, offset = raw
    if not isinstance(name, str) or not name:
        raise _fail(f"{field}.name", "expected a non-empty str", _RESEND)
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _fail(f"{field}.dtype", f"{dtype_name!r} is not one of {sorted(DTYPES)}",
                    "cast the bucket to a supported dtype (IpcExporter.export(dtype=...))")
    if not isinstance(shape, list | tuple):
        raise _fail(f"{field}.shape", f"expected a list of ints, got {type(shape).__name__}",
                    _RESEND)
    dims = tuple(_int(size, f"{field}.shape[{i}]", 0) for i, size in enumerate(shape))
    slot = TensorSlot(name, DTYPES[dtype_name], dims, _int(offset, f"{field}.offset", 0))
    if slot.offset % slot.dtype.itemsize:
        raise _fail(f"{field}.offset", f"{slot.offset} is not a multiple of the "
                    f"{dtype_name} element size {slot.dtype.itemsize}", _RESEND)
    if slot.offset + slot.nbytes > nbytes:
        raise _fail(f"{field}.offset", f"tensor {name!r} ends at byte "
                    f"{slot.offset + slot.nbytes}, past message.nbytes={nbytes}", _RESEND)
    return slot


def check_message(message: Mapping[str, object]) -> CheckedMessage:
    """Validates a received `IpcMessage` before anything is mapped.

    Raises:
        ValueError: naming the bad field (``message.tensors[2].offset``) and the fix.
    """
    if not isinstance(message, Mapping):
        raise _fail("message", f"expected a dict, got {type(message).__name__}", _RESEND)
    version = _get(message, "v", "message")
    if version != VERSION or isinstance(version, bool):
        raise _fail("message.v", f"version {version!r} is not {VERSION}",
                    "run the same earl version on the trainer and the rollout")
    gpu = _get(message, "gpu", "message")
    if not isinstance(gpu, str) or not gpu:
        raise _fail("message.gpu", "expected the GPU's uuid as a non-empty str", _RESEND)
    handle = _check_handle(_get(message, "handle", "message"))
    nbytes = _int(_get(message, "nbytes", "message"), "message.nbytes", 0)
    if nbytes > handle["storage_size_bytes"]:
        raise _fail("message.nbytes", f"{nbytes} exceeds the shared storage's "
                    f"{handle['storage_size_bytes']} bytes", _RESEND)
    raw = _get(message, "tensors", "message")
    if not isinstance(raw, list | tuple) or not raw:
        raise _fail("message.tensors", "expected a non-empty list", _RESEND)
    tensors = tuple(_check_tensor(entry, f"message.tensors[{i}]", nbytes)
                    for i, entry in enumerate(raw))
    if len({t.name for t in tensors}) != len(tensors):
        raise _fail("message.tensors", "a name appears twice", "push each tensor once per bucket")
    slot = _int(_get(message, "slot", "message"), "message.slot", 0)
    return CheckedMessage(gpu, slot, handle, nbytes, tensors)


def gpu_uuid(index: int) -> str:
    """The uuid of local CUDA device ``index``: the same string in every process."""
    return str(torch.cuda.get_device_properties(index).uuid)


def _pack(bucket: Sequence[tuple[str, torch.Tensor]], flat: torch.Tensor,
          slots: Sequence[TensorSlot]) -> None:
    with torch.no_grad():
        for (_, tensor), (_, dst) in zip(bucket, views(flat, slots), strict=True):
            dst.copy_(tensor)


def _out_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def plan(bucket: Sequence[tuple[str, torch.Tensor]],
         dtype: torch.dtype | None) -> tuple[tuple[TensorSlot, ...], int]:
    """The slots of a bucket (floating tensors cast to ``dtype``) and the buffer size it needs."""
    specs = []
    for i, (name, tensor) in enumerate(bucket):
        out = _out_dtype(tensor, dtype)
        if out not in _DTYPE_NAMES:
            raise _fail(f"bucket[{i}] ({name!r})", f"dtype {out} cannot be pushed over IPC",
                        f"pass dtype= one of {sorted(DTYPES)}")
        specs.append((name, out, tuple(tensor.shape)))
    offsets, total = layout([(d, s) for _, d, s in specs])
    return tuple(TensorSlot(n, d, s, o) for (n, d, s), o in zip(specs, offsets, strict=True)), total


@dataclass(slots=True)
class _Buffer:
    flat: torch.Tensor
    handle: IpcHandle


class IpcExporter:
    """The trainer's side: one reused flat CUDA buffer per bucket index, its handle sent once.

    The rollout must have loaded (and synchronized) a message's tensors before `export` is
    called again with the same ``index``: the buffer is overwritten in place.

    Args:
        device: the trainer's CUDA device; the current one when None.

    Raises:
        RuntimeError: without CUDA.
    """

    def __init__(self, device: torch.device | None = None) -> None:
        reason = ipc_available()
        if reason:
            raise RuntimeError(f"{reason}: CUDA IPC needs a GPU shared by trainer and rollout; "
                               f"{_FIX_PLACEMENT}")
        self._device = torch.device("cuda", torch.cuda.current_device()) if device is None \
            else torch.device(device)
        if self._device.type != "cuda":
            raise ValueError(f"device: {self._device} is not a CUDA device; pass the trainer's "
                             "CUDA device")
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._gpu = gpu_uuid(self._device.index)
        self._buffers: dict[int, _Buffer] = {}

    def export(self, bucket: list[tuple[str, torch.Tensor]], index: int,
               dtype: torch.dtype | None = None) -> IpcMessage:
        """Copies ``bucket`` into buffer ``index`` and returns the message for the rollout.

        Args:
            bucket: ``(name, tensor)`` pairs, on any device.
            index: which reused buffer (one per bucket position in a push).
            dtype: cast floating-point tensors to this dtype on the GPU; others keep theirs.

        Returns:
            The msgpack-safe message (module docstring), ready once the copy has finished.
        """
        if not bucket:
            raise ValueError("bucket: empty; export only buckets with at least one tensor")
        if isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"index: {index!r} is not a non-negative int; pass the bucket's "
                             "position in the push")
        slots, total = plan(bucket, dtype)
        buffer = self._buffers.get(index)
        if buffer is None or buffer.flat.numel() < total:
            self._buffers.pop(index, None)  # torch keeps it in IPC limbo until the rollout unmaps
            torch.cuda.ipc_collect()
            flat = torch.empty(max(total, ALIGN), dtype=torch.uint8, device=self._device)
            buffer = _Buffer(flat, _share(flat))
            self._buffers[index] = buffer
        with torch.cuda.device(self._device):
            _pack(bucket, buffer.flat, slots)
            # The rollout reads on its own stream: the bytes must have landed before we answer.
            # (The handle's event only covers the buffer's first export.)
            torch.cuda.synchronize(self._device)
        return IpcMessage(
            v=VERSION, gpu=self._gpu, slot=index, handle=buffer.handle.copy(), nbytes=total,
            tensors=[[s.name, _DTYPE_NAMES[s.dtype], list(s.shape), s.offset] for s in slots])

    def close(self) -> None:
        """Drops the buffers; torch frees each one once the rollout has unmapped it."""
        self._buffers.clear()
        torch.cuda.ipc_collect()


def _share(flat: torch.Tensor) -> IpcHandle:
    (_device, handle, size, offset, counter, counter_offset, event,
     sync) = flat.untyped_storage()._share_cuda_()
    return IpcHandle(handle=handle, storage_size_bytes=size, storage_offset_bytes=offset,
                     ref_counter_handle=counter, ref_counter_offset=counter_offset,
                     event_handle=event, event_sync_required=sync)


@dataclass(slots=True)
class _Mapped:
    storage: torch.UntypedStorage
    counter: tuple[bytes, int]
    device: int


class IpcOpener:
    """The rollout's side: maps each exported buffer once and hands out views of it.

    The returned tensors alias the trainer's buffer: load them (copy into the model), then
    ``torch.cuda.synchronize()`` before replying, so the trainer may overwrite it.
    A process cannot open its own handles (CUDA refuses); the trainer must be another process.
    """

    def __init__(self) -> None:
        self._mapped: dict[tuple[bytes, int], _Mapped] = {}
        self._slots: dict[int, tuple[bytes, int]] = {}
        self._uuids: dict[str, int] | None = None
        self._opens = 0

    def open(self, message: Mapping[str, object]) -> list[tuple[str, torch.Tensor]]:
        """Validates ``message`` and returns its tensors, viewing the trainer's buffer.

        Raises:
            ValueError: a malformed message, or a GPU this process cannot see (names the fix).
            RuntimeError: without CUDA.
        """
        checked = check_message(message)
        reason = ipc_available()
        if reason:
            raise RuntimeError(f"{reason}: CUDA IPC needs a GPU shared by trainer and rollout; "
                               f"{_FIX_PLACEMENT}")
        device = self._local_index(checked.gpu)
        handle = checked.handle
        counter = (handle["ref_counter_handle"], handle["ref_counter_offset"])
        key = (handle["handle"], handle["storage_offset_bytes"])
        mapped = self._mapped.get(key)
        if mapped is None:
            old = self._slots.get(checked.slot)
            if old is not None:  # the trainer grew this slot's buffer: let the old one go
                self._mapped.pop(old, None)
            torch.cuda.init()
            # Waits on the trainer's event when event_sync_required; releases the trainer's
            # ref counter when the storage dies.
            storage = torch.UntypedStorage._new_shared_cuda(
                device, handle["handle"], handle["storage_size_bytes"],
                handle["storage_offset_bytes"], *counter, handle["event_handle"],
                handle["event_sync_required"])
            mapped = _Mapped(storage, counter, device)
            self._mapped[key] = mapped
        elif counter != mapped.counter:
            # A fresh share of a buffer we already map: give its reference back, as torch does.
            torch.UntypedStorage._release_ipc_counter(*counter, device=mapped.device)
        self._slots[checked.slot] = key
        self._opens += 1
        assert mapped.storage.nbytes() >= checked.nbytes, "check_message bounds nbytes"
        flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", mapped.device))
        flat.set_(mapped.storage, 0, (mapped.storage.nbytes(),), (1,))
        return views(flat, checked.tensors)

    def statistics(self) -> IpcOpenerStats:
        return IpcOpenerStats(mapped=len(self._mapped), opens=self._opens)

    def close(self) -> None:
        """Unmaps every buffer that no returned tensor still holds."""
        self._mapped.clear()
        self._slots.clear()

    def _local_index(self, uuid: str) -> int:
        if self._uuids is None:
            self._uuids = {gpu_uuid(i): i for i in range(torch.cuda.device_count())}
        if uuid not in self._uuids:
            raise ValueError(f"message.gpu: GPU {uuid} is not visible to this process (it sees "
                             f"{sorted(self._uuids)}); place the rollout on the trainer's GPU or "
                             f"{_FIX_PLACEMENT}")
        return self._uuids[uuid]
