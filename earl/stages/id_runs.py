"""Lists of sample and group ids written as runs, for the records a judged run keeps on disk
(the trainers' `trained/trained.<rank>.jsonl`, the driver's `trained/ledger.jsonl`).

A batch's ids count up (`b000007-p0-0000`, `-0001`, ...) and its group ids repeat (`g8` x8,
`g9` x8, ...), so a run of ids that share a prefix and whose numbers step by 1 (or by 0)
packs into one entry `[prefix, width, start, count, step]`: 64 ids of ~18 characters become
~30. An id with no trailing number, or one that starts no run, stays a plain string, and
`unpack` of a plain list returns it unchanged (records written before this codec).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

__all__ = ["Packed", "pack", "unpack"]

Packed = list[str | list[str | int]]
_TAIL = re.compile(r"^(.*?)(\d+)$")


def _digits(n: int, width: int) -> str:
    return str(n).zfill(width)


def pack(ids: Iterable[str]) -> Packed:
    """`ids` as runs (see the module's docstring); `unpack(pack(ids)) == list(ids)`."""
    out: Packed = []
    run: list | None = None  # [prefix, width, start, count, step], the open run
    for sid in ids:
        m = _TAIL.match(sid)
        if m is not None and run is not None and _extends(run, *m.groups()):
            continue
        if run is not None:
            out.append(_closed(run))
        run = None if m is None else [m[1], len(m[2]), int(m[2]), 1, 1]
        if m is None:
            out.append(sid)
    if run is not None:
        out.append(_closed(run))
    return out


def _extends(run: list, prefix: str, digits: str) -> bool:
    """Add the id `prefix + digits` to `run` if it is the run's next (a run's second id sets
    its step, 0 or 1)."""
    rp, width, start, count, step = run
    n = int(digits)
    if prefix != rp or _digits(n, width) != digits:
        return False
    if count == 1 and n - start in (0, 1):
        run[3], run[4] = 2, n - start
        return True
    if count > 1 and n == start + step * count:
        run[3] += 1
        return True
    return False


def _closed(run: list) -> str | list:
    """A run as written: the entry, or its one id as a plain string."""
    return run if run[3] > 1 else f"{run[0]}{_digits(run[2], run[1])}"


def unpack(packed: Iterable[str | list]) -> Iterator[str]:
    """The ids `pack` packed, in order."""
    for entry in packed:
        if isinstance(entry, str):
            yield entry
            continue
        prefix, width, start, count, step = entry
        for i in range(int(count)):
            yield f"{prefix}{_digits(int(start) + int(step) * i, int(width))}"
