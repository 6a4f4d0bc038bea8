"""The EARL actor runtime: actors in their own processes, typed RPC, supervision, launchers.

    from earl.runtime import Actor, endpoint, Runtime, ActorGroup, ActorError, ActorDied

    class Counter(Actor):
        @endpoint
        async def incr(self, k: int) -> int: ...

    async with Runtime() as rt:
        g = await rt.spawn("counter", Counter, n=2)
        await g.incr.call(1)          # also: call_one, broadcast, choose, stream

Design, and why not ZeroMQ. The control plane is a lean length-prefixed framing (`frames`) over
unix domain sockets (TCP when actors span hosts), driven by asyncio protocols on uvloop:
request ids, futures resolved straight from the protocol callback, and all frames of one
event-loop iteration coalesced into one write. On the 2-core development machine a pyzmq
asyncio DEALER/ROUTER echo took 155-300 us per round trip while this path takes 35-65 us
(a raw blocking unix-socket ping-pong, the floor, is 7-10 us): ZMQ adds its own I/O thread and
a second poll per message, which dominates at this scale. `bench/rpc.py` keeps the ZMQ echo as
a comparison and reports all of these in one run. Values are msgpack; arrays and CPU tensors are
separate zero-copy frame segments; registered dataclasses travel as typed records; nothing from
the network is unpickled. Big tensors belong on `earl.runtime.transport`, not here.

Modules: `wire` (codec), `frames` (framing, HMAC), `conn` / `server` (the two ends), `endpoint`,
`actor` (Actor, ActorGroup, adverbs), `runtime` (spawn, lookup, shutdown), `directory`,
`supervisor` (death, restart), `launch*` (local and Ray), `host` (the actor process).
"""

from earl.runtime import wire as wire
from earl.runtime.actor import Actor as Actor
from earl.runtime.actor import ActorGroup as ActorGroup
from earl.runtime.actor import EndpointRef as EndpointRef
from earl.runtime.actor import context as context
from earl.runtime.config import RestartPolicy as RestartPolicy
from earl.runtime.config import RuntimeConfig as RuntimeConfig
from earl.runtime.endpoint import Endpoint as Endpoint
from earl.runtime.endpoint import endpoint as endpoint
from earl.runtime.errors import ActorDied as ActorDied
from earl.runtime.errors import ActorError as ActorError
from earl.runtime.errors import BadCall as BadCall
from earl.runtime.frames import FrameTooLarge as FrameTooLarge
from earl.runtime.runtime import Runtime as Runtime
from earl.runtime.wire import WireError as WireError

__all__ = [
    "Actor", "ActorDied", "ActorError", "ActorGroup", "BadCall", "Endpoint", "EndpointRef",
    "FrameTooLarge", "RestartPolicy", "Runtime", "RuntimeConfig", "WireError", "context",
    "endpoint", "wire",
]
