"""One producer -> consumer pair's transport, picked from the two ends' hosts.

Every data flow of a job (warehouse -> reference, warehouse -> trainer leader, trainer ->
rollout replica) runs between a producer that sends frames and a consumer that owns the
receiver. The consumer learns the producer's `host_id()` (or is told it along with the request
for its address) and picks with `transport.choose`: ``shm`` on the same host, ``ucx`` (ucxx
over TCP) when ucxx imports, else ``zmq``, across hosts.

- `Inbox`: a consumer's receivers, at most one per transport kind, each made on first use.
  Network receivers listen on `node_address()` and authenticate every frame under the run's
  secret (see `auth`; loopback included), so a run that crosses hosts must have one (it does over
  TCP: `RuntimeConfig(tcp=True)`, or `secret=`).
- `open_sender(address)`: the producer's sender for any receiver address, with the options
  the receiver's kind was made with (both ends must agree on authentication).

`$EARL_TRANSPORT` (``shm``, ``ucx`` or ``zmq``) forces one kind for every pair of a process;
the run loop sets it in every actor from ``placement.transport`` when that is set. UCX is
restricted to its TCP transport unless `$UCX_TLS` is set (then UCX's variable decides, e.g.
``rc`` on an RDMA cluster).

Not here: host ids and advertised addresses (`earl.runtime.locality`), the transports
themselves, what the frames carry.
"""

from __future__ import annotations

import os

from earl.runtime.locality import host_id, node_address, same_host
from earl.runtime.transport import Receiver, Sender, choose, connect, get_transport

__all__ = ["ENV_PREFER", "KINDS", "Inbox", "open_sender", "pick", "preferred"]

ENV_PREFER = "EARL_TRANSPORT"
KINDS = ("shm", "ucx", "zmq")  # what a pair of actor processes can use without a rendezvous


def preferred() -> str | None:
    """The kind `$EARL_TRANSPORT` forces (None: by locality).

    Raises:
        ValueError: it names something other than shm, ucx or zmq.
    """
    prefer = os.environ.get(ENV_PREFER, "")
    if not prefer:
        return None
    if prefer not in KINDS:
        raise ValueError(f"${ENV_PREFER}={prefer!r} (placement.transport) is not a data-plane "
                         f"transport: use one of {', '.join(KINDS)}, or leave it empty to pick "
                         "by locality")
    return prefer


def pick(peer_host: str, prefer: str | None = None) -> str:
    """The kind for a pair of this process and a peer on `peer_host` (a `host_id()`).

    Args:
        peer_host: the other end's host id.
        prefer: force this kind (else `$EARL_TRANSPORT`, else by locality).
    """
    if prefer is not None and prefer not in KINDS:
        raise ValueError(f"transport {prefer!r} cannot carry a data-plane pair: use one of "
                         f"{', '.join(KINDS)}")
    return choose(same_host=same_host(host_id(), peer_host), prefer=prefer or preferred())


def _options(kind: str) -> dict[str, object]:
    """How both ends of a `kind` pair are made: network kinds on this node's address, MAC'd."""
    if kind == "zmq":
        return {"local": False, "host": node_address(), "authenticate": True}
    if kind == "ucx":
        return {"host": node_address(), "authenticate": True,
                "tls": None if os.environ.get("UCX_TLS") else "tcp"}
    return {}


def open_sender(address: str) -> Sender:
    """A sender to a receiver made by an `Inbox` (any kind, from its address scheme)."""
    return connect(address, **_options(address.split("://", 1)[0]))


class Inbox:
    """A consumer's receivers, one per transport kind, made on first use.

    Args:
        prefer: force this kind for every peer (None: `$EARL_TRANSPORT`, else by locality).
    """

    def __init__(self, prefer: str | None = None) -> None:
        if prefer is not None and prefer not in KINDS:
            raise ValueError(f"Inbox prefer={prefer!r}: use one of {', '.join(KINDS)} or None")
        self.prefer = prefer
        self._receivers: dict[str, Receiver] = {}

    def kind_for(self, peer_host: str) -> str:
        """The kind a producer on `peer_host` sends this consumer with."""
        return pick(peer_host, self.prefer)

    def receiver(self, kind: str) -> Receiver:
        """This consumer's `kind` receiver (made now if it is the first use)."""
        if kind not in KINDS:
            raise ValueError(f"no {kind!r} receiver: use one of {', '.join(KINDS)}")
        if kind not in self._receivers:
            self._receivers[kind] = get_transport(kind, **_options(kind)).listen()
        return self._receivers[kind]

    def for_peer(self, peer_host: str) -> Receiver:
        """The receiver a producer on `peer_host` sends to."""
        return self.receiver(self.kind_for(peer_host))

    def close(self) -> None:
        for r in self._receivers.values():
            r.close()
        self._receivers.clear()
