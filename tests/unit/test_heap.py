"""`earl.runtime.heap.trim`: freed heap pages go back to the OS."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from earl.runtime import heap

_MEASURE = """
import json
from earl.runtime import heap

def anon_mib():
    return heap.anon_bytes() / 2**20

before = anon_mib()
blocks = [bytearray(4000) for _ in range(50_000)]  # ~200 MiB below the mmap threshold
grown = anon_mib()
pins = blocks[::8]  # one block in 8 stays live: the heap cannot shrink from its top
del blocks
kept = anon_mib()  # the other 7 freed into the heap, still resident
spent = heap.trim()
print(json.dumps([before, grown, kept, anon_mib(), spent, len(pins)]))
"""


@pytest.mark.skipif(heap._malloc_trim() is None, reason="not glibc: trim() does nothing")
def test_freed_small_blocks_leave_the_resident_set_after_a_trim() -> None:
    # a fresh interpreter: in this one, heap that earlier tests freed would absorb the blocks
    out = subprocess.run([sys.executable, "-c", _MEASURE], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    before, grown, kept, after, spent, pinned = json.loads(out)
    assert spent is not None and pinned == 6250
    assert grown - before > 150, (before, grown)
    assert kept - after > 0.5 * (grown - before), (before, grown, kept, after)


def test_the_trimmer_trims_only_a_heap_that_crept_past_its_working_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    anon = iter([100, 105, 109, 120, 118, 118, 135])  # MiB, after each step
    trims: list[int] = []
    monkeypatch.setattr(heap, "anon_bytes", lambda: next(anon) << 20)
    monkeypatch.setattr(heap, "trim", lambda: trims.append(1) or 0.01)
    t = heap.Trimmer(slack=0.10)
    spent = [t.after_step() for _ in range(7)]
    # 100 is the working set; 105, 109 are within 10%; 120 is not: trimmed; 118 is the new
    # working set one step later; 118 stays; 135 crept 14%: trimmed again
    assert spent == [0.0, 0.0, 0.0, 0.01, 0.0, 0.0, 0.01] and t.trims == 2
