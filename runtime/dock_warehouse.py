"""One warehouse shard of the transfer dock: the column arrays a producer made, kept in place.

Pure storage plus the batch codec; the producer process owns it and serves fetches from it
(runtime/dock.py sends the packed batch over a transport). With an `arena`, `put` copies the
columns once into shared memory, and an shm fetch then sends their place, not their bytes: the
consumer reads the producer's pages (runtime/transport/shm_arena.py). It remembers each sample's
registration and which stages acked it, so a restarted index can be rebuilt from the shards.

Not here: deciding what is ready or consumed (runtime/dock_index.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from earl.runtime.dock_index import SampleInfo
from earl.runtime.transport.base import Frame, pack_arrays, unpack_arrays
from earl.runtime.transport.shm_arena import ShmArena
from earl.runtime.types import COLUMNS

# The dtypes a shard accepts per column (earl.runtime.types.COLUMNS; masks may also be bool).
DTYPES: dict[str, object] = {k: np.dtype(v).type for k, v in COLUMNS.items()}
DTYPES["loss_mask"] = (np.int8, np.bool_)


@dataclass(frozen=True, slots=True)
class WarehouseStatistics:
    name: str
    samples: int
    nbytes: int


class Warehouse:
    """Args: name: the shard's name; arena: shared memory to keep the columns in (None: the
    arrays the producer passed, as they are)."""

    def __init__(self, name: str, *, arena: ShmArena | None = None) -> None:
        self.name, self.arena = name, arena
        self._data: dict[str, dict[str, np.ndarray]] = {}
        self._infos: dict[str, SampleInfo] = {}  # samples this shard registered
        self._acked: dict[str, set[str]] = {}
        self._nbytes = 0

    def put(
        self,
        sample_id: str,
        columns: Mapping[str, np.ndarray],
        *,
        group_id: str | None = None,
        group_size: int = 1,
    ) -> SampleInfo | dict[str, int]:
        """Store columns of one sample.

        With `group_id` this is a new sample (returns its SampleInfo to register); without, it
        adds columns to a sample registered elsewhere (returns column -> nbytes).
        """
        if group_id is not None and sample_id in self._data:
            raise ValueError(f"sample_id {sample_id!r} is already stored; sample ids must be unique")
        cols = {c: _check(sample_id, c, a) for c, a in columns.items()}
        if not cols:
            raise ValueError(f"sample {sample_id!r}: put needs at least one column")
        lengths = {len(a) for a in cols.values() if a.ndim == 1 and a.size > 1}
        if len(lengths) > 1:
            raise ValueError(f"sample {sample_id!r}: per-token columns disagree on length "
                             f"{sorted(lengths)}; every 1-D column must have the sample's length")
        if group_id is not None and not ("versions" in cols and cols["versions"].size):
            raise ValueError(f"sample {sample_id!r}: a new sample needs a 'versions' column "
                             "(policy version per token)")
        store = self._data.setdefault(sample_id, {})
        for c, a in cols.items():
            if c in store:
                self._nbytes -= store[c].nbytes
                self._free(store[c])
            store[c] = a if self.arena is None else self.arena.store(a)
            self._nbytes += a.nbytes
        sizes = {c: a.nbytes for c, a in cols.items()}
        if group_id is None:
            return sizes
        version = int(cols["versions"].min())
        length = max((len(a) for a in cols.values() if a.ndim == 1), default=0)
        info = SampleInfo(sample_id=sample_id, group_id=group_id, group_size=group_size,
                          length=length, version=version, shard=self.name, columns=sizes)
        self._infos[sample_id] = info
        return info

    def get(self, sample_ids: Sequence[str], columns: Sequence[str]) -> dict[str, np.ndarray]:
        """Arrays named ``"<i>/<column>"`` for the i-th requested sample (no copies)."""
        out = {}
        for i, sid in enumerate(sample_ids):
            store = self._data.get(sid)
            if store is None:
                raise KeyError(f"warehouse {self.name} has no sample {sid!r}")
            for c in columns:
                if c not in store:
                    raise KeyError(f"warehouse {self.name} has no column {c!r} of {sid!r}")
                out[f"{i}/{c}"] = store[c]
        return out

    def pack(self, sample_ids: Sequence[str], columns: Sequence[str], tag: str = ""
             ) -> tuple[bytes, list]:
        """A transport frame with the requested columns; `unpack_batch` reverses it. `tag`
        names the fetch that asked for it (`frame_tag`)."""
        meta: dict[str, object] = {"ids": list(sample_ids)}
        if tag:
            meta["fetch"] = tag
        return pack_arrays(self.get(sample_ids, columns), meta)

    def mark_acked(self, sample_ids: Iterable[str], stage: str) -> None:
        for sid in sample_ids:
            if sid in self._infos:
                self._acked.setdefault(sid, set()).add(stage)

    def evict(self, sample_ids: Iterable[str]) -> None:
        for sid in sample_ids:
            store = self._data.pop(sid, {})
            self._nbytes -= sum(a.nbytes for a in store.values())
            for a in store.values():
                self._free(a)
            self._infos.pop(sid, None)
            self._acked.pop(sid, None)

    def report(self) -> tuple[list[tuple[SampleInfo, list[str]]], list[tuple[str, str, dict]]]:
        """For `DockIndex.restore`: (own samples with acked stages, columns added here)."""
        own = [(info, sorted(self._acked.get(sid, ()))) for sid, info in self._infos.items()]
        extra = [
            (sid, self.name, {c: a.nbytes for c, a in store.items()})
            for sid, store in self._data.items()
            if sid not in self._infos
        ]
        return own, extra

    def statistics(self) -> WarehouseStatistics:
        return WarehouseStatistics(name=self.name, samples=len(self._data), nbytes=self._nbytes)

    def _free(self, a: np.ndarray) -> None:
        if self.arena is not None:
            self.arena.free(a)


def _check(sample_id: str, column: str, a: object) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"sample {sample_id!r} column {column!r} is {type(a).__name__}; "
                        "pass a numpy array (tensor.numpy() for CPU tensors)")
    want = DTYPES.get(column)
    if want is not None:
        allowed = want if isinstance(want, tuple) else (want,)
        if a.dtype not in [np.dtype(t) for t in allowed]:
            names = " or ".join(np.dtype(t).name for t in allowed)
            raise TypeError(f"sample {sample_id!r} column {column!r} has dtype {a.dtype}; "
                            f"it must be {names}")
    if a.ndim > 1:
        raise ValueError(f"sample {sample_id!r} column {column!r} has shape {a.shape}; "
                         "dock columns are 1-D per sample (or scalars)")
    return a if a.flags.c_contiguous else a.copy(order="C")  # keeps 0-d scalars 0-d


def frame_tag(frame: Frame) -> str:
    """The fetch a frame made by `Warehouse.pack` answers ("" if untagged): a consumer reads
    only its current fetch's frames, never one a failed fetch left in its receiver."""
    meta = json.loads(frame.header).get("m", {})
    return str(meta.get("fetch", ""))


def unpack_batch(frame: Frame, *, copy: bool = False) -> dict[str, dict[str, np.ndarray]]:
    """sample_id -> column -> array, from a frame made by `Warehouse.pack`."""
    arrays, meta = unpack_arrays(frame, copy=copy)
    ids = meta["ids"]
    assert isinstance(ids, list)
    out: dict[str, dict[str, np.ndarray]] = {sid: {} for sid in ids}
    for key, arr in arrays.items():
        i, col = key.split("/", 1)
        out[ids[int(i)]][col] = arr
    return out
