"""The EARL actor runtime: actors in their own processes, typed RPC, supervision, launchers.

Public surface (see the README section "The actor runtime"):

    from earl.runtime import Actor, endpoint, Runtime, ActorGroup, ActorError, ActorDied

Data-plane pieces (transport, dock, dispatch) live in sibling modules and are not re-exported
here.
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
