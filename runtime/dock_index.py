"""The transfer dock's metadata index: which columns of which samples are ready on which shard.

Pure bookkeeping, no tensors, no I/O, a fake-able clock: the index actor (runtime/dock.py) wraps
it. A sample is registered by the shard that produced it and may gain columns on other shards
(a reference actor adds ``ref_logprobs`` on its own shard). Each consuming *stage* takes samples
under a *lease*; `ack` marks them consumed by that stage, and a sample every stage has acked is
evicted. Leases that time out or are released go back to the pool; acked samples are never
handed out again to the same stage. When a shard dies, the samples it registered are reported
for re-production (`take_lost`) -- whole GRPO groups at a time -- never dropped silently; columns
a stage added there (a reference's) are only forgotten, for that stage to write again.

Not here: waiting (`put` awaiting capacity, consumers awaiting samples) -- see runtime/dock.py.
"""

from __future__ import annotations

import itertools
import time
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from earl.runtime.types import COLUMNS

CONTRACT_COLUMNS = tuple(COLUMNS)  # the names a dock checks; dtypes in earl.runtime.types


def index_rank_of(group_id: str, n_shards: int) -> int:
    """The index shard that owns a group (all its samples, so group selection stays local)."""
    return zlib.crc32(group_id.encode()) % n_shards


class WouldBlock(Exception):
    """The operation would have to wait (dock full, or not enough ready samples)."""


class LeaseError(KeyError):
    """The lease is unknown: already acked, released, expired, or cancelled by a shard loss."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SampleInfo:
    """What a producer registers: one sample whose `columns` (name -> nbytes) live on `shard`."""

    sample_id: str
    group_id: str
    group_size: int = 1
    length: int
    version: int
    shard: str
    columns: dict[str, int]


@dataclass(frozen=True, slots=True)
class Location:
    """Where one leased sample's columns are: column -> shard."""

    sample_id: str
    group_id: str
    length: int
    version: int
    columns: dict[str, str]


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: int
    stage: str
    columns: tuple[str, ...]
    samples: tuple[Location, ...]
    index_rank: int = 0  # which index shard issued it (ack/release go there)
    parts: tuple[tuple[int, int], ...] = ()  # merged: (index rank, lease id) of each part

    def issuers(self) -> tuple[tuple[int, int], ...]:
        """(index rank, lease id) of each index shard's lease this one stands for: itself, or
        the parts of a lease merged across a sharded index (`merge_leases`)."""
        return self.parts or ((self.index_rank, self.lease_id),)

    def fetches(self) -> list[tuple[str, list[str], list[str]]]:
        """(shard, sample ids, columns) requests covering the lease, one per shard and column
        set, samples in lease order."""
        out: dict[tuple[str, tuple[str, ...]], list[str]] = {}
        for loc in self.samples:
            for shard in sorted({loc.columns[c] for c in self.columns}):
                cols = tuple(c for c in self.columns if loc.columns[c] == shard)
                out.setdefault((shard, cols), []).append(loc.sample_id)
        return [(shard, ids, list(cols)) for (shard, cols), ids in out.items()]


def merge_leases(leases: Sequence[Lease]) -> Lease:
    """One lease standing for `leases` of the same stage and columns, taken from several index
    shards (a step's groups live on the shards their ids map to): its samples in order, and
    every part's (index rank, lease id) for ack and release.

    Raises:
        ValueError: no leases, or they differ in stage or columns.
    """
    if not leases:
        raise ValueError("merge_leases needs at least one lease")
    first = leases[0]
    if any((x.stage, x.columns) != (first.stage, first.columns) for x in leases):
        raise ValueError("merge_leases: the leases differ in stage or columns")
    if len(leases) == 1:
        return first
    return Lease(lease_id=first.lease_id, stage=first.stage, columns=first.columns,
                 samples=tuple(loc for x in leases for loc in x.samples),
                 index_rank=first.index_rank,
                 parts=tuple(p for x in leases for p in x.issuers()))


@dataclass(frozen=True, slots=True)
class AckResult:
    stage: str
    evict: dict[str, list[str]]  # shard -> sample ids every stage has consumed
    acked: dict[str, list[str]]  # producer shard -> sample ids this stage consumed (for rebuild)


@dataclass(frozen=True, slots=True)
class LostSample:
    sample_id: str
    group_id: str
    missing: tuple[str, ...]  # columns that were on the dead shard


@dataclass(frozen=True, slots=True)
class DockStatistics:
    samples: int
    capacity: int
    ready: dict[str, int]  # column -> samples with it
    bytes_per_shard: dict[str, int]
    leased: int
    consumed: dict[str, int]  # stage -> samples acked and still resident
    lost: int  # samples awaiting re-production
    waiting_producers: int
    waiting_consumers: int


@dataclass(slots=True)
class _Entry:
    info: SampleInfo
    seq: int
    columns: dict[str, tuple[str, int]]  # column -> (shard, nbytes)
    acked: set[str] = field(default_factory=set)
    leased: dict[str, int] = field(default_factory=dict)  # stage -> lease id
    writers: dict[str, str] = field(default_factory=dict)  # added column -> the stage that wrote it


class DockIndex:
    """Args:
        stages: every stage that consumes each sample; eviction waits for all of them.
        capacity: most resident samples; `register` raises WouldBlock beyond it.
        columns: the columns producers may write (requests for others are errors).
        lease_timeout_s: leases older than this return to the pool on `expire()`.
        clock: monotonic seconds (fake it in tests).
        index_rank: this shard's rank when the index is sharded by group (`index_rank_of`).
    """

    def __init__(
        self,
        *,
        stages: Sequence[str],
        capacity: int,
        columns: Iterable[str] = CONTRACT_COLUMNS,
        lease_timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        index_rank: int = 0,
    ) -> None:
        if not stages:
            raise ValueError("stages must name at least one consuming stage, e.g. ['train']")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.stages, self.capacity = tuple(stages), capacity
        self.known_columns = frozenset(columns)
        self.lease_timeout_s, self._clock = lease_timeout_s, clock
        self.index_rank = index_rank
        self._samples: dict[str, _Entry] = {}
        self._groups: dict[str, list[str]] = {}
        self._leases: dict[int, tuple[Lease, float]] = {}
        self._holders: dict[int, str] = {}  # lease id -> the shard of the process holding it
        self._lost: list[LostSample] = []
        self._doomed: dict[str, str] = {}  # group id -> its dead shard, while a lease holds it
        # group id -> samples it lost and has not registered again: their re-play is admitted
        # past capacity, for the room they left was taken by later batches' puts meanwhile
        self._owed: dict[str, int] = {}
        self._evictions: dict[str, list[str]] = {}  # shard -> ids lost since `take_evictions`
        self._seq = itertools.count()
        self._lease_ids = itertools.count(1)
        self.waiting_producers = 0
        self.waiting_consumers = 0

    # -- producers --------------------------------------------------------------------------

    def has_room(self) -> bool:
        return len(self._samples) < self.capacity

    def register(self, info: SampleInfo) -> None:
        """Record a new sample; raises WouldBlock when the dock is full.

        A sample of a group that lost samples (`take_lost`) is admitted even to a full dock, up
        to the number it lost: the consumer waits for that earlier group while the puts of
        later batches fill every room, so refusing it would stall the run for good; the dock
        holds at most what it held before the loss."""
        if info.sample_id in self._samples:
            raise ValueError(f"sample_id {info.sample_id!r} already registered; ids must be unique")
        self._check_columns(info.columns)
        if not 1 <= info.group_size <= self.capacity:
            raise ValueError(
                f"group_size {info.group_size} must be in [1, capacity={self.capacity}]; "
                "raise the dock capacity so a whole group fits"
            )
        group = self._groups.get(info.group_id, [])
        if len(group) >= info.group_size:
            raise ValueError(
                f"group {info.group_id!r} already has {len(group)} samples but group_size is "
                f"{info.group_size}; give every sample of a group the same group_size"
            )
        owed = self._owed.get(info.group_id, 0)
        if not owed and not self.has_room():
            raise WouldBlock(f"dock full ({self.capacity} samples)")
        if owed > 1:
            self._owed[info.group_id] = owed - 1
        elif owed:
            del self._owed[info.group_id]
        cols = {c: (info.shard, nb) for c, nb in info.columns.items()}
        self._samples[info.sample_id] = _Entry(info=info, seq=next(self._seq), columns=cols)
        self._groups.setdefault(info.group_id, []).append(info.sample_id)

    def add_columns(self, sample_id: str, shard: str, columns: Mapping[str, int],
                    stage: str = "") -> None:
        """A later stage wrote more columns of `sample_id` on `shard`. Naming the `stage` lets
        the shard's death cost only these columns (`drop_shard`: the stage writes them again);
        unnamed, its death loses the sample's group."""
        e = self._samples.get(sample_id)
        if e is None:
            raise ValueError(f"sample {sample_id!r} is not in the dock (evicted or never put)")
        self._check_columns(columns)
        if stage and stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; the dock's stages are {list(self.stages)}")
        for c, nb in columns.items():
            e.columns[c] = (shard, nb)
            if stage:
                e.writers[c] = stage
            else:
                e.writers.pop(c, None)

    def _check_columns(self, columns: Iterable[str]) -> None:
        unknown = sorted(set(columns) - self.known_columns)
        if unknown:
            raise ValueError(
                f"column(s) {unknown} are produced by nobody; known columns: "
                f"{sorted(self.known_columns)} (declare new ones in the dock's columns)"
            )

    # -- consumers --------------------------------------------------------------------------

    def take(
        self,
        stage: str,
        columns: Sequence[str],
        n: int,
        *,
        whole_groups: bool = True,
        min_version: int | None = None,
        at_least: int | None = None,
        group_ids: Sequence[str] | None = None,
        holder: str = "",
    ) -> Lease:
        """Lease `n` samples that have `columns` ready and `stage` has not consumed.

        With `whole_groups`, only complete groups are handed out, oldest first, and `n` must be
        reachable exactly by whole groups. With `at_least`, any count from `at_least` up to
        `n` is leased (what is ready now: a stage that consumes continuously). With
        `group_ids`, exactly those groups, whole, are leased and `n` is not read (a consumer
        that chose its groups: a partial-rollout step trains the groups that finished first).
        `holder`: the shard of the process taking it (a reference's), whose death releases
        the lease (`drop_shard`). Raises WouldBlock when not enough are ready yet.
        """
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; the dock's stages are {list(self.stages)}")
        if not columns:
            raise ValueError("columns must name at least one column to fetch")
        self._check_columns(columns)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.expire()

        def ready(e: _Entry) -> bool:
            return (
                stage not in e.acked
                and stage not in e.leased
                and all(c in e.columns for c in columns)
                and (min_version is None or e.info.version >= min_version)
                and e.info.group_id not in self._doomed
            )

        sizes = {self._samples[ids[0]].info.group_size for ids in self._groups.values()}
        if at_least is not None and not 1 <= at_least <= n:
            raise ValueError(f"at_least={at_least} must be in [1, n={n}]")
        if group_ids is None and whole_groups and at_least is None and len(sizes) == 1 \
                and n % (g := sizes.pop()):
            raise ValueError(f"n={n} is not a multiple of the group size {g}; ask for whole "
                             "groups or pass whole_groups=False")
        chosen: list[_Entry] = []
        if group_ids is not None:
            chosen = self._named_groups(group_ids, ready)
        elif whole_groups:
            groups = []
            for ids in self._groups.values():
                es = [self._samples[i] for i in ids]
                if len(es) == es[0].info.group_size and all(ready(e) for e in es):
                    groups.append((min(e.seq for e in es), es))
            for _, es in sorted(groups, key=lambda g: g[0]):
                if len(chosen) + len(es) <= n:
                    chosen += sorted(es, key=lambda e: e.seq)
        else:
            chosen = sorted((e for e in self._samples.values() if ready(e)), key=lambda e: e.seq)
            chosen = chosen[:n]
        if group_ids is None and len(chosen) < (n if at_least is None else at_least):
            raise WouldBlock(f"{len(chosen)} of {n} samples ready for stage {stage!r}")
        lease = Lease(
            lease_id=next(self._lease_ids),
            stage=stage,
            columns=tuple(columns),
            samples=tuple(
                Location(
                    sample_id=e.info.sample_id,
                    group_id=e.info.group_id,
                    length=e.info.length,
                    version=e.info.version,
                    columns={c: e.columns[c][0] for c in columns},
                )
                for e in chosen
            ),
            index_rank=self.index_rank,
        )
        for e in chosen:
            e.leased[stage] = lease.lease_id
        self._leases[lease.lease_id] = (lease, self._clock() + self.lease_timeout_s)
        if holder:
            self._holders[lease.lease_id] = holder
        return lease

    def _named_groups(self, group_ids: Sequence[str], ready: Callable[[_Entry], bool]
                      ) -> list[_Entry]:
        """Every sample of the groups `group_ids`, each group complete and ready; else
        WouldBlock."""
        chosen: list[_Entry] = []
        for gid in group_ids:
            es = [self._samples[i] for i in self._groups.get(gid, [])]
            if not es or len(es) < es[0].info.group_size or not all(ready(e) for e in es):
                raise WouldBlock(f"group {gid!r} is not complete and ready")
            chosen += sorted(es, key=lambda e: e.seq)
        return chosen

    def ack(self, lease_id: int) -> AckResult:
        """Mark a lease's samples consumed by its stage; evict those every stage consumed."""
        lease = self._pop_lease(lease_id)
        evict: dict[str, list[str]] = {}
        acked: dict[str, list[str]] = {}
        for loc in lease.samples:
            e = self._samples[loc.sample_id]
            e.acked.add(lease.stage)
            acked.setdefault(e.info.shard, []).append(loc.sample_id)
            if e.acked.issuperset(self.stages):
                for shard in self._remove(loc.sample_id):
                    evict.setdefault(shard, []).append(loc.sample_id)
        self._settle(lease)
        return AckResult(stage=lease.stage, evict=evict, acked=acked)

    def release(self, lease_id: int) -> None:
        """Return a lease's samples to the pool (the consumer failed or gave up)."""
        self._settle(self._pop_lease(lease_id))

    def _pop_lease(self, lease_id: int) -> Lease:
        item = self._leases.pop(lease_id, None)
        self._holders.pop(lease_id, None)
        if item is None:
            raise LeaseError(f"lease {lease_id} is not active (acked, released or expired)")
        lease = item[0]
        for loc in lease.samples:
            e = self._samples.get(loc.sample_id)
            if e is not None and e.leased.get(lease.stage) == lease_id:
                del e.leased[lease.stage]
        return lease

    def expire(self) -> list[int]:
        """Release leases past their deadline; returns their ids."""
        now = self._clock()
        dead = [lid for lid, (_, deadline) in self._leases.items() if deadline <= now]
        for lid in dead:
            self._settle(self._pop_lease(lid))
        return dead

    # -- faults and eviction ----------------------------------------------------------------

    def drop_shard(self, shard: str) -> dict[str, list[str]]:
        """A shard died: the leases its process held go back to the pool; columns it held that
        a stage added under its name (`add_columns`: the reference's ``ref_logprobs``) are
        forgotten and that stage writes them again, nothing else of their samples is lost;
        the groups of the samples it registered (or held unnamed columns of) go to
        `take_lost`. Returns evictions elsewhere.

        A lease in flight keeps its samples: a consumer that fetched them before the death
        acks them (trained once, not played again); one whose fetch fails on the dead shard
        releases them. A lost group is handed out no more, and reported lost once no lease
        holds it (`take_evictions`: the other shards' columns of groups lost later).
        """
        for lid in [lid for lid, h in self._holders.items() if h == shard]:
            self._settle(self._pop_lease(lid))
        hit_groups: set[str] = set()
        for e in self._samples.values():
            cols = [c for c, (s, _) in e.columns.items() if s == shard]
            if not cols:
                continue
            if e.info.shard == shard or any(c not in e.writers for c in cols):
                hit_groups.add(e.info.group_id)
                continue
            for c in cols:
                del e.columns[c]
                e.acked.discard(e.writers.pop(c))
        evict: dict[str, list[str]] = {}
        for gid in hit_groups:
            self._doomed.setdefault(gid, shard)
            self._lose_if_free(gid, evict)
        return evict

    def _settle(self, lease: Lease) -> None:
        """A lease ended: the lost groups it held are reported lost if nothing holds them."""
        for gid in {loc.group_id for loc in lease.samples} & self._doomed.keys():
            self._lose_if_free(gid, self._evictions)

    def _lose_if_free(self, gid: str, evict: dict[str, list[str]]) -> None:
        """Group `gid`, whose shard died, goes to `take_lost` once no lease holds any of its
        samples (what every stage consumed meanwhile was evicted: not lost)."""
        ids = self._groups.get(gid, [])
        if any(self._samples[sid].leased for sid in ids):
            return
        shard = self._doomed.pop(gid)
        for sid in list(ids):
            e = self._samples[sid]
            missing = tuple(sorted(c for c, (s, _) in e.columns.items() if s == shard))
            self._report_lost(LostSample(sid, gid, missing))
            for s in self._remove(sid):
                if s != shard:
                    evict.setdefault(s, []).append(sid)

    def take_evictions(self) -> dict[str, list[str]]:
        """Columns to evict from live shards: those of groups lost when a lease that held them
        ended (`drop_shard` returns the rest itself); clears the list."""
        out, self._evictions = self._evictions, {}
        return out

    def retract_shard(self, shard: str, stage: str) -> int:
        """A shard that holds only columns `stage` added (the reference's ``ref_logprobs``) is
        leaving on purpose: its columns are removed and `stage` may take those samples again,
        so the stage's next shard writes them anew. Returns the samples retracted.

        Raises:
            ValueError: `stage` is unknown; the shard holds samples it registered (they cannot
                be written again by `stage`: stop it like a dead one, `drop_shard`); or a
                lease in flight names its columns (retract between steps).
        """
        if stage not in self.stages:
            raise ValueError(f"unknown stage {stage!r}; the dock's stages are {list(self.stages)}")
        hit = [e for e in self._samples.values()
               if any(s == shard for s, _ in e.columns.values())]
        if own := [e.info.sample_id for e in hit if e.info.shard == shard]:
            raise ValueError(f"shard {shard!r} registered {len(own)} sample(s) (e.g. "
                             f"{own[0]!r}): only a shard of added columns can be retracted")
        if busy := sorted({lid for e in hit for lid in e.leased.values()}):
            raise ValueError(f"shard {shard!r} has columns in lease(s) {busy} in flight: "
                             "retract it between steps, once they are acked or released")
        for e in hit:
            for c in [c for c, (s, _) in e.columns.items() if s == shard]:
                del e.columns[c]
                e.writers.pop(c, None)
            e.acked.discard(stage)
        return len(hit)

    def evict_stale(self, min_version: int) -> dict[str, list[str]]:
        """Drop samples older than `min_version` (reported as lost for re-production)."""
        stale_groups = {e.info.group_id for e in self._samples.values()
                        if e.info.version < min_version}
        evict: dict[str, list[str]] = {}
        for gid in stale_groups:
            for sid in list(self._groups.get(gid, [])):
                self._report_lost(LostSample(sid, gid, ()))
                for s in self._remove(sid):
                    evict.setdefault(s, []).append(sid)
        return evict

    def _report_lost(self, lost: LostSample) -> None:
        """`lost` goes to `take_lost`, and its group is owed the room it leaves (`register`)."""
        self._lost.append(lost)
        self._owed[lost.group_id] = self._owed.get(lost.group_id, 0) + 1

    def take_lost(self) -> list[LostSample]:
        """Samples that must be produced again (shard died, or stale); clears the list."""
        out, self._lost = self._lost, []
        return out

    def _remove(self, sample_id: str) -> set[str]:
        e = self._samples.pop(sample_id)
        for lid in set(e.leased.values()):  # leases touching a removed sample are void
            if lid in self._leases:
                self._pop_lease(lid)
        ids = self._groups[e.info.group_id]
        ids.remove(sample_id)
        if not ids:
            del self._groups[e.info.group_id]
        return {s for s, _ in e.columns.values()}

    # -- introspection and recovery ---------------------------------------------------------

    def location(self, sample_id: str) -> dict[str, str]:
        return {c: s for c, (s, _) in self._samples[sample_id].columns.items()}

    def resident(self, stage: str) -> list[str]:
        """Ids of the samples held here that `stage` has not acked (ready or leased)."""
        return [sid for sid, e in self._samples.items() if stage not in e.acked]

    def statistics(self) -> DockStatistics:
        ready: dict[str, int] = {}
        per_shard: dict[str, int] = {}
        consumed = {s: 0 for s in self.stages}
        for e in self._samples.values():
            for c, (s, nb) in e.columns.items():
                ready[c] = ready.get(c, 0) + 1
                per_shard[s] = per_shard.get(s, 0) + nb
            for s in e.acked:
                consumed[s] += 1
        return DockStatistics(
            samples=len(self._samples),
            capacity=self.capacity,
            ready=ready,
            bytes_per_shard=per_shard,
            leased=sum(len(lease.samples) for lease, _ in self._leases.values()),
            consumed=consumed,
            lost=len(self._lost),
            waiting_producers=self.waiting_producers,
            waiting_consumers=self.waiting_consumers,
        )

    def restore(
        self,
        infos: Iterable[tuple[SampleInfo, Iterable[str]]],
        extra: Iterable[tuple[str, str, Mapping[str, int]]] = (),
    ) -> None:
        """Rebuild after an index restart from the shards' reports.

        Args:
            infos: (registration, stages that acked it) from each sample's producer shard.
            extra: (sample_id, shard, columns) added later on other shards.
        Leases in flight at the crash are forgotten, so their samples become available again.
        """
        for info, acked in infos:  # in production order, so FIFO survives
            cols = {c: (info.shard, nb) for c, nb in info.columns.items()}
            self._samples[info.sample_id] = _Entry(
                info=info, seq=next(self._seq), columns=cols, acked=set(acked)
            )
            self._groups.setdefault(info.group_id, []).append(info.sample_id)
        for sid, shard, columns in extra:
            if sid in self._samples:
                self.add_columns(sid, shard, columns)
