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
    run: list | None = None          # [prefix, width, start, count, step], the open run
    for sid in ids:
        m = _TAIL.match(sid)
        if m is not None and run is not None:
            prefix, digits = m.groups()
            n, (rp, width, start, count, step) = int(digits), run
            if count == 1 and prefix == rp and n - start in (0, 1) \
                    and _digits(n, width) == digits:
                run[3], run[4] = 2, n - start
                continue
            if count > 1 and prefix == rp and n == start + step * count \
                    and _digits(n, width) == digits:
                run[3] += 1
                continue
        if run is not None:
            out.append(run if run[3] > 1 else _digits_id(run))
        if m is None:
            run = None
            out.append(sid)
        else:
            prefix, digits = m.groups()
            run = [prefix, len(digits), int(digits), 1, 1]
    if run is not None:
        out.append(run if run[3] > 1 else _digits_id(run))
    return out


def _digits_id(run: list) -> str:
    prefix, width, start = run[0], run[1], run[2]
    return f"{prefix}{_digits(start, width)}"


def unpack(packed: Iterable[str | list]) -> Iterator[str]:
    """The ids `pack` packed, in order."""
    for entry in packed:
        if isinstance(entry, str):
            yield entry
            continue
        prefix, width, start, count, step = entry
        for i in range(int(count)):
            yield f"{prefix}{_digits(int(start) + int(step) * i, int(width))}"
