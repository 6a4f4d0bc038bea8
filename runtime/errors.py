"""Exceptions raised by the actor runtime at the caller.

`ActorError` wraps a failure inside an actor (with the remote traceback); `ActorDied` means the
actor process is gone (or restarting) and the call never completed; `BadCall` means the actor
rejected the request itself (unknown endpoint, wrong arguments, malformed or oversized frame).
"""

from __future__ import annotations


class ActorError(Exception):
    """An endpoint raised inside an actor.

    Attributes:
        actor: "name[rank]" of the actor that failed.
        remote_type: qualified name of the exception type raised remotely.
        remote_message: str() of the remote exception.
        remote_traceback: the formatted traceback from the actor process.
    """

    def __init__(self, actor: str, remote_type: str, remote_message: str,
                 remote_traceback: str = "") -> None:
        self.actor = actor
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        super().__init__(f"{remote_type} in actor {actor}: {remote_message}")

    def __str__(self) -> str:
        head = f"{self.remote_type} in actor {self.actor}: {self.remote_message}"
        if self.remote_traceback:
            return f"{head}\n\nRemote traceback:\n{self.remote_traceback.rstrip()}"
        return head

    def __reduce__(self):  # keep picklable for users who pickle locally (never on the wire)
        return (type(self), (self.actor, self.remote_type, self.remote_message,
                             self.remote_traceback))


class BadCall(ActorError, TypeError):
    """The actor rejected a request: unknown endpoint, wrong arguments, or a bad frame."""


class ActorDied(RuntimeError):
    """The actor process died (or is restarting); the call did not complete."""

    def __init__(self, actor: str, reason: str) -> None:
        self.actor = actor
        self.reason = reason
        super().__init__(f"actor {actor} died: {reason}")

    def __reduce__(self):
        return (type(self), (self.actor, self.reason))
