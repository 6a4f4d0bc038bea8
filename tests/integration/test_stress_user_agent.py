"""`earl stress --agent PATH.py:NAME --tasks FILE.jsonl` stresses a user's agent like the
shipped ones (simulated engine, every session completed or failed)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from earl.commands.stress import main

pytestmark = pytest.mark.timeout(120)


def test_stress_a_users_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "echo.py").write_text(textwrap.dedent('''
        async def agent(rollout, sample) -> float:
            messages = [{"role": "user", "content": sample["q"]}]
            for _ in range(2):
                turn = await rollout.generate(messages)
                messages.append(turn.message)
                if sample["q"] == "fail":
                    raise RuntimeError("env broke")
                messages.append({"role": "user", "content": "again"})
            return 1.0
    '''))
    (tmp_path / "t.jsonl").write_text('{"q": "hi"}\n{"q": "fail"}\n{"q": "yo"}\n')
    code = main(["--agent", f"{tmp_path / 'echo.py'}:agent", "--tasks",
                 str(tmp_path / "t.jsonl"), "--sessions", "30", "--max-tokens", "8", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 1  # some sessions failed
    assert out["sessions"] == 30 and out["sessions_completed"] == 20
    assert out["sessions_failed"] == 10 and out["turns"] >= 20 * 2
    assert main(["--agent", f"{tmp_path / 'echo.py'}:agent", "--sessions", "3"]) == 2
    assert "go together" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"q": 1}\n{oops\n')
    assert main(["--agent", f"{tmp_path / 'echo.py'}:agent", "--tasks",
                 str(tmp_path / "bad.jsonl")]) == 2
    assert "bad.jsonl:2" in capsys.readouterr().err
