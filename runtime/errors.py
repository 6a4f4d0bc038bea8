"""Exceptions raised by the actor runtime at the caller, and failures as data.

`ActorError` wraps a failure inside an actor (with the remote traceback); `ActorDied` means the
actor process is gone (or restarting) and the call never completed; `BadCall` means the actor
rejected the request itself (unknown endpoint, wrong arguments, malformed or oversized frame).

Failures are data: code that acts on one reads these fields, never the message text (messages
are for people). An `ActorDied` names the actor (`group`, `rank`, `kind`), why it is gone
(`cause`, with `exit_code` or `signal` when known) and the `call` it interrupted when known. An
`ActorError` names the actor and the endpoint (`call`) that raised, and carries as `deaths`
every actor death that caused it (`deaths_in`: through exception groups, `__cause__` and
`__context__`, nested `ActorError`s and `CausedByDeath` errors such as the dock's
`DockFetchError`), so a death two actors away still reaches the driver as fields.

On the wire an ERR frame's body is `[type, message, traceback, record]`, the record a plain map
(`ErrorRecord`, deaths as `DeathRecord`s) that names no code; `error_from_wire` checks every
field's type and drops what does not fit, so a garbled or forged record never crashes the caller.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Literal, TypedDict, cast, get_args

Cause = Literal["exited", "killed", "oom", "connection_lost", "unreachable", "unavailable",
                "failed", "stopped", "shutdown", "unknown"]
"""Why an actor is gone, as far as the runtime knows:

- exited: its process exited by itself (`exit_code`);
- killed: a signal ended its process (`signal`);
- oom: its slot's OOM killer ended its process (`signal` is SIGKILL);
- connection_lost: its connection closed or broke the protocol with calls in flight (the process
  may still run: its runtime then kills it and it restarts like any dead actor);
- unreachable: nothing accepted a connection at its address;
- unavailable: no live replica could serve the call in time;
- failed: it raised while serving a call that treats its failure as its death (a warehouse
  shard during a dock fetch);
- stopped: its owner stopped the group (not a fault);
- shutdown: this process' runtime shut down;
- unknown: the runtime was not told (e.g. the directory reports the rank restarting or dead).
"""
CAUSES: frozenset[str] = frozenset(get_args(Cause))
MAX_DEATHS = 16  # deaths one ERR frame carries
_MAX_NAME = 256  # longest group, kind or endpoint name taken from the wire
_MAX_REASON = 2000


class DeathRecord(TypedDict):
    """An `ActorDied` on the wire."""

    group: str
    rank: int | None
    kind: str | None
    cause: str
    exit_code: int | None
    signal: int | None
    call: str | None
    reason: str


class ErrorRecord(TypedDict):
    """The data of an ERR frame: the failing actor's class, its endpoint, and the deaths."""

    kind: str | None
    call: str | None
    died: list[DeathRecord]


def actor_label(group: str, rank: int | None) -> str:
    """ "group[rank]", or "group" when the failure names no rank."""
    return group if rank is None else f"{group}[{rank}]"


def split_label(label: str) -> tuple[str, int | None]:
    """(group, rank) of a label made by `actor_label` (or `ActorGroup.label`)."""
    group, bracket, rest = label.rpartition("[")
    digits = rest[:-1]
    if bracket and rest.endswith("]") and digits.isascii() and digits.isdigit() \
            and len(digits) <= 9:
        return group, int(digits)
    return label, None


class ActorError(Exception):
    """An endpoint raised inside an actor.

    Attributes:
        actor: "name[rank]" of the actor that failed (`group` and `rank` as data).
        remote_type: qualified name of the exception type raised remotely.
        remote_message: str() of the remote exception.
        remote_traceback: the formatted traceback from the actor process.
        kind: the failing actor's class name (None: not reported).
        call: the endpoint that raised (None: not reported).
        deaths: the actor deaths that caused the failure, nearest first (see `deaths_in`).
    """

    def __init__(self, actor: str, remote_type: str, remote_message: str,
                 remote_traceback: str = "", *, kind: str | None = None, call: str | None = None,
                 deaths: tuple[ActorDied, ...] = ()) -> None:
        self.actor = actor
        self.group, self.rank = split_label(actor)
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        self.kind, self.call, self.deaths = kind, call, deaths
        super().__init__(f"{remote_type} in actor {actor}: {remote_message}")

    @property
    def died(self) -> ActorDied | None:
        """The nearest actor death behind this failure, if any."""
        return self.deaths[0] if self.deaths else None

    def __str__(self) -> str:
        head = f"{self.remote_type} in actor {self.actor}: {self.remote_message}"
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return head

    def __reduce__(self) -> tuple[Any, ...]:  # for users who pickle locally (never on the wire)
        return (type(self), (self.actor, self.remote_type, self.remote_message,
                             self.remote_traceback), self.__dict__.copy())


class BadCall(ActorError, TypeError):
    """The actor rejected a request: unknown endpoint, wrong arguments, or a bad frame."""


class ActorDied(RuntimeError):
    """The actor process died (or is restarting); the call did not complete.

    Attributes:
        actor: "group[rank]" for messages ("group" when no rank is known).
        group: the actor's group name.
        rank: its rank (None: the group as a whole, e.g. no replica could serve).
        kind: its class name, when known.
        cause: why it is gone (`Cause`).
        exit_code: its process' exit status, when it exited by itself.
        signal: the signal that ended its process, when one did.
        call: the endpoint whose call it interrupted, when known.
        reason: one sentence for people (never parsed).

    `group` and `rank` default to the parts of the `actor` label.
    """

    def __init__(self, actor: str, reason: str, *, group: str | None = None,
                 rank: int | None = None, kind: str | None = None, cause: Cause = "unknown",
                 exit_code: int | None = None, signal: int | None = None,
                 call: str | None = None) -> None:
        if group is None:
            group, rank = split_label(actor)
        self.actor, self.reason = actor, reason
        self.group, self.rank, self.kind = group, rank, kind
        self.cause: Cause = cause
        self.exit_code, self.signal, self.call = exit_code, signal, call
        super().__init__(f"actor {actor} died: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.actor, self.reason), self.__dict__.copy())

    def to_wire(self) -> DeathRecord:
        return DeathRecord(group=self.group, rank=self.rank, kind=self.kind, cause=self.cause,
                           exit_code=self.exit_code, signal=self.signal, call=self.call,
                           reason=self.reason[:_MAX_REASON])

    @classmethod
    def from_wire(cls, value: object) -> ActorDied | None:
        """The death a received `DeathRecord` describes; None when it names no actor. Fields of
        the wrong type are left unknown (an unknown cause reads "unknown")."""
        if not isinstance(value, dict):
            return None
        group, rank = value.get("group"), value.get("rank")
        if not isinstance(group, str) or not 0 < len(group) <= _MAX_NAME \
                or rank is not None and _int(rank, 0, 2**31 - 1) is None:
            return None  # whose death it is must be exact: a garbled name is no claim at all
        cause = value.get("cause")
        reason = value.get("reason")
        return cls(actor_label(group, rank),
                   reason[:_MAX_REASON] if isinstance(reason, str) else "(no reason given)",
                   group=group, rank=rank, kind=_name(value.get("kind")),
                   cause=cast(Cause, cause) if isinstance(cause, str) and cause in CAUSES
                   else "unknown",
                   exit_code=_int(value.get("exit_code"), -(2**31), 2**31 - 1),
                   signal=_int(value.get("signal"), 1, 255), call=_name(value.get("call")))


class FieldError(ValueError):
    """A config dataclass refused one of its fields' values; `field` names it (relative to the
    dataclass: `earl.config.from_dict` prefixes the section, e.g. "algorithm.clip_low")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def need(ok: bool, field: str, message: str) -> None:
    """Raise `FieldError(field, message)` unless `ok` (a config's `__post_init__` checks)."""
    if not ok:
        raise FieldError(field, message)


class CausedByDeath(RuntimeError):
    """Base of errors raised because another actor died (or failed as if dead) under the call;
    `died` says which (e.g. `earl.runtime.dock.DockFetchError`)."""

    died: ActorDied


def _int(v: object, lo: int, hi: int) -> int | None:
    return v if type(v) is int and lo <= v <= hi else None  # bools are not ints here


def _name(v: object) -> str | None:
    return v if isinstance(v, str) and 0 < len(v) <= _MAX_NAME else None


def causes(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then breadth first the members of its exception groups and each exception's
    `__cause__` and `__context__`, each once."""
    seen: set[int] = set()
    todo: deque[BaseException] = deque([exc])
    while todo:
        e = todo.popleft()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(n for n in (e.__cause__, e.__context__) if n is not None)


def deaths_in(exc: BaseException, limit: int | None = None) -> list[ActorDied]:
    """Every actor death behind `exc` (`causes`), nearest first (at most `limit`): `exc`
    itself if it is an `ActorDied`, the deaths an `ActorError` carries, the `died` of a
    `CausedByDeath`; then the same for the exceptions behind it.
    """
    found: list[ActorDied] = []
    counted: set[int] = set()
    for e in causes(exc):
        if limit is not None and len(found) >= limit:
            break
        carried: tuple[ActorDied, ...] = ()
        if isinstance(e, ActorDied):
            carried = (e,)
        elif isinstance(e, ActorError):
            carried = e.deaths
        elif isinstance(e, CausedByDeath):
            carried = (e.died,)
        for d in carried:
            if id(d) not in counted:
                counted.add(id(d))
                found.append(d)
    return found if limit is None else found[:limit]


def error_record(exc: BaseException, *, kind: str | None, call: str | None) -> ErrorRecord:
    """The data an actor sends with an ERR frame for `exc`, raised by endpoint `call`."""
    return ErrorRecord(kind=kind, call=call,
                       died=[d.to_wire() for d in deaths_in(exc, MAX_DEATHS)])


def error_from_wire(actor: str, value: object) -> ActorError:
    """The `ActorError` a received ERR body (`[type, message, traceback, record]`) describes.

    A body without its three strings is a `BadCall`; a record (or any of its deaths) of the
    wrong shape is left out, the error itself still surfaces.
    """
    if not isinstance(value, (list, tuple)) or len(value) < 3 \
            or not all(isinstance(v, str) for v in value[:3]):
        return BadCall(actor, "WireError", "malformed error reply: want [type, message, "
                                           "traceback, record]")
    typ, msg, tb = value[:3]
    rec = value[3] if len(value) > 3 and isinstance(value[3], dict) else {}
    died = rec.get("died")
    deaths = tuple(d for d in map(ActorDied.from_wire, died[:MAX_DEATHS]) if d is not None) \
        if isinstance(died, list) else ()
    return ActorError(actor, typ, msg, tb, kind=_name(rec.get("kind")),
                      call=_name(rec.get("call")), deaths=deaths)
