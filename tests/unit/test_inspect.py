"""`earl inspect` on any run: step ranges count each trajectory once, tool-use and user-agent
runs summarise, `--show` marks the loss mask, `--replay` re-plays board games."""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.connect4 import connect4_agent, connect4_sim_responder
from earl.agents.rollout import RolloutConfig, run_agent
from earl.commands import inspect as insp
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.arithmetic import CalcTasks
from earl.models.tiny import build_tokenizer
from earl.recipes.calc import calc_agent, warm_start_responder

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder like `earl train` writes: rank 0 and rank 1 dumps, weights/ tokenizer."""
    out = tmp_path_factory.mktemp("run")
    tok = build_tokenizer()
    tok.save_pretrained(str(out / "weights"))
    codec = ChatCodec(tok)
    calc_engine = SimEngine(SimConfig(time_scale=0.0), responder=warm_start_responder(codec))
    c4_engine = SimEngine(SimConfig(time_scale=0.0), responder=connect4_sim_responder(codec))
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=72))
    tasks = CalcTasks("train")
    files = [(out / "trajectories.jsonl").open("w"), (out / "trajectories.1.jsonl").open("w")]
    for step in range(1, 8):  # 7 steps x 2 calc episodes, one per rank; one game at step 7
        for rank, f in enumerate(files):
            t = asyncio.run(run_agent(calc_agent, tasks.sample(step * 2 + rank),
                                      engine=calc_engine, codec=codec, config=cfg,
                                      sample_id=f"c{step}-{rank}"))
            f.write(json.dumps(dict(asdict(t), step=step, advantage=0.5)) + "\n")
    t = asyncio.run(run_agent(connect4_agent, 6, engine=c4_engine, codec=codec, config=cfg,
                              sample_id="game"))
    files[0].write(json.dumps(dict(asdict(t), step=7, advantage=-0.25)) + "\n")
    files[0].write('{"cut by a cr')  # the last line of a crashed run
    for f in files:
        f.close()
    return out


def test_summary_counts_each_step_once(run_dir: Path) -> None:
    trajs = insp._load(run_dir)
    assert len(trajs) == 15
    s = insp.summary(trajs)
    assert s["steps"] == 7 and s["trajectories"] == 15
    rows = s["by_steps"]
    assert sum(r["episodes"] for r in rows) == 15  # no step counted in two ranges
    bounds = [tuple(map(int, r["steps"].split("-"))) for r in rows]
    assert all(hi < lo2 for (_, hi), (lo2, _) in itertools.pairwise(bounds))
    assert bounds[0][0] == 1 and bounds[-1][1] == 7
    last = rows[-1]
    assert "info.tool_calls" in rows[0] and "outcome_win" in last or "outcome_loss" in last
    assert insp._ranges([5]) == [(5, 5)] and insp._ranges([1, 2]) == [(1, 1), (2, 2)]


def test_show_marks_the_loss_mask(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert insp.main([str(run_dir), "--show", "3"]) == 0
    out = capsys.readouterr().out
    assert "15 trajectories over 7 steps" in out
    calc_block = out.split("--- c7-0")[1]
    assert f"{insp.OPEN}<tool_call>" in calc_block  # the generated call is marked
    assert "</tool_call><|im_end|>" + insp.CLOSE in calc_block
    # The tool's result is an observation, not generated: it is outside the marks.
    resp = calc_block.split("<tool_response>")[1]
    assert calc_block.count(insp.OPEN) == 2 and insp.CLOSE not in resp.split("</tool_response>")[0]
    assert insp.OPEN not in calc_block.split("<|im_start|>assistant\n")[0]  # the prompt


def test_render_brackets_exactly_the_generated_tokens() -> None:
    t = {"token_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 1, 1, 0, 0, 1]}
    text = insp.render(t, lambda ids: "".join(chr(96 + i) for i in ids))
    assert text == f"a{insp.OPEN}bc{insp.CLOSE}de{insp.OPEN}f{insp.CLOSE}"


def test_replay_board_games_only(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert insp.main([str(run_dir), "--replay", "game", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["match"] and res["replayed"] == res["recorded"]
    assert insp.main([str(run_dir), "--replay", "c3-1"]) == 2
    assert "not a board-game trajectory" in capsys.readouterr().err
    assert insp.main([str(run_dir / "nope")]) == 2
