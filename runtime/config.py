"""Configuration of the actor runtime: `RuntimeConfig` (where and how) and `RestartPolicy`.

Plain validated dataclasses; nothing here starts anything.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

LAUNCHERS = ("local", "ray")
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(kw_only=True, slots=True, frozen=True)
class RestartPolicy:
    """What a supervisor does when an actor process dies.

    Args:
        max_restarts: restarts allowed per rank within `window_s` (0 = never restart).
        window_s: the span the restarts count over, as an Erlang supervisor's intensity over
            its period: a rank dies for good at a death that finds `max_restarts` restarts
            within the last `window_s` seconds; older ones no longer count (0 = the group's
            life: every restart counts).
        backoff_s: delay before the first restart; doubles for each further restart of a rank
            within the window, capped at `max_backoff_s`.
    """

    max_restarts: int = 0
    window_s: float = 0.0
    backoff_s: float = 0.2
    max_backoff_s: float = 10.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"RestartPolicy.max_restarts must be >= 0, got {self.max_restarts}")
        if self.backoff_s < 0 or self.max_backoff_s < 0 or self.window_s < 0:
            raise ValueError("RestartPolicy.backoff_s, max_backoff_s and window_s must be >= 0")

    def recent(self, times: list[float], now: float) -> list[float]:
        """The restart times (`time.monotonic()`) that still count at `now`."""
        return [t for t in times if not self.window_s or now - t < self.window_s]

    def delay(self, restarts_so_far: int) -> float:
        return min(self.backoff_s * (2 ** restarts_so_far), self.max_backoff_s)


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    """Where actors run and how they talk.

    Args:
        launcher: "local" (child processes of this one) or "ray" (one Ray actor per actor
            process, in a placement group).
        host: address actors bind for TCP. Local actors use unix sockets unless `tcp=True`.
            Anything but loopback requires `secret`.
        tcp: use TCP even for local actors (the ray launcher always uses TCP).
        secret: shared secret; when set every frame carries an HMAC-SHA256 and a peer must
            prove it before it may send more than a small frame. Defaults to $EARL_RPC_SECRET
            if set; over TCP (loopback included) a runtime without one draws a per-run secret
            and hands it to its actors, so TCP is never unauthenticated. Unix sockets are
            private to the user (mode 0600) and need none.
        max_message_bytes: largest frame accepted or sent (bigger data: earl.runtime.transport).
        run_dir: directory for sockets and logs (default: a fresh temp dir, removed on exit).
        connect_timeout_s: how long a connect or a spawn handshake may take.
        ray_address: passed to ray.init() when the ray launcher starts Ray itself.
        ray_resources: group name -> a Ray custom resource (one a node was started with,
            `ray start --resources='{"earl_host_b": 100}'`): the ray launcher places that
            group's ranks on such a node.
        ray_gpus: group name -> GPUs each rank's Ray bundle reserves (ray launcher).
        actor_log: a file that local actors' stdout and stderr are appended to (library
            warnings, progress bars); None: they write to this process' stdout and stderr.
    """

    launcher: str = "local"
    host: str = "127.0.0.1"
    tcp: bool = False
    secret: str | bytes | None = None
    max_message_bytes: int = 256 << 20
    run_dir: str | None = None
    connect_timeout_s: float = 60.0
    ray_address: str | None = None
    ray_resources: dict[str, str] = field(default_factory=dict)
    ray_gpus: dict[str, float] = field(default_factory=dict)
    actor_log: str | None = None

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"RuntimeConfig.launcher must be one of {LAUNCHERS}, "
                             f"got {self.launcher!r}")
        if self.max_message_bytes < 4096:
            raise ValueError("RuntimeConfig.max_message_bytes must be >= 4096, "
                             f"got {self.max_message_bytes}")
        for name in ("ray_resources", "ray_gpus"):
            if getattr(self, name) and self.launcher != "ray":
                raise ValueError(f"RuntimeConfig.{name} places actors through Ray: set "
                                 f"launcher='ray', or leave {name} empty")
        if any(g < 0 for g in self.ray_gpus.values()):
            raise ValueError(f"RuntimeConfig.ray_gpus must be >= 0 per group, got {self.ray_gpus}")
        if self.secret is None and os.environ.get("EARL_RPC_SECRET"):
            self.secret = os.environ["EARL_RPC_SECRET"]
        if self.secret is not None and len(self.secret) < 16:
            raise ValueError("RuntimeConfig.secret must be at least 16 characters")
        if self.host not in _LOOPBACK and self.secret is None:
            raise ValueError(f"RuntimeConfig.host={self.host!r} is not loopback: set "
                             "RuntimeConfig.secret (or $EARL_RPC_SECRET) so frames are "
                             "authenticated, or bind 127.0.0.1")

    @property
    def secret_bytes(self) -> bytes | None:
        s = self.secret
        return s.encode() if isinstance(s, str) else s

    @property
    def use_tcp(self) -> bool:
        return self.tcp or self.launcher == "ray"
