"""Where data-plane receivers bind, and the HMAC that frames carry when they leave the host.

Receivers bind loopback unless a host is configured. Binding anything else needs a secret: the
one given, else the run's (`Runtime` sets it with `set_run_secret`: the per-run secret over
TCP, or `RuntimeConfig.secret`). Frames to such a receiver carry an HMAC-SHA256 under a key
derived from that secret and a channel id, over a sequence number and every byte, so data from
whoever lacks the secret, or replayed, reordered or tampered, is dropped before it is used.
This module only decides and computes; the transports (`zmq`, `torch_dist`) apply it.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from collections.abc import Iterable

from earl.runtime.transport.base import Buffer, TransportError, as_bytes_view

__all__ = ["LOOPBACK", "Mac", "advertised", "is_loopback", "key_for", "run_secret",
           "set_run_secret"]

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAC_LEN = 32
_run_secret: list[bytes | None] = [None]


def set_run_secret(secret: bytes | None) -> None:
    """The run's secret, used by receivers bound off loopback (set by `Runtime`)."""
    _run_secret[0] = secret


def run_secret() -> bytes | None:
    return _run_secret[0]


def is_loopback(host: str) -> bool:
    return host in LOOPBACK or host.startswith("127.")


def advertised(host: str) -> str:
    """The address peers dial for a receiver bound to `host` (a wildcard: this node's name)."""
    return socket.gethostname() if host in ("0.0.0.0", "::", "") else host


def key_for(host: str, secret: bytes | None, transport: str,
            authenticate: bool | None = None) -> bytes | None:
    """The secret to authenticate frames with; None when they need none.

    Args:
        host: the receiver's bind (or dialled) host.
        secret: explicit secret; None means the run's.
        transport: its name, for the error.
        authenticate: force (True) or skip (False); None: only off loopback. Both ends of a
            channel must agree.

    Raises:
        ValueError: authentication is needed and neither `secret` nor the run's secret is set.
    """
    if not (not is_loopback(host) if authenticate is None else authenticate):
        return None
    key = secret if secret is not None else run_secret()
    if key is None:
        raise ValueError(f"{transport} receiver on {host!r} (off loopback) needs a secret to "
                         "authenticate its data: run with RuntimeConfig(tcp=True) or "
                         "RuntimeConfig(secret=...), or pass secret= to the transport")
    return key


class Mac:
    """HMAC-SHA256 of one channel's frames, each bound to its sequence number."""

    def __init__(self, secret: bytes, channel: bytes) -> None:
        self.key = hmac.digest(secret, b"earl-data-v1" + channel, "sha256")

    def digest(self, seq: int, parts: Iterable[Buffer]) -> bytes:
        m = hmac.new(self.key, seq.to_bytes(8, "little"), hashlib.sha256)
        for p in parts:
            m.update(as_bytes_view(p))
        return m.digest()

    def check(self, seq: int, parts: Iterable[Buffer], mac: Buffer) -> None:
        """Raises TransportError unless `mac` is this channel's MAC of `parts` at `seq`."""
        if not hmac.compare_digest(self.digest(seq, parts), bytes(as_bytes_view(mac))):
            raise TransportError("data frame failed authentication (wrong secret, replayed or "
                                 "tampered); dropped")
