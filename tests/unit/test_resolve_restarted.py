"""A handle taken while its actor was restarting holds the address of the dead process: its
first call finds nothing listening there. The pool must remember that address as dead, as it
does a lost connection, so the handle's next call looks the actor up again and follows it to
its new process (`Runtime.resolve`). Before, only a lost connection was remembered: a producer
restarted beside a restarting rollout tried the rollout's old socket for as long as its
`HealingEngine` retried (`earl chaos --draw 3 --seed 261`: the run stalled).

In-process only: the root runtime's directory, and its own socket standing in for the
restarted actor's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from earl.runtime import Runtime, RuntimeConfig
from earl.runtime.conn import Pool
from earl.runtime.directory import RESTARTING, UP, GroupRecord
from earl.runtime.errors import ActorDied

pytestmark = pytest.mark.timeout(60)


async def test_an_address_nothing_listens_at_is_remembered_dead(tmp_path: Path) -> None:
    pool = Pool(max_bytes=1 << 20, secret=None)
    gone = f"unix:{tmp_path / 'gone.s'}"
    with pytest.raises(ActorDied) as first:
        await pool.get(gone, "rollout[0]")
    assert first.value.cause == "unreachable"
    assert gone in pool.dead
    with pytest.raises(ActorDied) as again:  # without trying to connect again
        await pool.get(gone, "rollout[0]")
    assert again.value is first.value


async def test_a_handle_to_a_restarting_actor_follows_it_to_its_new_address(
        tmp_path: Path) -> None:
    async with Runtime(RuntimeConfig(run_dir=str(tmp_path / "run"))) as rt:
        assert rt.directory is not None and rt.directory_address is not None
        old = f"unix:{tmp_path / 'rollout-old.s'}"  # the killed process' socket, gone
        await rt.directory.publish(GroupRecord(
            name="rollout", cls_name="RolloutActor", endpoints={}, addresses=[old],
            pids=[os.getpid()], status=[UP], restarts=[0]))
        await rt.directory.update("rollout", 0, RESTARTING, reason="killed")
        group = await rt.lookup("rollout")  # taken while it restarts: the old address
        assert group.addresses == [old]
        with pytest.raises(ActorDied, match="cannot connect"):
            await rt.resolve(group, 0)
        with pytest.raises(ActorDied, match="killed"):  # the directory asked, not the socket
            await rt.resolve(group, 0)
        new = rt.directory_address  # a live socket: the restarted process'
        await rt.directory.update("rollout", 0, UP, address=new, pid=os.getpid())
        conn = await rt.resolve(group, 0)
        assert group.addresses == [new] and conn.dead is None
