"""The directory's waits (no processes): a change and a cancellation arriving together must end
the wait with the cancellation, never leave it waiting again (a healer hung that way)."""

from __future__ import annotations

import asyncio

import pytest

from earl.runtime.directory import UP, Directory, GroupRecord

pytestmark = pytest.mark.timeout(30)


def _record(status: str = UP, restarts: int = 0) -> GroupRecord:
    return GroupRecord(name="g", cls_name="C", endpoints={}, addresses=["unix:/x"], pids=[1],
                       status=[status], restarts=[restarts])


@pytest.mark.parametrize("turns", range(6))
async def test_a_cancel_that_meets_a_change_is_not_swallowed(turns: int) -> None:
    d = Directory()
    await d.publish(_record())
    waits = [asyncio.ensure_future(d.wait_status("g", 0, UP, 3600.0, min_restarts=1)),
             asyncio.ensure_future(d.lookup("other", 3600.0))]
    await asyncio.sleep(0.01)  # both are waiting on the change event
    d._notify()  # a change that satisfies neither...
    for _ in range(turns):  # ...lands 0-5 loop turns before the cancellation
        await asyncio.sleep(0)
    for w in waits:
        w.cancel()
    for w in waits:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(w, 2)


async def test_waits_return_on_change_or_timeout() -> None:
    d = Directory()
    assert await d.lookup("g", 0.0) is None
    assert await d.wait_status("g", 0, UP, 0.05) is False
    later = asyncio.ensure_future(d.lookup("g", 10.0))
    await asyncio.sleep(0.01)
    await d.publish(_record())
    assert (await later).name == "g"
    with pytest.raises(ValueError, match="NaN"):
        await d.wait_status("g", 0, UP, float("nan"))
