"""`first_finished`, the over-sampling cut of a batch: which plays are kept, and that the cut
ones are cancelled and unwound before it returns."""

from __future__ import annotations

import asyncio

import pytest

from earl.stages.producer import first_finished


async def test_keeps_the_first_to_finish_and_unwinds_the_rest() -> None:
    unwound: list[int] = []

    async def play(i: int, delay: float) -> str:
        try:
            await asyncio.sleep(delay)
            return f"group {i}"
        except asyncio.CancelledError:
            unwound.append(i)
            raise

    delays = [5.0, 0.01, 5.0, 0.05]
    kept = await asyncio.wait_for(first_finished([play(i, d) for i, d in enumerate(delays)], 2),
                                  2)
    assert kept == {1: "group 1", 3: "group 3"}
    assert sorted(unwound) == [0, 2]  # cancelled, and their cleanup ran before the return


async def test_need_all_waits_for_all_and_ties_keep_the_lower_index() -> None:
    async def play(i: int) -> int:
        await asyncio.sleep(0)
        return i

    assert await first_finished([play(i) for i in range(3)], 3) == {0: 0, 1: 1, 2: 2}
    assert await first_finished([play(i) for i in range(3)], 1) == {0: 0}


async def test_a_failing_play_cancels_the_others_and_raises() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def bad() -> None:
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        await asyncio.wait_for(first_finished([slow(), bad()], 1), 2)
    assert cancelled.is_set()


async def test_need_out_of_range_is_refused() -> None:
    async def play() -> None:
        return None

    coros = [play(), play()]
    with pytest.raises(ValueError, match=r"need must be in \[0, 2\]"):
        await first_finished(coros, 3)
    for c in coros:
        c.close()
