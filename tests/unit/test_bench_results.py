"""Benchmark results as files (bench/_results.py) and the README's table built from them
(bench/report.py): file names never collide, the command reproduces the run, the newest file
wins, and the README's table is the one the saved results give."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_scripts import BENCH, load

_results = load("_results")
report = load("report")
README = BENCH.parent / "README.md"


def _save(folder: Path, name: str, result: dict, *, quick: bool = False,  # type: ignore[type-arg]
          argv: list[str] | None = None) -> Path:
    return _results.save(name, result, quick=quick, begun=_results.start(),  # type: ignore[no-any-return]
                         argv=argv or [f"bench/{name}.py", "--json", "--save"], folder=folder)


def test_save_wraps_the_result_with_the_facts(tmp_path: Path) -> None:
    res = {"bench": "rpc", "rtt_us_median": 44.0, "nested": {"a": [1, 2]}}
    path = _save(tmp_path, "rpc", res, quick=True,
                 argv=["/x/bench/rpc.py", "--json", "--save", "--quick"])
    rec = json.loads(path.read_text())
    assert re.fullmatch(r"rpc-\d{4}-\d\d-\d\d-quick\.json", path.name)
    assert rec["bench"] == "rpc" and rec["quick"] is True
    assert rec["result"] == res  # the benchmark's own keys, untouched
    facts = rec["facts"]
    assert facts["command"] == "earl bench rpc --json --quick"  # reruns it, without --save
    assert path.name.startswith(f"rpc-{facts['date']}")
    assert facts["cores"] >= 1 and facts["mem_total_mib"] > 0
    assert len(facts["loadavg_before"]) == len(facts["loadavg_after"]) == 3
    assert facts["versions"]["torch"] and facts["python"]
    if (BENCH.parent / ".git").exists():  # a source checkout: the commit it measured
        assert re.fullmatch(r"[0-9a-f]{40}", facts["git"]["commit"])
        assert isinstance(facts["git"]["modified"], list)


def test_a_same_day_file_is_never_overwritten(tmp_path: Path) -> None:
    first = _save(tmp_path, "stress", {"n": 1})
    second = _save(tmp_path, "stress", {"n": 2})
    third = _save(tmp_path, "stress", {"n": 3})
    assert second.name == first.name.replace(".json", "-2.json")
    assert third.name == first.name.replace(".json", "-3.json")
    assert [json.loads(p.read_text())["result"]["n"] for p in (first, second, third)] == [1, 2, 3]
    quick = _save(tmp_path, "stress", {"n": 4}, quick=True)
    assert quick.name == first.name.replace(".json", "-quick.json")


def _record(folder: Path, file: str, name: str, started: str, result: dict) -> None:  # type: ignore[type-arg]
    rec = {"bench": name, "quick": False, "result": result,
           "facts": {"started": started, "command": f"earl bench {name} --json"}}
    (folder / file).write_text(json.dumps(rec))


def test_latest_is_the_newest_run_of_each_benchmark(tmp_path: Path) -> None:
    # file names sort the other way round from the start times: the times decide
    _record(tmp_path, "rpc-2026-11-26.json", "rpc", "2026-11-26T09:00:00+00:00", {"v": "old"})
    _record(tmp_path, "rpc-2026-11-26-2.json", "rpc", "2026-11-26T08:00:00+00:00", {"v": "older"})
    _record(tmp_path, "rpc-2026-11-26-quick.json", "rpc", "2026-11-26T10:00:00+01:00",
            {"v": "same instant, not newer"})
    _record(tmp_path, "rpc-2026-11-25.json", "rpc", "2026-11-26T09:30:00+00:00", {"v": "new"})
    _record(tmp_path, "sandbox-2026-11-20.json", "sandbox", "2026-11-20T00:00:00+00:00", {})
    got = report.latest(tmp_path)
    assert set(got) == {"rpc", "sandbox"}
    path, rec = got["rpc"]
    assert path.name == "rpc-2026-11-25.json" and rec["result"] == {"v": "new"}


def test_table_has_a_row_per_saved_result_with_its_command_and_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(report, "REPO", tmp_path)
    rpc = {"rtt_us_median": 44.2, "calls_per_s_pipelined": 124000.0,
           "zmq_dealer_router_rtt_us_median": 236.0, "ray_rtt_us_median": None}
    _record(tmp_path, "rpc-2026-11-26.json", "rpc", "2026-11-26T09:00:00+00:00", rpc)
    lines = report.table(report.latest(tmp_path)).splitlines()
    assert lines[0] == "| what | figure | command | result |"
    assert len(lines) == 3  # header, rule, the one benchmark saved
    assert "round trip 44 us median, 124k pipelined calls/s" in lines[2]
    assert "Ray" not in lines[2]  # not measured in that run
    assert lines[2].endswith("| `earl bench rpc --json` | "
                             "[rpc-2026-11-26.json](rpc-2026-11-26.json) |")


def test_check_and_write_keep_the_readme_table_current(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    results = tmp_path / "results"
    results.mkdir()
    monkeypatch.setattr(report, "RESULTS", results)
    _record(results, "scale_model-2026-11-26.json", "scale_model", "2026-11-26T09:00:00+00:00",
            {"scenarios": [{"config": {"gpus": 8, "model_params": 7e9, "context_len": 8192},
                            "estimate": {"volume_TB": 0.01, "single_controller_s": 60.0,
                                         "dispatcher_s": 0.003}}]})
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{report.START}\n| stale |\n{report.END}\n\nafter\n")
    assert report.main(["--check", str(readme)]) == 1
    assert report.main(["--write", str(readme)]) == 0
    text = readme.read_text()
    assert "| stale |" not in text and "1.0 min; dispatcher 3 ms" in text
    assert text.startswith("# x\n\n") and text.endswith(f"{report.END}\n\nafter\n")
    assert report.main(["--check", str(readme)]) == 0
    with pytest.raises(ValueError, match="bench-table"):
        report.replace_table("no markers", "| t |")


def test_every_benchmark_can_save_and_every_saved_file_renders() -> None:
    scripts = [p for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem != "report"]
    assert len(scripts) >= 10
    for p in scripts:
        src = p.read_text()
        assert "_results.add_flag(" in src and "_results.save(" in src, p.name
    assert report.table(report.latest())  # every stored file has the keys its row reads


def test_readme_table_is_the_latest_saved_results() -> None:
    text = README.read_text()
    assert report.replace_table(text, report.table(report.latest())) == text, \
        "run `python bench/report.py --write README.md`"


def test_a_runs_command_counts_its_records_in_the_table() -> None:
    cmd = "earl bench selector --runs a/x.result.json a/y.result.json --json"
    assert report._command(cmd) == "earl bench selector --runs <2 run records> --json"
    assert report._command("earl bench selector --json") == "earl bench selector --json"


def test_the_race_row_renders_a_race_and_one_whose_trl_side_failed() -> None:
    failed = json.loads((BENCH / "results/race_chain/race_chain-2026-12-01-trl-oom.json")
                        .read_text())["result"]
    assert "TRL has no curve (gc_off: exited -9)" in report._race_chain(failed)
    curve = [{"t_s": 450.0, "accuracy": 0.1}, {"t_s": 900.0, "accuracy": 0.2}]
    side = {"curve": curve, "time_to_threshold_s": 900.0, "trajectories_per_s": 0.7,
            "tokens_per_s": 19.0, "cpu_s_per_trajectory": 3.5}
    race = {**failed, "earl": side, "trl": {"gc_on": {**side, "time_to_threshold_s": None}},
            "earl_at_least_after_first": True, "earl_time_to_trl_final_s": 900.0}
    row = report._race_chain(race)
    assert "EARL 0.100 at 8 min -> 0.200, TRL (gc_on) 0.100" in row and "**yes**" in row
    assert "time to 0.3: EARL 15 min, TRL not reached" in row
