"""Wire codec and frame parser: round trips, zero-copy arrays, typed messages, bad bytes."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgpack
import numpy as np
import pytest
import torch

from earl.runtime import wire
from earl.runtime.frames import HEADER, MAGIC, FrameProtocol, FrameTooLarge, Kind, derive_key


@wire.message
@dataclass(kw_only=True, slots=True)
class Sample:
    sample_id: str
    tokens: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    logp: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not self.sample_id:
            raise ValueError("Sample.sample_id must be non-empty")


class NotRegistered:
    pass


def roundtrip(obj):
    body, bufs = wire.encode(obj)
    # what a receiver sees: independent writable buffers
    return wire.decode(body, [bytearray(memoryview(b).cast("B")) for b in bufs])


@pytest.mark.parametrize("value", [
    None, True, 0, -(2**63), 2**64 - 1, 1.5, "héllo", b"\x00\xff", [1, [2, 3]],
    {"a": 1, 2: "b"}, (1, (2, "x")), {"t": [(1, 2), (3, 4)]},
])
def test_plain_values_round_trip_with_types(value):
    out = roundtrip(value)
    assert out == value
    assert type(out) is type(value)


def test_numpy_arrays_go_out_of_band_and_round_trip():
    a = np.arange(1000, dtype=np.float32).reshape(10, 100)
    b = np.array([[1, 2], [3, 4]], dtype=np.int64).T  # non-contiguous
    body, bufs = wire.encode({"a": a, "b": b, "e": np.zeros((0, 3), np.int8)})
    assert len(body) < 200, "array bytes must not be inside the msgpack body"
    assert len(bufs) == 3
    out = wire.decode(body, [bytearray(memoryview(x).cast("B")) for x in bufs])
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    assert out["e"].shape == (0, 3) and out["e"].dtype == np.int8


def test_decoded_array_aliases_the_receive_buffer():
    body, bufs = wire.encode(np.arange(4, dtype=np.int32))
    recv = bytearray(memoryview(bufs[0]).cast("B"))
    out = wire.decode(body, [recv])
    recv[:4] = (99).to_bytes(4, "little")
    assert out[0] == 99  # zero-copy: the array is a view of the buffer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_cpu_tensors_round_trip(dtype):
    t = (torch.arange(12) % 3).to(dtype).reshape(3, 4)
    out = roundtrip(t)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.shape == (3, 4)
    assert torch.equal(out, t)
    assert roundtrip(torch.zeros(0, dtype=dtype)).shape == (0,)


def test_registered_dataclass_round_trips_and_validates_on_receive():
    s = Sample(sample_id="s1", tokens=[1, 2], spans=[(0, 2)], logp=np.ones(2, np.float32))
    out = roundtrip(s)
    assert isinstance(out, Sample)
    assert out.sample_id == "s1" and out.tokens == [1, 2] and out.spans == [(0, 2)]
    np.testing.assert_array_equal(out.logp, s.logp)
    object.__setattr__(s, "sample_id", "")
    with pytest.raises(wire.WireError, match="sample_id"):
        roundtrip(s)


def test_unregistered_class_is_refused_with_a_hint():
    with pytest.raises(wire.WireError, match="@earl.runtime.wire.message"):
        wire.encode({"x": NotRegistered()})
    with pytest.raises(TypeError, match="dataclass"):
        wire.message(NotRegistered)


def test_unknown_message_name_and_garbage_never_execute_anything():
    fake = msgpack.ExtType(3, msgpack.packb(["os:system", [["echo pwned"]]]))
    with pytest.raises(wire.WireError, match="unregistered message type 'os:system'"):
        wire.decode(msgpack.packb(fake))
    with pytest.raises(wire.WireError, match="malformed"):
        wire.decode(b"\xc1\xc1\xc1")
    with pytest.raises(wire.WireError, match="buffer index"):
        wire.decode(msgpack.packb(msgpack.ExtType(1, msgpack.packb(["<f4", [2], 7]))))
    with pytest.raises(wire.WireError):
        wire.decode(msgpack.packb(msgpack.ExtType(99, b"")))


def test_gpu_or_object_arrays_are_refused():
    with pytest.raises(wire.WireError, match="dtype object"):
        wire.encode(np.array([object()]))


# ---- frame parser (no sockets: feed bytes by hand) ------------------------------------------
class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data):
        self.out += data

    def writelines(self, parts):
        for p in parts:
            self.out += memoryview(p).cast("B")

    def is_closing(self):
        return self.closed

    def close(self):
        self.closed = True


class _Recorder(FrameProtocol):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.frames: list = []
        self.refused: list = []

    def frame_received(self, kind, rid, body, bufs):
        self.frames.append((kind, rid, bytes(body), [bytes(b) for b in bufs]))

    def frame_refused(self, kind, rid, reason):
        self.refused.append((rid, reason))


def _pair(max_bytes=1 << 20, secret=None):
    a, b = _Recorder(max_bytes=max_bytes, secret=secret), _Recorder(max_bytes=max_bytes,
                                                                    secret=secret)
    a.connection_made(_Transport())
    b.connection_made(_Transport())
    b.send_dir = b"S"
    return a, b


def _sent(proto):
    proto._flush()  # sends are coalesced until the end of the loop iteration
    return bytes(proto.transport.out)


def _feed(proto, data, chunk):
    view = memoryview(bytes(data))
    while view:
        buf = proto.get_buffer(-1)
        n = min(len(buf), chunk, len(view))
        buf[:n] = view[:n]
        view = view[n:]
        proto.buffer_updated(n)


@pytest.mark.parametrize("chunk", [1, 7, 4096, 1 << 20])
def test_frames_survive_any_chunking_including_big_frames(chunk):
    a, b = _pair(max_bytes=1 << 22)
    big = np.arange(300_000, dtype=np.uint8).tobytes()  # > the small receive buffer
    a.send(Kind.CALL, 1, b"hello")
    a.send(Kind.CALL, 2, b"x" * 10, [b"abc", big])
    a.send(Kind.OK, 3)
    _feed(b, _sent(a), chunk)
    assert [f[:3] for f in b.frames] == [(Kind.CALL, 1, b"hello"), (Kind.CALL, 2, b"x" * 10),
                                         (Kind.OK, 3, b"")]
    assert b.frames[1][3] == [b"abc", big]


def test_oversized_frame_is_skipped_and_the_stream_stays_in_sync():
    a, b = _pair(max_bytes=1 << 22)
    a.send(Kind.CALL, 1, b"y" * 200_000)
    a.send(Kind.CALL, 2, b"ok")
    b.max_bytes = 100_000
    _feed(b, _sent(a), 5000)
    assert [f[1] for f in b.frames] == [2]
    assert b.refused and b.refused[0][0] == 1 and "max_message_bytes" in b.refused[0][1]
    with pytest.raises(FrameTooLarge, match="max_message_bytes"):
        b.send(Kind.CALL, 3, b"z" * 200_000)


def test_bad_magic_closes_the_connection():
    _, b = _pair()
    _feed(b, HEADER.pack(16, 0x00, Kind.CALL, 0, 1, 0), 100)
    assert b.transport.closed and not b.frames


def test_inconsistent_lengths_are_refused():
    _, b = _pair()
    frame = HEADER.pack(16 + 3, MAGIC, Kind.CALL, 0, 9, 1) + b"abc"  # body_len says 1, has 3
    _feed(b, frame, 100)
    assert not b.frames and b.refused[0][0] == 9


def test_hmac_frames_verify_and_tampering_or_replay_is_dropped():
    key = derive_key(b"s" * 16, b"n" * 16)
    a, b = _pair(secret=b"s" * 16)
    a.key = b.key = key
    a.send(Kind.CALL, 1, b"one")
    first = _sent(a)
    a.send(Kind.CALL, 2, b"two")
    wire_bytes = bytearray(_sent(a))
    wire_bytes[len(first) + 21] ^= 0x01  # flip a bit of the second frame's body
    _feed(b, wire_bytes, 64)
    assert [f[1] for f in b.frames] == [1]
    assert b.refused[0][0] == 2 and "authentication" in b.refused[0][1]
    _feed(b, first, 64)  # replay of frame 1: wrong sequence number
    assert [f[1] for f in b.frames] == [1] and len(b.refused) == 2


def test_frame_header_layout_is_stable():
    assert HEADER.size == 20
    assert struct.calcsize("<I") == 4


def _nested_tuple_body(depth: int) -> bytes:
    data = msgpack.packb([1])
    for _ in range(depth):
        data = msgpack.packb([msgpack.ExtType(wire.EXT_TUPLE, data)])
    return data


@pytest.mark.parametrize("depth", [wire.MAX_DEPTH + 1, 200, 5000])
def test_deep_nesting_is_refused_on_both_ends_without_crashing(depth):
    value: object = 1
    for _ in range(depth):
        value = (value,)
    with pytest.raises(wire.WireError, match="MAX_DEPTH"):
        wire.encode(value)
    with pytest.raises(wire.WireError, match="MAX_DEPTH"):  # 200 segfaulted msgpack before
        wire.decode(_nested_tuple_body(depth))
    with pytest.raises(wire.WireError):  # plain lists: msgpack's own stack limit
        wire.decode(b"\x91" * 5000 + b"\x01")
    shallow = _nested_tuple_body(wire.MAX_DEPTH - 1)
    assert wire.decode(shallow) is not None
    assert wire.encode(wire.decode(shallow))  # what decodes also encodes


def test_hostile_arrays_and_tensors_are_refused():
    ext = msgpack.ExtType
    for body in (msgpack.packb(ext(wire.EXT_NDARRAY, msgpack.packb(["|O", [2], 0]))),
                 msgpack.packb(ext(wire.EXT_TENSOR, msgpack.packb(["float32", [1 << 30, 1 << 30],
                                                                   0])))):
        with pytest.raises(wire.WireError):
            wire.decode(body, [bytearray(16) if b"|O" in body else bytearray()])
    with pytest.raises(wire.WireError):  # a declared 4-billion-item array in a 9-byte body
        wire.decode(b"\xdd\xff\xff\xff\xff\x01\x02\x03\x04")


def test_unauthenticated_peer_cannot_declare_a_big_frame():
    _, b = _pair(secret=b"s" * 16)
    b.key = derive_key(b"s" * 16, b"n" * 16)
    _feed(b, HEADER.pack(200 << 20, MAGIC, Kind.CALL, 0, 1, 10) + b"x" * 100, 4096)
    assert b.transport.closed and b._big is None and not b.frames and not b.refused


def test_first_bad_mac_closes_and_a_good_one_authenticates():
    key = derive_key(b"s" * 16, b"n" * 16)
    a, b = _pair(secret=b"s" * 16)
    a.key = b.key = key
    a.send(Kind.AUTH, 0)
    a.send(Kind.CALL, 1, b"x" * 100_000)  # big is fine once the AUTH frame verified
    _feed(b, _sent(a), 4096)
    assert b.authenticated and [f[:2] for f in b.frames] == [(Kind.AUTH, 0), (Kind.CALL, 1)]
    a2, c = _pair(secret=b"s" * 16)
    a2.key, c.key = derive_key(b"w" * 16, b"n" * 16), key
    a2.send(Kind.AUTH, 0)
    _feed(c, _sent(a2), 4096)
    assert c.transport.closed and not c.authenticated and not c.frames
