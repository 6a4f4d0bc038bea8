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


async def test_a_send_to_a_dead_replica_raises_its_death() -> None:
    """A network send fails before the replicas' commit call does: the push raises the commit's
    error (naming the dead replica, so healing restarts it), not the bare transport error."""
    import asyncio

    from earl.runtime.errors import ActorDied
    from earl.runtime.transport import TransportError
    from earl.stages.weights import _explain_send_failure

    async def commit_fails() -> None:
        await asyncio.sleep(0.01)
        raise ActorDied("rollout[0]", "killed by SIGKILL", cause="killed")

    commit = asyncio.ensure_future(commit_fails())
    with pytest.raises(ActorDied) as err:
        await _explain_send_failure(commit, TransportError("ucx send failed"))
    assert (err.value.group, err.value.rank) == ("rollout", 0)
    assert isinstance(err.value.__cause__, TransportError)
    pending = asyncio.ensure_future(asyncio.sleep(10))  # no commit error: the send error stands
    await _explain_send_failure(pending, TransportError("x"), timeout=0.01)
    await asyncio.sleep(0)
    assert pending.cancelled()
