"""`earl eval RUN --json` re-evaluates a finished run's saved weights and prints the eval that
`earl train --json` printed at the end of that run (real actors, vLLM on CPU, tiny model)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

# The score depends on the exact greedy reply (its distinct characters), so weights other
# than the run's final ones would show in the eval.
AGENT = textwrap.dedent('''
    async def agent(rollout, sample) -> float:
        turn = await rollout.generate([{"role": "user", "content": "Say " + sample["word"]}])
        return len(set(turn.content)) / 8.0
''')
EVAL_WORDS = ["ice", "box", "cup", "fan", "jam", "kit", "log", "nut", "oak", "pig", "rug", "tub"]


def _jsonl(words: list[str]) -> str:
    return "".join(json.dumps({"word": w}) + "\n" for w in words)


def _earl(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run([sys.executable, "-m", "earl.cli", *args], capture_output=True,
                          text=True, timeout=250, env=env, check=False, cwd=cwd)


@pytest.mark.slow  # ~48 s: a training run first
def test_eval_of_a_run_prints_its_final_eval(tmp_path: Path) -> None:
    (tmp_path / "words.py").write_text(AGENT)
    (tmp_path / "train.jsonl").write_text(_jsonl(["cat", "dog", "sun", "map", "red", "owl"]))
    (tmp_path / "eval.jsonl").write_text(_jsonl(EVAL_WORDS))
    # relative paths, as a user types them: `earl eval` runs in the same folder
    p = _earl("train", "--agent", "words.py:agent", "--tasks", "train.jsonl",
              "--eval-tasks", "eval.jsonl", "--output-dir", "run", "--json", "--steps=2",
              "--batch_size=8", "--group_size=4", "--max_tokens=8", "--placement.reference=0",
              "--model.max_model_len=512", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    trained = json.loads(p.stdout.strip().splitlines()[-1])

    p = _earl("eval", "run", "--json", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["recipe"] == trained["recipe"] and got["target_key"] == trained["target_key"]
    assert got["weights"] == str(Path("run") / "weights") and got["step"] == 2
    ev, want = got["eval"], trained["eval"]
    assert set(ev) == set(want) and ev["episodes"] == want["episodes"] == len(EVAL_WORDS)
    # Greedy decoding of the same weights on the same samples: equal, but for an argmax tie
    # that a differently batched CPU kernel may break the other way: one episode at most.
    for key in ev:
        assert ev[key] == pytest.approx(want[key], abs=1 / len(EVAL_WORDS)), (key, ev, want)
    assert json.loads((tmp_path / "run" / "eval" / "eval.json").read_text()) == got
