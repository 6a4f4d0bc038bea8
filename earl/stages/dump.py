"""A producer's trajectory dump: a sampled share of its groups, rotated, compressed and capped.

Each producer rank appends JSON lines to its own file (`trajectories.jsonl` for rank 0,
`trajectories.<rank>.jsonl` for the others). Only a `share` of the groups is written, whole
groups (a group's episodes are compared with each other), chosen by a hash of the step and the
group id, so the same run dumps the same groups; a failed episode is always written. When the
live file passes a segment (a quarter of the cap) it is gzipped to `<file>.<k>.gz` (k = 1, 2,
... oldest first), and the oldest segments are deleted while the rank's files are over its cap:
a run folder stays bounded however long the run. `earl inspect` reads the segments and the live
file in order.

Not here: what a record holds (`ProducerActor._write_dump`), reading them (`earl inspect`).
"""

from __future__ import annotations

import gzip
import json
import shutil
import zlib
from pathlib import Path

__all__ = ["TrajectoryDump", "dump_files"]


class TrajectoryDump:
    """Appends sampled trajectory records to `path`, bounded by `max_bytes`.

    Args:
        path: the live file.
        share: the share of groups written (1.0: all).
        max_bytes: the most this dump's files take on disk, segments included (0: no cap).
    """

    def __init__(self, path: str | Path, *, share: float = 1.0, max_bytes: int = 0) -> None:
        self.path, self.share, self.max_bytes = Path(path), share, max_bytes
        self.segment_bytes = max_bytes // 4 if max_bytes else 0
        self._segments = sorted(self.path.parent.glob(f"{self.path.name}.*.gz"),
                                key=_segment_index)  # a resumed run's, kept
        self._file = self.path.open("a")

    def wants(self, step: int, group_id: str, *, failed: bool = False) -> bool:
        """Whether the group `group_id` of `step` is written (a failed episode always is)."""
        if failed or self.share >= 1.0:
            return True
        return zlib.crc32(f"{step}/{group_id}".encode()) < self.share * 2**32

    def write(self, records: list[dict[str, object]]) -> None:
        """Append `records`, one JSON line each; rotate and trim when the segment is full."""
        if not records:
            return
        self._file.write("".join(json.dumps(r) + "\n" for r in records))
        self._file.flush()
        if self.segment_bytes and self._file.tell() >= self.segment_bytes:
            self._rotate()

    def close(self) -> None:
        self._file.close()

    def _rotate(self) -> None:
        self._file.close()
        k = _segment_index(self._segments[-1]) + 1 if self._segments else 1
        seg = self.path.with_name(f"{self.path.name}.{k}.gz")
        with self.path.open("rb") as src, gzip.open(seg, "wb", compresslevel=3) as dst:
            shutil.copyfileobj(src, dst)
        self._segments.append(seg)
        self._file = self.path.open("w")  # truncated: its lines are in the segment
        while self._segments and sum(s.stat().st_size for s in self._segments) \
                + self.segment_bytes > self.max_bytes:
            self._segments.pop(0).unlink(missing_ok=True)


def dump_files(live: Path) -> list[Path]:
    """A dump's files in the order written: its kept gzip segments, then the live file."""
    segments = sorted(live.parent.glob(f"{live.name}.*.gz"), key=_segment_index)
    return [*segments, *([live] if live.is_file() else [])]


def _segment_index(p: Path) -> int:
    return int(p.name.rsplit(".", 2)[-2])
