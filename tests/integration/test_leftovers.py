"""A run leaves nothing in /dev/shm or the temp dir; what a SIGKILLed run left is swept by the
next Runtime."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import sys
import tempfile
import textwrap
import time

import numpy as np
import pytest

from earl.runtime import Actor, Runtime, endpoint
from earl.runtime.cleanup import pid_alive
from earl.runtime.transport import connect, get_transport, pack_arrays, unpack_arrays

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]
TMP = tempfile.gettempdir()


class ShmEnd(Actor):
    """Sends or receives one array over the shm transport, as dock producers and readers do."""

    def __init__(self) -> None:
        self.rx, self.tx = None, None

    @endpoint
    def listen(self) -> str:
        self.rx = get_transport("shm").listen()
        return self.rx.address

    @endpoint
    def send_to(self, address: str, n: int) -> None:
        self.tx = connect(address)
        header, bufs = pack_arrays({"x": np.arange(n, dtype=np.int64)})
        self.tx.send(header, bufs)

    @endpoint
    def receive(self) -> int:
        frame = self.rx.recv(timeout=30)
        total = int(unpack_arrays(frame)[0]["x"].sum())
        frame.release()
        return total


def leftovers(pids: list[int]) -> list[str]:
    """/dev/shm segments, shm control dirs and run dirs that belong to `pids`."""
    out = []
    for pid in pids:
        out += glob.glob(f"/dev/shm/earl-*-{pid}-*")
        out += glob.glob(os.path.join(TMP, f"earl-shm-{pid}-*"))
        out += glob.glob(os.path.join(TMP, f"earl-{pid}-*"))
    return out


async def _transfer(rt: Runtime) -> list[int]:
    """One shm transfer between two actors; returns their pids."""
    a = await rt.spawn("producer", ShmEnd)
    b = await rt.spawn("reader", ShmEnd)
    address = await b.listen.call_one()
    await a.send_to.call_one(address, 1 << 18)
    assert await b.receive.call_one() == sum(range(1 << 18))
    return [(await rt.dir_call("lookup", g)).pids[0] for g in ("producer", "reader")]


async def test_a_run_with_a_shm_transfer_leaves_nothing_behind() -> None:
    async with Runtime() as rt:
        pids = await _transfer(rt)
        run_dir = rt.run_dir
        during = leftovers(pids)
        assert any(p.startswith("/dev/shm/") for p in during)  # the segment and the receiver's
        assert any("earl-shm-" in p for p in during)  # control dir exist while it runs
        assert os.path.isdir(run_dir)
    assert leftovers([*pids, os.getpid()]) == []
    assert not os.path.exists(run_dir)


_DRIVER = textwrap.dedent("""
    import asyncio, json, os, sys
    from earl.runtime import Runtime
    sys.path.insert(0, {tests!r})
    from test_leftovers import ShmEnd, _transfer

    async def main():
        async with Runtime() as rt:
            pids = await _transfer(rt)
            print(json.dumps({{"run_dir": rt.run_dir, "pids": pids}}), flush=True)
            await asyncio.sleep(600)  # SIGKILLed here

    if __name__ == "__main__":
        asyncio.run(main())
""")


async def test_a_sigkilled_drivers_leftovers_are_swept_by_the_next_runtime(tmp_path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER.format(tests=os.path.dirname(__file__)))
    proc = await asyncio.create_subprocess_exec(sys.executable, str(script),
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        info = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    pids = [proc.pid, *info["pids"]]
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)  # the actors die with their driver (PR_SET_PDEATHSIG)
    assert not any(pid_alive(p) for p in pids)
    left = leftovers(pids)
    assert info["run_dir"] in left and any(p.startswith("/dev/shm/") for p in left)
    async with Runtime():
        pass
    assert leftovers(pids) == []
