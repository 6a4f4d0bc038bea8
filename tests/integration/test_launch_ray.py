"""The ray launcher against a local Ray instance: placement, calls over earl sockets, death."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile

import psutil
import pytest
import pytest_asyncio
import ray
from test_actor import Counter

from earl.runtime import ActorDied, RestartPolicy, Runtime, RuntimeConfig
from earl.runtime.conn import connect

pytestmark = [pytest.mark.ray, pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def local_ray():
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    old_home = os.environ.get("HOME")
    os.environ["HOME"] = tmp  # Ray writes ~/.ray; keep it out of the real home
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=os.path.join(tmp, "t"),
             log_to_driver=False, logging_level="ERROR")
    yield
    ray.shutdown()
    if old_home is not None:
        os.environ["HOME"] = old_home
    shutil.rmtree(tmp, ignore_errors=True)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def rt(local_ray):
    async with Runtime(RuntimeConfig(launcher="ray")) as runtime:
        yield runtime


async def test_ray_placed_actors_talk_over_earl_sockets(rt):
    g = await rt.spawn("rc", Counter, 10, n=2, restart=RestartPolicy(max_restarts=1,
                                                                     backoff_s=0.0))
    node = ray.util.get_node_ip_address()  # bound on the Ray node's address
    assert all(a.startswith(f"tcp:{node}:") for a in g.addresses)
    assert rt.secret is not None  # the per-run secret reached the Ray-placed processes
    with pytest.raises(ValueError, match="requires a shared secret"):
        await connect(g.addresses[0], "rc[0]", max_bytes=1 << 20, secret=None)
    assert await g.incr.call(1) == [11, 11]
    assert [x async for x in g[1].tokens.stream(3)] == [0, 1, 2]
    who = await g.whoami.call()
    pids = [w[3] for w in who]
    for pid in pids:  # each actor process is a child of a Ray worker, not of this driver
        assert psutil.Process(pid).ppid() != os.getpid()
    pgs = ray.util.placement_group_table()
    assert any(p["name"] == "earl-rc" and p["state"] == "CREATED" for p in pgs.values())

    os.kill(pids[0], signal.SIGKILL)  # dies: pending calls fail, then the keeper restarts it
    with pytest.raises(ActorDied):
        await g[0].slow.call_one(60.0)
    await rt.wait_status(g[0], "up", min_restarts=1)
    assert await g[0].incr.call_one(1) == 11
    assert (await g[0].whoami.call_one())[3] != pids[0]
    found = await rt.lookup("rc")
    assert await found[1].get.call_one() == 11
    alive = [psutil.Process(w[3]) for w in await g.whoami.call()]
    await rt.stop(g)
    _, still = psutil.wait_procs(alive, timeout=15)
    assert not still
