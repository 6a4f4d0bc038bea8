"""A driver for test_ray_hosts.py, run on namespace host "a" of a Ray cluster over two hosts
(tests/hosts.py): places actors by Ray custom resource, calls them across the host boundary,
and forms a gloo process group whose ranks sit on both hosts. Prints one JSON line.

Needs nodes of 2 CPUs each: after one 1-CPU actor on each, a 2-rank group must span both.
Not a test by itself.
"""

from __future__ import annotations

import asyncio
import json
import os

from earl.runtime import Actor, Runtime, RuntimeConfig, endpoint
from earl.runtime.locality import ENV_ADDRESS, host_id, node_address


class Where(Actor):
    """Says where it runs, and joins a gloo group to sum ranks across hosts."""

    @endpoint
    async def where(self) -> dict[str, str]:
        return {"node": node_address(), "env": os.environ.get(ENV_ADDRESS, ""),
                "host_id": host_id()}

    @endpoint
    async def all_reduce(self, url: str) -> dict[str, object]:
        import torch
        import torch.distributed as dist

        from earl.stages.trainer_dist import init_distributed

        init_distributed(self.rank, self.world_size, url, torch.device("cpu"))
        t = torch.tensor([float(self.rank + 1)])
        dist.all_reduce(t)
        dist.destroy_process_group()
        return {"sum": float(t.item()), "node": node_address(),
                "ifname": os.environ.get("GLOO_SOCKET_IFNAME", "")}


async def main() -> dict[str, object]:
    cfg = RuntimeConfig(launcher="ray", ray_resources={"on_b": "earl_host_b",
                                                       "on_a": "earl_host_a"})
    out: dict[str, object] = {"driver_host_id": host_id()}
    async with Runtime(cfg) as rt:
        out["directory"] = rt.directory_address
        for name in ("on_b", "on_a"):
            g = await rt.spawn(name, Where)
            out[name] = {"address": g.addresses[0], **await g[0].where.call_one()}
        host, port = await rt.free_address("pg", 2)
        g = await rt.spawn("pg", Where, n=2)
        out["rendezvous"] = host
        out["pg"] = await g.all_reduce.call(f"tcp://{host}:{port}")
        out["pg_where"] = await g.where.call()
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
