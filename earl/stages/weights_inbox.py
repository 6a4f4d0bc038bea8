"""The rollout replica's side of a weight push: where buckets arrive and how they are read.

`WeightInbox.address` answers a `WeightPublisher` that asks where to send, and picks the kind
for that publisher unless it forces one:

- a publisher on this host's same GPU (CUDA, its GPU's UUID equals this replica's): ``ipc``,
  CUDA IPC handles (`earl.stages.weights_ipc`): each bucket is a small RPC message naming a
  buffer in the trainer's GPU memory, mapped here and read in place;
- a publisher elsewhere on CUDA: ``nccl``, a torch.distributed pair (`TorchDistReceiver`)
  over which buckets arrive straight into this GPU's memory;
- on CPU: ``shm`` on this host, else ``ucx`` or ``zmq`` (`transport.route`); ``gloo`` when
  asked for.

gloo and nccl pairs are 1:1 and keyed by the publisher: each `address` call makes a fresh
receiver (a restarted trainer gets a new pair) authenticated with the key the publisher sent
over the control plane. `stream` yields the (name, tensor) pairs of `frames` buckets in
arrival order; it runs in the engine thread, inside the engine's in-place reload, so receiving
and loading overlap. An ``ipc`` bucket is acknowledged (`put_ipc`'s future) once the loader
has consumed its tensors and the GPU has finished copying them: only then may the trainer
overwrite that buffer.

Not here: what the publisher sends (`earl.stages.weights`), vLLM (`earl.stages.vllm_engine`).
"""

from __future__ import annotations

import concurrent.futures
import queue
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from earl.runtime.endpoint import endpoint
from earl.stages.weights_codec import decode_bucket, decode_tensors

if TYPE_CHECKING:
    import torch

    from earl.runtime.transport import Frame, Receiver
    from earl.runtime.transport.route import Inbox
    from earl.stages.weights_ipc import IpcOpener

__all__ = ["COLLECTIVE", "WeightEndpoints", "WeightInbox", "gpu_uuid"]

COLLECTIVE = ("gloo", "nccl")  # torch.distributed pairs: made per publisher, never by locality
_WAIT_S = 60.0  # a bucket that does not arrive within this fails the reload


def gpu_uuid() -> str:
    """The UUID of this process's first GPU ("" without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return ""
    return str(torch.cuda.get_device_properties(0).uuid)


class WeightInbox:
    """Receivers and the IPC mailbox of one rollout replica.

    Args:
        device: the replica's engine device ("cpu" or "cuda").
    """

    def __init__(self, device: str) -> None:
        self.device = device
        self.kind = ""
        self._inbox: Inbox | None = None
        self._receiver: Receiver | None = None
        self._pair: Receiver | None = None  # the gloo/nccl pair in force
        self._ipc: queue.Queue[tuple[dict[str, Any], concurrent.futures.Future[None]]] = \
            queue.Queue()
        self._opener: IpcOpener | None = None

    def choose(self, peer_host: str, prefer: str, peer_gpu: str) -> str:
        """The kind for a publisher on `peer_host` whose GPU is `peer_gpu` ("" on CPU)."""
        from earl.runtime.locality import host_id, same_host

        if prefer:
            return prefer
        if self.device == "cuda":
            here = same_host(host_id(), peer_host or host_id())
            return "ipc" if here and peer_gpu and peer_gpu == gpu_uuid() else "nccl"
        return self._frames().kind_for(peer_host or host_id())

    def address(self, peer_host: str = "", prefer: str = "", peer_gpu: str = "",
                key: bytes = b"") -> str:
        """Where the publisher sends: an address of the chosen kind ("ipc://<gpu uuid>" for
        IPC, whose buckets come through `put_ipc`). `key`: the pair's secret (gloo, nccl)."""
        from earl.runtime.locality import node_address
        from earl.runtime.transport import get_transport

        kind = self.choose(peer_host, prefer, peer_gpu)
        self.kind = kind
        if kind == "ipc":
            from earl.stages.weights_ipc import ipc_available

            if why := ipc_available():
                raise ValueError(f"weights over CUDA IPC: {why}")
            return f"ipc://{gpu_uuid()}"
        if kind in COLLECTIVE:
            if len(key) < 16:
                raise ValueError(f"a {kind} weights pair needs the publisher's key (>= 16 bytes)")
            if self._pair is not None:
                self._pair.close()
            self._pair = get_transport(kind, host=node_address(), secret=key,
                                       authenticate=True).listen()
            self._receiver = self._pair
        else:
            self._receiver = self._frames().receiver(kind)
        return str(self._receiver.address)

    def _frames(self) -> Inbox:
        from earl.runtime.transport.route import Inbox

        if self._inbox is None:
            self._inbox = Inbox()
        return self._inbox

    def put_ipc(self, message: dict[str, Any]) -> concurrent.futures.Future[None]:
        """Queue one IPC bucket for the reload in progress; the future resolves once it is
        loaded (the trainer may then reuse its buffer)."""
        if not isinstance(message, dict):
            raise TypeError(f"an IPC weights bucket is a dict, got {type(message).__name__}")
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._ipc.put((message, done))
        return done

    def stream(self, frames: int, got: list[Frame]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of the next `frames` buckets (runs in the engine thread). Frames read
        are appended to `got`; the caller releases them once the reload is done."""
        if frames and not self.kind:
            raise ValueError("commit_weights(frames>0) before weights_address()")
        for _ in range(frames):
            if self.kind == "ipc":
                yield from self._ipc_bucket()
                continue
            assert self._receiver is not None
            frame = self._receiver.recv(_WAIT_S)
            got.append(frame)
            tensors = getattr(frame, "tensors", None)
            if tensors:  # nccl: the bucket is already in this GPU's memory
                yield from decode_tensors(frame.header, tensors)
            else:
                yield from decode_bucket(frame.header, frame.buffers)

    def _ipc_bucket(self) -> Iterator[tuple[str, torch.Tensor]]:
        import torch

        from earl.stages.weights_ipc import IpcOpener

        try:
            message, done = self._ipc.get(timeout=_WAIT_S)
        except queue.Empty:
            raise TimeoutError(f"no IPC weights bucket within {_WAIT_S:.0f} s") from None
        try:
            if self._opener is None:
                self._opener = IpcOpener()
            yield from self._opener.open(message)
            torch.cuda.synchronize()  # the copies out of the trainer's buffer are done
        except BaseException as exc:
            done.set_exception(exc)
            raise
        done.set_result(None)

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
        if self._pair is not None:
            self._pair.close()
        if self._opener is not None:
            self._opener.close()
        self._inbox = self._pair = self._receiver = self._opener = None


class WeightEndpoints:
    """The endpoints through which a `WeightPublisher` reaches a replica, for an actor class
    that mixes this in and sets ``self.weights = WeightInbox(device)``; the actor's own
    ``commit_weights`` reads `WeightInbox.stream` into its model."""

    weights: WeightInbox

    @endpoint
    async def weights_address(self, peer_host: str = "", transport: str = "",
                              peer_gpu: str = "", key: bytes = b"") -> str:
        """Where `WeightPublisher` sends buckets, for a publisher on `peer_host` (a
        `host_id()`; empty: this host) on GPU `peer_gpu` (its UUID; empty on CPU): the kind
        `transport` names, else by locality (`WeightInbox`). `key`: a gloo/nccl pair's secret."""
        return self.weights.address(peer_host, transport, peer_gpu, key)

    @endpoint
    async def ipc_bucket(self, message: dict[str, Any]) -> None:
        """One bucket over CUDA IPC for the reload in progress; returns once it is loaded."""
        import asyncio

        await asyncio.wrap_future(self.weights.put_ipc(message))
