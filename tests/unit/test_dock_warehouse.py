"""Warehouse storage, dtype checks and the batch codec."""

import numpy as np
import pytest

from earl.runtime.dock_warehouse import Warehouse, unpack_batch
from earl.runtime.transport.base import Frame, as_bytes_view


def sample(n, v=3):
    return {"input_ids": np.arange(n, dtype=np.int64), "loss_mask": np.ones(n, np.int8),
            "versions": np.full(n, v, np.int32), "rewards": np.array(1.5, np.float32)}


def test_put_registers_min_version_and_pack_round_trips():
    w = Warehouse("w0")
    cols = sample(5)
    cols["versions"][0] = 1
    info = w.put("s0", cols, group_id="g", group_size=2)
    assert (info.version, info.length, info.shard) == (1, 5, "w0")
    w.put("s1", sample(2), group_id="g", group_size=2)
    header, bufs = w.pack(["s1", "s0"], ["input_ids", "rewards"])
    frame = Frame(header=header, buffers=[as_bytes_view(b) for b in bufs])
    out = unpack_batch(frame)
    assert out["s0"]["input_ids"].tolist() == [0, 1, 2, 3, 4]
    assert out["s1"]["rewards"] == np.float32(1.5) and out["s1"]["rewards"].shape == ()
    assert w.statistics().nbytes == 5 * 13 + 4 + 2 * 13 + 4
    w.evict(["s0", "s1"])
    assert w.statistics().nbytes == 0 and w.statistics().samples == 0


def test_bad_columns_are_clear_errors():
    w = Warehouse("w0")
    with pytest.raises(TypeError, match="'input_ids' has dtype int32; it must be int64"):
        w.put("s", {"input_ids": np.arange(3, dtype=np.int32)}, group_id="g")
    with pytest.raises(TypeError, match="pass a numpy array"):
        w.put("s", {"input_ids": [1, 2]}, group_id="g")
    with pytest.raises(ValueError, match="disagree on length"):
        w.put("s", {"input_ids": np.arange(3), "loss_mask": np.ones(4, np.int8)}, group_id="g")
    with pytest.raises(ValueError, match="needs a 'versions' column"):
        w.put("s", {"input_ids": np.arange(3)}, group_id="g")
    w.put("s", {"input_ids": np.arange(3), "versions": np.zeros(3, np.int32)}, group_id="g")
    with pytest.raises(ValueError, match="already stored"):
        w.put("s", {"input_ids": np.arange(3), "versions": np.zeros(3, np.int32)}, group_id="g")
    with pytest.raises(KeyError, match="no sample 'nope'"):
        w.get(["nope"], ["input_ids"])
