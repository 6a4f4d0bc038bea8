"""The dock's fetch picks its transport by locality, between real actor processes.

Two "hosts" are faked with `$EARL_HOST_ID` (runtime/locality.py): processes that declare
different host ids must not share memory, so a warehouse on "host-b" sends to a consumer on
"host-a" over the network (ucx, or zmq when forced), authenticated under the run's secret,
while a warehouse on the consumer's host keeps shm. The real namespace hosts are tests/hosts.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from earl.runtime import Actor, Runtime, RuntimeConfig, context, endpoint
from earl.runtime.dock import Dock, IndexActor, WarehouseActor
from earl.runtime.locality import ENV_ADDRESS, ENV_HOST_ID
from earl.runtime.transport import available
from earl.runtime.transport.route import ENV_PREFER

pytestmark = pytest.mark.timeout(120)


class Consumer(Actor):
    """Takes and fetches a lease the way the reference and the trainer leaders do."""

    def __init__(self, index: str = "dock") -> None:
        self.index = index

    @endpoint
    async def fetch(self, n: int) -> tuple[dict[str, list[int]], dict[str, int], list[str]]:
        """(sample id -> its "input_ids", bytes per transport kind, each kind's receiver address)."""
        dock = Dock(await context().lookup(self.index))
        lease = await dock.take("train", ["input_ids"], n, whole_groups=False, timeout_s=30)
        batch, frames = await dock.fetch(lease)
        got = {sid: batch[sid]["input_ids"].tolist() for sid in batch}
        for f in frames:
            f.release()
        await dock.ack(lease)
        kinds = dock.fetched_bytes()
        addresses = [dock.inbox.receiver(k).address for k in sorted(kinds)]
        dock.close()
        return got, kinds, addresses


async def _run(consumer_env: dict[str, str], stores: dict[str, str]
               ) -> tuple[dict[str, list[int]], dict[str, int], list[str]]:
    """Stores named -> their host id each put one sample; the consumer fetches them all."""
    async with Runtime(RuntimeConfig(tcp=True)) as rt:  # over TCP: the run has a secret
        await rt.spawn("dock", IndexActor, stages=["train"], capacity=16)
        for i, (name, host) in enumerate(stores.items()):
            store = await rt.spawn(name, WarehouseActor, "dock", env={ENV_HOST_ID: host})
            await store.put.call_one(f"s{i}", {"input_ids": np.arange(1000, dtype=np.int64) + i,
                                               "versions": np.zeros(1000, np.int32)}, f"g{i}", 1)
        consumer = await rt.spawn("consumer", Consumer, env=consumer_env)
        return await consumer.fetch.call_one(len(stores))


def _check(got: dict[str, list[int]], n: int) -> None:
    assert sorted(got) == [f"s{i}" for i in range(n)]
    for i in range(n):
        assert got[f"s{i}"] == list(range(i, 1000 + i))


async def test_same_host_fetch_stays_on_shm() -> None:
    got, kinds, _ = await _run({ENV_HOST_ID: "host-a"}, {"store_a": "host-a"})
    _check(got, 1)
    assert set(kinds) == {"shm"} and kinds["shm"] >= 8000


async def test_cross_host_fetch_goes_over_the_network_from_the_node_address() -> None:
    want = "ucx" if available("ucx") else "zmq"
    got, kinds, addresses = await _run({ENV_HOST_ID: "host-a"}, {"store_b": "host-b"})
    _check(got, 1)
    assert set(kinds) == {want} and kinds[want] >= 8000
    # zmq: the receiver listens on $EARL_NODE_ADDRESS (any 127/8 address reaches lo)
    got, kinds, addresses = await _run(
        {ENV_HOST_ID: "host-a", ENV_PREFER: "zmq", ENV_ADDRESS: "127.0.0.2"},
        {"store_b": "host-b"})
    _check(got, 1)
    assert set(kinds) == {"zmq"} and addresses[0].startswith("zmq://tcp://127.0.0.2:")


async def test_mixed_hosts_use_one_receiver_per_kind() -> None:
    got, kinds, _ = await _run({ENV_HOST_ID: "host-a"},
                               {"store_a": "host-a", "store_b": "host-b", "store_c": "host-c"})
    _check(got, 3)
    net = "ucx" if available("ucx") else "zmq"
    assert set(kinds) == {"shm", net}
    assert kinds["shm"] >= 8000 and kinds[net] >= 16000  # two remote shards, one receiver


async def test_forcing_a_transport_that_cannot_pair_actors_names_the_setting() -> None:
    async with Runtime(RuntimeConfig(tcp=True)) as rt:
        await rt.spawn("dock", IndexActor, stages=["train"], capacity=16)
        store = await rt.spawn("store", WarehouseActor, "dock")
        await store.put.call_one("s0", {"input_ids": np.zeros(3, np.int64),
                                        "versions": np.zeros(3, np.int32)}, "g0", 1)
        consumer = await rt.spawn("consumer", Consumer, env={ENV_PREFER: "gloo"})
        with pytest.raises(Exception, match="EARL_TRANSPORT='gloo'.*placement.transport"):
            await consumer.fetch.call_one(1)
