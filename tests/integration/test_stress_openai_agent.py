"""`earl stress --agent` runs an agent written against the `openai` client (agents/openai_calc.py)
in 1,000 concurrent sessions: each talks HTTP to the loopback OpenAI endpoint `earl train` serves,
over the simulated engine, and the report is the one a coroutine agent gets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
TASKS = str(ROOT / "envs" / "data" / "calc_train.jsonl")


def _stress(agent: str, sessions: int) -> dict[str, object]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "earl.cli", "stress", "--agent", agent,
                           "--tasks", TASKS, "--sessions", str(sessions), "--json"],
                          capture_output=True, text=True, timeout=240, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_openai_client_agent_runs_1000_sessions_with_the_coroutine_report() -> None:
    out = _stress(f"{ROOT / 'agents' / 'openai_calc.py'}:agent", 1000)
    assert out["sessions"] == 1000
    assert out["sessions_completed"] == 1000 and out["sessions_failed"] == 0, \
        out["failure_examples"]
    ctx = out["context_len_per_turn"]
    assert isinstance(ctx, dict) and ctx["0"]["n"] == 1000  # every session's request recorded
    # replies the endpoint parsed as tool calls came back with the agent's tool results
    assert "1" in ctx and ctx["1"]["p50"] > ctx["0"]["p50"]
    coroutine = _stress(f"{ROOT / 'agents' / 'calc.py'}:calc_agent", 20)
    assert coroutine["sessions_completed"] == 20
    assert set(out) == set(coroutine)
