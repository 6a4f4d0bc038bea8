"""`bench/selector.py --out DIR` resumes (bench/_selector_runs.py): a run finished with the
same code (and warm start) and the same arguments on a machine as fast is read back; other code,
other arguments, a modified tree or another machine's speed run it again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import load

runs = load("_selector_runs")


def test_a_finished_run_is_read_back_only_with_the_same_code_and_args(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[list[str]] = []

    def one(cfg: object, args: list[str], root: str, timeout: float) -> dict[str, object]:
        ran.append(args)
        return {"config": "x", "tokens_per_s": float(len(ran))}

    monkeypatch.setattr(runs, "one", one)
    cfg = runs.Config(2, 1, 1, 1, 1024, 8192)
    args = ["--steps=400", "--placement.slot_memory_mib=100"]
    speed = {"matmul_gflops": 100.0, "copy_gbps": 10.0}
    first, again = runs.run_or_read_back(cfg, args, str(tmp_path), "abc", 60.0, 100, speed)
    assert not again and first["tokens_per_s"] == 1.0 and "started" in first
    assert first["machine_speed"] == speed
    near = {"matmul_gflops": 95.0, "copy_gbps": 10.5}  # within SPEED_TOLERANCE: the noise
    back, again = runs.run_or_read_back(cfg, args, str(tmp_path), "abc", 60.0, 100, near)
    assert again and back == first and len(ran) == 1
    for code, other in (("def", args), ("abc", [*args, "--seed=1"]), (None, args)):
        _, again = runs.run_or_read_back(cfg, other, str(tmp_path), code, 60.0, 100, speed)
        assert not again
    assert len(ran) == 4
    # a slower machine (memory 30% slower) runs it again, and its run is read back after
    runs.run_or_read_back(cfg, args, str(tmp_path), "abc", 60.0, 100, speed)
    slower = {"matmul_gflops": 100.0, "copy_gbps": 7.0}
    _, again = runs.run_or_read_back(cfg, args, str(tmp_path), "abc", 60.0, 100, slower)
    assert not again and len(ran) == 6
    _, again = runs.run_or_read_back(cfg, args, str(tmp_path), "abc", 60.0, 100, slower)
    assert again and len(ran) == 6
    saved = json.loads((tmp_path / "static_d2_r1-t1_w1024_mb8k.result.json").read_text())
    assert saved["key"] == {"code": "abc", "args": args}
    assert saved["run"]["machine_speed"] == slower


def test_the_code_key_ignores_commits_that_change_only_results_or_docs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def git(*a: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)

    git("init", "-q")
    for path in ("earl/a.py", "docs/x.md"):
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text("1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(runs._results, "REPO", tmp_path)
    code = runs.code_key()
    assert code
    (tmp_path / "docs/x.md").write_text("2\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "docs")
    assert runs.code_key() == code
    (tmp_path / "earl/a.py").write_text("2\n")
    assert runs.code_key() is None  # modified, not committed: nothing is read back
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "code")
    assert runs.code_key() not in (None, code)
    # a static run's key leaves out what only the selector runs: its change keeps static runs
    static = runs.code_key(("earl/a.py",))
    (tmp_path / "earl/a.py").write_text("3\n")
    assert runs.code_key() is None and runs.code_key(("earl/a.py",)) == static
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "policy")
    assert runs.code_key(("earl/a.py",)) == static


def test_a_resumed_invocation_keeps_the_device_sizes_of_the_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """MemAvailable drifts between invocations; the sizes (run arguments) must not."""
    avail = iter([1000, 1200])
    monkeypatch.setattr(runs, "_machine",
                        lambda mib, cores: {cores: mib or next(avail) // cores})
    first = runs.device_sizes(str(tmp_path), 0, 2)
    assert runs.device_sizes(str(tmp_path), 0, 2) == first == {2: 500}
    assert runs.device_sizes(str(tmp_path), 300, 2) == {2: 300}  # --device-mib sets them anew
    assert json.loads((tmp_path / "machine.json").read_text()) == {"2": 300}


def test_what_only_the_selector_runs_names_files_that_exist() -> None:
    root = Path(runs._results.REPO)
    assert all((root / p).is_file() for p in runs.SELECTOR_ONLY), runs.SELECTOR_ONLY


def test_the_same_work_is_timed_at_each_runs_own_rate_per_context() -> None:
    """A static run is timed on the selector's tokens per context bucket at its own rates; a
    bucket it never reached takes its rate in the longest one below; an OOM has no time."""
    work = runs.by_context([{"ctx_max": 300}, {"ctx_max": 700}, {"ctx_max": 1500}],
                                [100.0, 200.0, 400.0], [1.0, 2.0, 8.0])
    assert work == {"384": [100, 1.0], "768": [200, 2.0], "1536": [400, 8.0]}
    run = {"outcome": "finished", "by_context": {"384": [100, 1.0], "768": [400, 2.0]}}
    secs, cover = runs.matched_seconds(run, work)
    assert secs == pytest.approx(1.0 + 1.0 + 2.0) and cover == pytest.approx(300 / 700)
    assert runs.matched_seconds({**run, "outcome": "oom"}, work) == (None, 0.0)


def test_a_run_saved_without_a_machine_speed_is_read_back_unchecked() -> None:
    now = {"matmul_gflops": 100.0, "copy_gbps": 10.0}
    assert runs.speed_differs(now, None) == ""
    assert runs.speed_differs(now, {"matmul_gflops": 80.0, "copy_gbps": 10.0}).startswith(
        "matmul_gflops 80.0 then")


def test_the_machine_speed_probe_measures_both_kinds_of_work() -> None:
    speed = runs.machine_speed(trials=1)
    assert set(speed) == {"matmul_gflops", "copy_gbps"} and all(v > 0 for v in speed.values())
