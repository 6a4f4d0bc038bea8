"""`Runtime.resize`: a replica group grows and shrinks while its kept ranks go on (real
processes, the directory's record and restarts of the new ranks)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from earl.runtime import Actor, ActorDied, RestartPolicy, Runtime, context, endpoint

pytestmark = [pytest.mark.timeout(120)]


class Replica(Actor):
    def __init__(self, tag: str) -> None:
        self.tag, self.calls = tag, 0

    @endpoint
    async def hello(self) -> tuple[str, int, int]:
        self.calls += 1
        return self.tag, os.getpid(), self.calls


class Looker(Actor):
    @endpoint
    async def sizes(self, name: str) -> int:
        return len(await context().lookup(name))


async def test_a_group_grows_and_shrinks_and_its_kept_ranks_keep_their_state() -> None:
    async with Runtime() as rt:
        g = await rt.spawn("reps", Replica, "v1", n=2,
                           restart=RestartPolicy(max_restarts=1, backoff_s=0.0))
        before = await g.hello.call()
        rt.restart_with(g, "v2")  # new ranks run the group's current spec

        g3 = await rt.resize(g, 3)
        after = await g3.hello.call()
        assert [a[:2] for a in after[:2]] == [b[:2] for b in before]  # same processes
        assert [a[2] for a in after] == [2, 2, 1]  # their state kept; the new one is fresh
        assert after[2][0] == "v2"
        looker = await rt.spawn("looker", Looker)
        assert await looker.sizes.call_one("reps") == 3  # the directory knows

        new_pid = after[2][1]
        os.kill(new_pid, 9)  # a new rank is supervised like the first ones
        async with asyncio.timeout(30):
            while True:
                try:
                    back = await g3[2].hello.call_one()
                    if back[1] != new_pid:
                        break
                except ActorDied:
                    pass
                await asyncio.sleep(0.1)

        g1 = await rt.resize(g3, 1)
        assert len(g1) == 1 and await looker.sizes.call_one("reps") == 1
        assert (await g1.hello.call_one())[1] == before[0][1]
        with pytest.raises(ActorDied):
            await g3[1].hello.call_one()  # the stopped rank's calls fail, nothing hangs
        await asyncio.sleep(0.3)
        assert len(await g1.hello.call()) == 1  # the stopped ranks were not restarted


async def test_resize_names_what_is_wrong() -> None:
    async with Runtime() as rt:
        g = await rt.spawn("reps", Replica, "v1", n=2)
        with pytest.raises(ValueError, match="n \\(number of actors\\)"):
            await rt.resize(g, 0)
        with pytest.raises(ValueError, match="slot="):
            await rt.resize(g, 3, slot=[])
        await rt.stop(g)
        with pytest.raises(KeyError, match="reps"):
            await rt.resize(g, 3)


class Hoarder(Actor):
    """Leaves reference cycles for a collection, and at exit writes what one found."""

    def __init__(self, out: str) -> None:
        import atexit
        import gc

        gc.disable()
        self.cycles = [[] for _ in range(1000)]
        for c in self.cycles:
            c.append(c)
        del self.cycles
        atexit.register(lambda: Path(out).write_text(str(gc.collect())))

    @endpoint
    async def hello(self) -> int:
        return os.getpid()


async def test_a_stopped_rank_runs_its_exit_handlers_without_collecting(tmp_path: Path) -> None:
    """vLLM's engine finalizer collected twice at exit, 0.8-1.8 s of a dropped replica's stop:
    a stopping actor's handlers still run, but a collection frees nothing `os._exit` would
    not."""
    out = [str(tmp_path / f"r{i}") for i in range(2)]
    async with Runtime() as rt:
        g = await rt.spawn("hoard", Hoarder, out[1], n=2)
        await g.hello.call()
        await rt.resize(g, 1)
        assert Path(out[1]).read_text() == "0"  # ran, found nothing to do
