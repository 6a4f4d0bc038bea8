"""`earl eval`'s input: which weights, config and step a path names (`earl.evaluate`), and a
clear error, exit code 2 and no traceback for a path that names none. No actors start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from earl import cli
from earl.config import RunConfig, to_dict
from earl.evaluate import SavedPolicy, eval_config, saved_policy


def _model(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _run(tmp_path: Path, *, steps: int = 5, selected: int = 5, finished: bool = True,
         **fields: object) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(to_dict(RunConfig(output_dir=str(run),
                                                                  **fields))))  # type: ignore[arg-type]
    for name in ("weights_start", "weights", "weights_best"):
        _model(run / name)
    if finished:
        (run / "result.json").write_text(json.dumps({"steps": steps, "selected_step": selected}))
    return run


def test_a_run_folder_names_the_weights_its_final_eval_served(tmp_path: Path) -> None:
    run = _run(tmp_path)
    policy = saved_policy(str(run))
    assert (policy.weights, policy.step, policy.run) == (run / "weights", 5, run)
    assert policy.config is not None and policy.config["recipe"] == "tictactoe"


def test_model_selection_of_an_earlier_step_serves_weights_best(tmp_path: Path) -> None:
    run = _run(tmp_path, steps=40, selected=20)
    assert saved_policy(str(run)).weights == run / "weights_best"
    assert saved_policy(str(run)).step == 40  # the final eval's samples are those of step 40


def test_a_model_folder_of_a_run_takes_the_runs_config(tmp_path: Path) -> None:
    run = _run(tmp_path, steps=7)
    policy = saved_policy(str(run / "weights_start"))
    assert (policy.weights, policy.step, policy.run) == (run / "weights_start", 7, run)
    assert policy.config is not None


def test_an_unfinished_run_says_how_to_finish_it(tmp_path: Path) -> None:
    run = _run(tmp_path, finished=False)
    with pytest.raises(ValueError, match="has not finished.*--resume"):
        saved_policy(str(run))


def test_a_model_folder_outside_a_run_needs_a_task(tmp_path: Path) -> None:
    policy = saved_policy(str(_model(tmp_path / "hf")))
    assert policy == SavedPolicy(weights=tmp_path / "hf")
    with pytest.raises(ValueError, match="--recipe NAME, or --agent"):
        eval_config(policy, {}, output_dir=str(tmp_path / "out"))
    with pytest.raises(ValueError, match="--agent needs --eval-tasks"):
        eval_config(policy, {"agent": "x.py:agent"}, output_dir=str(tmp_path / "out"))
    cfg = eval_config(policy, {"recipe": "connect4"}, output_dir=str(tmp_path / "out"))
    assert cfg.recipe == "connect4" and cfg.output_dir == str(tmp_path / "out")
    assert not cfg.dump_trajectories


def test_the_runs_config_with_the_users_flags_on_top(tmp_path: Path) -> None:
    run = _run(tmp_path, eval_games=200, seed=3)
    policy = saved_policy(str(run))
    cfg = eval_config(policy, {"eval_games": 10}, output_dir=str(run / "eval"))
    assert (cfg.recipe, cfg.seed, cfg.eval_games) == ("tictactoe", 3, 10)
    agent = tmp_path / "a.py"
    agent.write_text("async def agent(rollout, sample):\n    return 0.0\n")
    (tmp_path / "e.jsonl").write_text("1\n")
    cfg = eval_config(policy, {"agent": f"{agent}:agent", "eval_tasks": str(tmp_path / "e.jsonl")},
                      output_dir=str(run / "eval"))
    assert cfg.agent == f"{agent}:agent" and cfg.seed == 3


def test_a_runs_relative_file_missing_here_says_where_to_run(tmp_path: Path) -> None:
    agent = tmp_path / "a.py"
    agent.write_text("async def agent(rollout, sample):\n    return 0.0\n")
    run = _run(tmp_path, agent=f"{agent}:agent", tasks="t.jsonl", eval_tasks="gone.jsonl")
    with pytest.raises(ValueError, match="eval_tasks gone.jsonl .* run `earl eval` there"):
        eval_config(saved_policy(str(run)), {}, output_dir=str(run / "eval"))


@pytest.mark.parametrize("make", ["empty", "missing", "other_json"])
def test_a_path_that_is_no_policy_is_a_clear_error(tmp_path: Path, make: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x"
    if make != "missing":
        path.mkdir()
    if make == "other_json":
        (path / "config.json").write_text(json.dumps({"hello": 1}))
    assert cli.main(["eval", str(path), "--json"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "earl eval runs/latest" in err
    assert ("does not exist" if make == "missing" else "neither a run folder") in err
    assert json.loads(out.strip().splitlines()[-1])["exit_code"] == 2
