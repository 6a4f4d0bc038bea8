"""The agent `earl chaos` trains when a `stall:tool` fault is injected: a tool call, then a game.

`probed_tictactoe` calls the sync `probe` tool the way a session runs a local tool
(`earl.runtime.tools.run_local`, the run's `tool_timeout_s`), then plays the Tic-Tac-Toe
recipe's game. `probe` returns at once, unless the file named by $EARL_TOOL_STALL exists: then
it blocks, as a tool whose network read hangs does, until the file is removed. The episode's
info gets `probe_errors` (1 when the call came back as an error, i.e. timed out) and `probe_s`
(how long the session waited for it); each error also appends "<seconds waited> <error>" to
"$EARL_TOOL_STALL.errors", which `earl chaos` reads (evals and batches played ahead included).
"""

from __future__ import annotations

import os
import time

from earl.agents.rollout import Rollout
from earl.recipes.tictactoe import agent as tictactoe
from earl.runtime.tools import run_local
from earl.runtime.types import Tool

__all__ = ["STALL_ENV", "probe", "probed_tictactoe"]

STALL_ENV = "EARL_TOOL_STALL"


def probe() -> str:
    """Answer "ok", after the stall file (if any) is gone."""
    path = os.environ.get(STALL_ENV, "")
    while path and os.path.exists(path):
        time.sleep(0.05)
    return "ok"


_PROBE = Tool.from_function(probe)


async def probed_tictactoe(rollout: Rollout, seed: int) -> float:
    t0 = time.perf_counter()
    res = await run_local(_PROBE, {}, timeout_s=rollout.config.tool_timeout_s)
    waited = time.perf_counter() - t0
    rollout.info["probe_errors"] = 0 if res.ok else 1
    rollout.info["probe_s"] = waited
    path = os.environ.get(STALL_ENV, "")
    if not res.ok and path:  # for the injector, whether or not this episode is ever trained
        _note(f"{path}.errors", f"{waited:.3f} {res.error}\n")
    return await tictactoe(rollout, seed)


def _note(path: str, line: str) -> None:
    with open(path, "a") as f:
        f.write(line)
