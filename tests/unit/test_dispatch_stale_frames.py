"""`dispatch.gather` reads only its own fetch's frames: a frame a failed fetch left in the
receiver (a live warehouse's answer that came after another's death) is released unread, so it
cannot stand in for a frame of the next fetch (a trainer then saw samples with only their
`ref_logprobs`)."""

from __future__ import annotations

import queue

import numpy as np
import pytest

from earl.runtime.dispatch import FetchOp, gather
from earl.runtime.dock_warehouse import Warehouse
from earl.runtime.transport.base import Frame, as_bytes_view

pytestmark = pytest.mark.timeout(30)


class Inbox:
    address = "fake://inbox"

    def __init__(self) -> None:
        self.q: queue.Queue[Frame] = queue.Queue()
        self.released: list[str] = []

    def put(self, header: bytes, bufs: list[np.ndarray], name: str) -> None:
        def gone() -> None:
            self.released.append(name)

        self.q.put(Frame(header=header, buffers=[as_bytes_view(b) for b in bufs],
                         _on_release=gone))

    def recv(self, timeout: float | None = None) -> Frame:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError from None

    def close(self) -> None:
        pass


def shards() -> dict[str, Warehouse]:
    producer, reference = Warehouse("producer:0"), Warehouse("reference:0")
    for sid in ("old", "new"):
        producer.put(sid, {"input_ids": np.arange(3, dtype=np.int64),
                           "versions": np.zeros(3, np.int32)}, group_id=f"g-{sid}")
        reference.put(sid, {"ref_logprobs": np.zeros(3, np.float32)})
    return {"producer:0": producer, "reference:0": reference}


@pytest.mark.parametrize("tagged", [True, False])
async def test_a_frame_left_by_a_failed_fetch_is_not_read_as_this_ones(tagged: bool) -> None:
    wh, inbox = shards(), Inbox()
    # the failed fetch of "old": the reference answered after the producer's death
    inbox.put(*wh["reference:0"].pack(["old"], ["ref_logprobs"], "f1"), name="stale")
    ops = [FetchOp("producer:0", ("new",), ("input_ids",)),
           FetchOp("reference:0", ("new",), ("ref_logprobs",))]
    tag = "f2" if tagged else ""

    async def request(op: FetchOp, address: str) -> None:
        inbox.put(*wh[op.shard].pack(list(op.sample_ids), list(op.columns), tag),
                  name=op.shard)

    batch, frames = await gather(ops, inbox, request, timeout_s=5.0, tag=tag)
    if tagged:
        assert set(batch) == {"new"} and set(batch["new"]) == {"input_ids", "ref_logprobs"}
        assert inbox.released == ["stale"]
    else:  # untagged, as before: the stale frame fills a slot and a column goes missing
        assert "old" in batch and set(batch.get("new", {})) != {"input_ids", "ref_logprobs"}
    for f in frames:
        f.release()
