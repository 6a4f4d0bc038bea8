"""`bench/selector.py --out DIR` resumes: a run finished at the same commit with the same
arguments is read back; another commit, other arguments or a modified tree run it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load

selector = load("selector")


def test_a_finished_run_is_read_back_only_with_the_same_commit_and_args(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def one(cfg: object, args: list[str], root: str, timeout: float) -> dict[str, object]:
        ran.append(args)
        return {"config": "x", "tokens_per_s": float(len(ran))}

    monkeypatch.setattr(selector, "_one", one)
    cfg = selector.Config(2, 1, 1, 1, 1024, 8192)
    args = ["--steps=400", "--placement.slot_memory_mib=100"]
    first, again = selector._resumed(cfg, args, str(tmp_path), "abc", 60.0, 100)
    assert not again and first["tokens_per_s"] == 1.0 and "started" in first
    back, again = selector._resumed(cfg, args, str(tmp_path), "abc", 60.0, 100)
    assert again and back == first and len(ran) == 1
    for commit, other in (("def", args), ("abc", [*args, "--seed=1"]), (None, args)):
        _, again = selector._resumed(cfg, other, str(tmp_path), commit, 60.0, 100)
        assert not again
    assert len(ran) == 4
    saved = json.loads((tmp_path / "static_d2_r1-t1_w1024_mb8k.result.json").read_text())
    assert saved["key"] == {"commit": None, "args": args}


def test_a_resumed_invocation_keeps_the_device_sizes_of_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MemAvailable drifts between invocations; the sizes (run arguments) must not."""
    avail = iter([1000, 1200])
    monkeypatch.setattr(selector, "_machine",
                        lambda mib, cores: {cores: mib or next(avail) // cores})
    first = selector._sizes(str(tmp_path), 0, 2)
    assert selector._sizes(str(tmp_path), 0, 2) == first == {2: 500}
    assert selector._sizes(str(tmp_path), 300, 2) == {2: 300}  # --device-mib sets them anew
    assert json.loads((tmp_path / "machine.json").read_text()) == {"2": 300}
