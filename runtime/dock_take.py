"""Calls to the dock's index from a client: its user-facing errors as themselves
(`index_errors`), and a lease merged across a sharded index (`take_merged`).

Each index rank owns the groups whose ids hash to it, so a step's samples are spread over the
ranks: the lease is merged (`merge_leases`) from what each has ready, whole groups from each,
tried in turn without waiting, then waited on in short slices. Not here: giving the parts back
when the take fails (`Dock.take` does, from the `parts` list it passed in).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from earl.runtime.dock_index import Lease, LeaseError, WouldBlock, merge_leases
from earl.runtime.errors import ActorError

__all__ = ["index_errors", "take_merged"]

T = TypeVar("T")


async def index_errors(call: Awaitable[T]) -> T:
    """Re-raise the index's user-facing errors as themselves, not as ActorError."""
    try:
        return await call
    except ActorError as e:
        for cls in (WouldBlock, LeaseError, ValueError, TimeoutError):
            if e.remote_type.rsplit(".", 1)[-1] == cls.__name__:
                raise cls(e.remote_message) from None
        raise


async def take_merged(index: Any, start: int, parts: list[Lease], stage: str,
                      columns: list[str], n: int, *, whole_groups: bool,
                      min_version: int | None, timeout_s: float | None,
                      at_least: int | None, holder: str = "") -> Lease:
    """`n` samples (or from `at_least`) leased from the ranks of `index`, starting at rank
    `start`; each part taken is appended to `parts` (the caller releases them if this raises).

    Raises:
        TimeoutError: not enough ready within `timeout_s`.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    done = n if at_least is None else at_least

    async def part(rank: int, wait: bool, slice_s: float | None) -> bool:
        """Take what `rank` has ready, up to what is missing; True once the parts suffice."""
        need = n - sum(len(x.samples) for x in parts)
        parts.append(await index_errors(index[rank % len(index)].take.call_one(
            stage, columns, need, whole_groups, min_version, wait, slice_s, at_least=1,
            holder=holder)))
        return n - need + len(parts[-1].samples) >= done

    while True:
        for k in range(len(index)):
            with contextlib.suppress(WouldBlock):
                if await part(start + k, False, None):
                    return merge_leases(parts)
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            got = sum(len(x.samples) for x in parts)
            raise TimeoutError(f"the index shards had {got} of {n} samples ready for {stage!r}")
        with contextlib.suppress(TimeoutError):
            if await part(start, True, min(0.5, left or 0.5)):
                return merge_leases(parts)
        start += 1
