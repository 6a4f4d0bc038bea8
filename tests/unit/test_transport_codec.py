"""The frame codec and frame reference counting (no processes)."""

import numpy as np
import pytest

from earl.runtime.transport import choose
from earl.runtime.transport.base import (
    Frame,
    TransportError,
    as_bytes_view,
    pack_arrays,
    unpack_arrays,
)


def _frame(header, bufs, cb=None):
    return Frame(header=header, buffers=[as_bytes_view(b) for b in bufs], _on_release=cb)


def test_pack_unpack_round_trips_dtypes_shapes_and_meta():
    arrays = {
        "ids": np.arange(10, dtype=np.int64),
        "mask": np.array([True, False]),
        "scalar": np.array(1.5, np.float32),
        "empty": np.zeros(0, np.int8),
        "strided": np.arange(20, dtype=np.float32)[::2],  # made contiguous by pack
        "matrix": np.ones((3, 4), np.float16),
    }
    header, bufs = pack_arrays(arrays, {"step": 3})
    out, meta = unpack_arrays(_frame(header, bufs))
    assert meta == {"step": 3}
    for k, v in arrays.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        np.testing.assert_array_equal(out[k], v)
    copied, _ = unpack_arrays(_frame(header, bufs), copy=True)
    assert copied["ids"].flags.owndata


def test_codec_errors_name_the_problem():
    with pytest.raises(TypeError, match="array 'x' is list; pass a numpy array"):
        pack_arrays({"x": [1, 2]})
    header, bufs = pack_arrays({"a": np.ones(2), "b": np.ones(2)})
    with pytest.raises(TransportError, match="frame has 1 buffers, header names 2"):
        unpack_arrays(_frame(header, bufs[:1]))
    with pytest.raises(ValueError, match="C-contiguous"):
        as_bytes_view(np.ones((4, 4))[:, 1])


def test_frame_returns_buffers_after_the_last_reference():
    released = []
    f = _frame(b"", [np.ones(3)], cb=lambda: released.append(1))
    f.retain()  # a peer reads it too
    f.release()
    assert released == []
    f.release()
    assert released == [1]
    f.release()  # extra releases are harmless
    assert released == [1]
    with pytest.raises(ValueError, match="released frame"):
        f.retain()


def test_locality_choice():
    assert choose(same_host=True) == "shm"
    assert choose(same_host=True, device="cuda:0") in ("nccl", "shm")  # nccl only with CUDA


def test_buffer_pool_reuses_released_buffers_by_size():
    from earl.runtime.transport.base import BufferPool

    pool = BufferPool()
    a = pool.take(64)
    pool.give(a)
    assert pool.take(32) is not a  # another size: a fresh buffer
    assert pool.take(64) is a      # same size: the released one
    assert pool.take(64) is not a  # handed out once only
