"""Weight buckets: planning by wire size, and an exact encode/decode round trip."""

from __future__ import annotations

import pytest
import torch

from earl.stages.weights import decode_bucket, encode_bucket, iter_buckets, plan_buckets


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(100, 10, generator=g), "b": torch.randn(3, generator=g),
            "c": torch.randn(300, 10, generator=g), "d": torch.randn(5, 5, generator=g).t(),
            "e": torch.zeros(0)}


def test_plan_groups_by_wire_bytes_and_keeps_order() -> None:
    sd = _state()
    plan = plan_buckets(sd, bucket_bytes=4100)
    assert [k for b in plan for k, _ in b] == list(sd)
    assert [[k for k, _ in b] for b in plan] == [["a", "b"], ["c"], ["d", "e"]]
    small = plan_buckets(sd, bucket_bytes=2100)
    assert [[k for k, _ in b] for b in small] == [["a"], ["b"], ["c"], ["d", "e"]]
    half = plan_buckets(sd, bucket_bytes=2100, dtype=torch.bfloat16)  # sized as sent: 2 bytes
    assert [[k for k, _ in b] for b in half] == [["a", "b"], ["c"], ["d", "e"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets(sd, bucket_bytes=0)


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_encode_decode_round_trip(dtype: torch.dtype | None) -> None:
    sd = _state()
    for bucket in iter_buckets(sd, 4100, dtype):
        header, bufs = encode_bucket(bucket)
        out = decode_bucket(header, [memoryview(b) for b in bufs])
        assert [k for k, _ in out] == [k for k, _ in bucket]
        for (_, want), (_, got) in zip(bucket, out, strict=True):
            assert got.dtype == (dtype or torch.float32) and got.shape == want.shape
            assert torch.equal(got, want)
    for _, t in next(iter(iter_buckets(sd, 1 << 20, dtype))):
        assert t.is_contiguous()
