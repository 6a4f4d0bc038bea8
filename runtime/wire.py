"""Wire codec: msgpack values with out-of-band buffers, typed messages, no pickle.

A value is encoded to one msgpack `body` plus a list of raw `buffers` (numpy arrays and CPU torch
tensors are never copied into the body: each becomes a msgpack ext record pointing at a buffer,
sent as its own frame segment and rebuilt zero-copy on the other side). Dataclasses registered
with `@message` travel as typed records; tuples stay tuples; actor-group handles register their
own ext record (see `register_ext`). Decoding only ever builds these known types: nothing from
the network is unpickled or imported.

Hostile bytes cannot crash the decoder: ext records (tuples, messages, arrays, handles) nest at
most `MAX_DEPTH` levels on either end. Each level is one nested msgpack unpack whose C context
takes ~40 KiB of stack, and ~200 levels overflow an 8 MiB stack (a segfault, not an exception),
so the depth is counted before msgpack is entered again. Plain lists and maps nest inside one
unpack, whose own stack limit raises an error; msgpack's `max_*_len` limits default to the body
size, so no declared length can allocate more than the bytes received.

This module knows nothing about sockets or framing (see `earl.runtime.frames`).

Example:
    >>> @message
    ... @dataclass
    ... class Point:
    ...     x: int
    ...     y: int
    >>> body, bufs = encode({"p": Point(1, 2), "a": np.arange(3)})
    >>> decode(body, bufs)["p"]
    Point(x=1, y=2)
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np

__all__ = ["WireError", "decode", "encode", "message", "register_ext", "registered_messages"]

EXT_NDARRAY, EXT_TENSOR, EXT_MESSAGE, EXT_TUPLE = 1, 2, 3, 4
MAX_DEPTH = 32  # nested ext records (tuples, messages, ...) per value, on both ends
T = TypeVar("T")


class WireError(ValueError):
    """A value cannot be encoded, or received bytes do not decode to a known value."""


_MESSAGES: dict[str, type] = {}
_FIELDS: dict[type, tuple[str, tuple[str, ...]]] = {}
_EXT_ENCODERS: dict[type, tuple[int, Callable[[Any], Any]]] = {}
_EXT_DECODERS: dict[int, Callable[[Any], Any]] = {}


def _type_name(cls: type) -> str:
    module = "__main__" if cls.__module__ == "__mp_main__" else cls.__module__
    return f"{module}:{cls.__qualname__}"


def message(cls: type[T]) -> type[T]:
    """Register a dataclass so its instances can cross the wire as typed records.

    Fields are sent by position (only `init=True` fields) and rebuilt with `cls(**fields)`, so
    `__post_init__` validation runs on the receiving side too. Both sides must import the module
    that defines the class (the name is `module:qualname`).

    Raises:
        TypeError: `cls` is not a dataclass.
    """
    if not dataclasses.is_dataclass(cls) or not isinstance(cls, type):
        raise TypeError(f"@message needs a dataclass, got {cls!r}; add @dataclass below @message")
    name = _type_name(cls)
    _MESSAGES[name] = cls
    _FIELDS[cls] = (name, tuple(f.name for f in dataclasses.fields(cls) if f.init))
    return cls


def registered_messages() -> dict[str, type]:
    """Names and classes of every registered message type (a copy)."""
    return dict(_MESSAGES)


def register_ext(cls: type, code: int, to_wire: Callable[[Any], Any],
                 from_wire: Callable[[Any], Any]) -> None:
    """Let another runtime type (e.g. ActorGroup) travel as ext record `code` (>= 16)."""
    assert code >= 16 and code not in _EXT_DECODERS or _EXT_DECODERS.get(code) is from_wire
    _EXT_ENCODERS[cls] = (code, to_wire)
    _EXT_DECODERS[code] = from_wire


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {str(d).removeprefix("torch."): d for d in (
        torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
        torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


_BASES: tuple[type, ...] = (int, float, str, bytes, list, dict, tuple)


def _too_deep() -> WireError:
    return WireError(f"value nests more than MAX_DEPTH={MAX_DEPTH} tuples/messages/handles inside"
                     " each other: flatten it (e.g. a list of tuples instead of nested tuples)")


class _Codec:
    """Packs one value; collects out-of-band buffers in `self.bufs` (event-loop thread only)."""

    __slots__ = ("bufs", "depth")

    def __init__(self) -> None:
        self.bufs: list[Any] = []
        self.depth = 0

    def _ext(self, code: int, obj: Any) -> msgpack.ExtType:
        if self.depth >= MAX_DEPTH:
            raise _too_deep()
        self.depth += 1
        try:
            return msgpack.ExtType(code, self.pack(obj))
        finally:
            self.depth -= 1

    def default(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is tuple:
            return self._ext(EXT_TUPLE, list(obj))
        if cls is np.ndarray:
            return self._array(obj)
        fields = _FIELDS.get(cls)
        if fields is not None:
            name, names = fields
            return self._ext(EXT_MESSAGE, [name, [getattr(obj, f) for f in names]])
        ext = _EXT_ENCODERS.get(cls)
        if ext is not None:
            return self._ext(ext[0], ext[1](obj))
        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, enum.Enum):
            return obj.value
        if "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor):
            return self._tensor(obj)
        for base in _BASES:  # subclasses (IntEnum, str enums, OrderedDict ...) as their base
            if isinstance(obj, base):
                return base(obj)
        if isinstance(obj, (bytearray, memoryview)):
            return bytes(obj)
        raise WireError(
            f"cannot send {cls.__module__}.{cls.__qualname__} over the wire: use None, bool, int,"
            " float, str, bytes, list, tuple, dict, numpy arrays, CPU tensors, actor groups, or"
            " a dataclass registered with @earl.runtime.wire.message")

    def pack(self, obj: Any) -> bytes:
        return msgpack.packb(obj, default=self.default, use_bin_type=True, strict_types=True)

    def _array(self, arr: np.ndarray) -> msgpack.ExtType:
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            raise WireError(f"cannot send numpy array of dtype {arr.dtype}: use a plain dtype")
        arr = np.ascontiguousarray(arr)
        self.bufs.append(memoryview(arr).cast("B") if arr.size else b"")  # type: ignore[arg-type]
        return self._ext(EXT_NDARRAY, [arr.dtype.str, list(arr.shape), len(self.bufs) - 1])

    def _tensor(self, t: Any) -> msgpack.ExtType:
        if t.device.type != "cpu":
            raise WireError(f"cannot send a {t.device} tensor over the RPC: call .cpu() first or"
                            " use earl.runtime.transport for device tensors")
        t = t.detach().contiguous()
        raw = t.reshape(-1).view(sys.modules["torch"].uint8).numpy() if t.numel() else b""
        self.bufs.append(memoryview(raw).cast("B") if len(raw) else b"")
        dtype = str(t.dtype).removeprefix("torch.")
        return self._ext(EXT_TENSOR, [dtype, list(t.shape), len(self.bufs) - 1])


def encode(obj: Any) -> tuple[bytes, list[Any]]:
    """Encode `obj` to (msgpack body, out-of-band buffers).

    Raises:
        WireError: `obj` contains a value that cannot travel (e.g. an unregistered class).
    """
    codec = _Codec()
    try:
        if threading.get_ident() == _MAIN[0]:
            _TOP.bufs = codec.bufs = []
            body = _PACKER.pack(obj)
        else:
            body = codec.pack(obj)
    except (TypeError, ValueError, OverflowError) as e:
        _reset_packer()
        _TOP.depth = 0
        if isinstance(e, WireError):
            raise
        raise WireError(f"cannot encode value: {e}") from e
    return body, codec.bufs


_TOP = _Codec()  # the top-level packer is reused (nested ext records use fresh ones)
_PACKER = msgpack.Packer(default=_TOP.default, use_bin_type=True, strict_types=True)
_MAIN = [threading.get_ident()]  # the one thread allowed to use _PACKER


def _reset_packer() -> None:  # after an exception mid-pack, start clean
    global _PACKER
    _PACKER = msgpack.Packer(default=_TOP.default, use_bin_type=True, strict_types=True)


class _Decoder:
    """Decodes one value (a fresh one per value: `depth` counts the ext records being built)."""

    __slots__ = ("bufs", "depth")

    def __init__(self, bufs: list[Any]) -> None:
        self.bufs = bufs
        self.depth = 0

    def unpack(self, data: Any) -> Any:
        return msgpack.unpackb(data, ext_hook=self.ext_hook, raw=False, strict_map_key=False)

    def ext_hook(self, code: int, data: bytes) -> Any:
        if self.depth >= MAX_DEPTH:  # checked before msgpack recurses: deeper would segfault
            raise _too_deep()
        self.depth += 1
        try:
            return self._ext(code, data)
        finally:
            self.depth -= 1

    def _ext(self, code: int, data: bytes) -> Any:
        if code == EXT_TUPLE:
            return tuple(self.unpack(data))
        if code == EXT_MESSAGE:
            name, values = self.unpack(data)
            cls = _MESSAGES.get(name)
            if cls is None:
                raise WireError(f"unregistered message type {name!r}: import the module that"
                                " defines it (with @earl.runtime.wire.message) in this process")
            return cls(**dict(zip(_FIELDS[cls][1], values, strict=True)))
        if code == EXT_NDARRAY:
            dtype, shape, idx = self.unpack(data)
            dt = np.dtype(dtype)
            if dt.hasobject or dt.fields is not None:
                raise WireError(f"refusing numpy dtype {dtype!r}: only plain dtypes travel")
            return np.frombuffer(self._buf(idx), dtype=dt).reshape(shape)
        if code == EXT_TENSOR:
            return self._tensor(*self.unpack(data))
        dec = _EXT_DECODERS.get(code)
        if dec is None:
            raise WireError(f"unknown ext record {code}")
        return dec(self.unpack(data))

    def _buf(self, idx: int) -> Any:
        if not isinstance(idx, int) or not 0 <= idx < len(self.bufs):
            raise WireError(f"buffer index {idx!r} out of range ({len(self.bufs)} buffers)")
        return self.bufs[idx]

    def _tensor(self, dtype: str, shape: list[int], idx: int) -> Any:
        import torch

        td = _torch_dtypes().get(dtype)
        if td is None:
            raise WireError(f"unsupported tensor dtype {dtype!r}")
        buf = self._buf(idx)
        if len(buf) == 0:
            if 0 not in shape:  # an empty buffer must not turn into a huge allocation
                raise WireError(f"tensor of shape {shape} has no data")
            return torch.empty(shape, dtype=td)
        return torch.frombuffer(buf, dtype=torch.uint8).view(td).reshape(shape)


def decode(body: Any, bufs: list[Any] | None = None) -> Any:
    """Decode a msgpack body plus its buffers (arrays alias the buffers, no copy).

    Raises:
        WireError: the bytes are not msgpack, or name an unknown type or buffer.
    """
    try:
        return _Decoder(bufs or []).unpack(body)
    except WireError:
        raise
    except Exception as e:  # msgpack raises several unrelated types for malformed input
        raise WireError(f"malformed message body: {type(e).__name__}: {e}") from e
