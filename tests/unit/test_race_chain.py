"""bench/race_chain.py's pure parts: the evaluation points, which snapshot stands for a point,
time to a threshold, a process tree's CPU time; and TRL's rollout of the recipe's agent
(`bench/_race_rollout.py`): episodes batched while they wait, model tokens alone trained."""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import _race_rollout as rr
from _race_measure import TreeCpu, eval_points, policy_at, time_to, verdict, versus

from earl.agents.chat import ChatCodec
from earl.envs.chain import SymbolicTasks
from earl.models.tiny import build_tokenizer
from earl.recipes import chain_smollm2

pytestmark = pytest.mark.timeout(60)


def test_eval_points_every_interval_and_the_budget_end() -> None:
    assert eval_points(45, 5) == [300.0 * k for k in range(1, 10)]
    assert eval_points(12, 5) == [300.0, 600.0, 720.0]  # the end once, though not a multiple
    assert eval_points(2, 5) == [120.0]
    with pytest.raises(ValueError, match="eval-every-min"):
        eval_points(45, 0)


def test_policy_at_is_the_last_saved_at_or_before_the_point() -> None:
    saved = [(100.0, "start"), (160.0, "s0"), (230.0, "s1"), (300.0, "s2")]
    assert policy_at(saved, 60) is None  # still warming up: the base model
    assert policy_at(saved, 229.9) == "s0"
    assert policy_at(saved, 300) == "s2"  # saved exactly then: in force
    assert policy_at(saved, 1e9) == "s2"


def test_time_to_threshold_and_point_by_point_comparison() -> None:
    earl = [(300.0, 0.1), (600.0, 0.35), (900.0, 0.3)]
    trl = [(300.0, 0.2), (600.0, 0.25), (900.0, 0.3)]
    assert time_to(earl, 0.3) == 600.0
    assert time_to(trl, 0.31) is None
    rows = versus(earl, trl)
    assert [r["earl_at_least"] for r in rows] == [False, True, True]
    with pytest.raises(ValueError, match="same points"):
        versus(earl, trl[:2])


def test_verdict_compares_earl_with_the_best_arm_at_each_point() -> None:
    earl = [(300.0, 0.1), (600.0, 0.3), (900.0, 0.4)]
    trl = {"gc_off": [(300.0, 0.2), (600.0, 0.2), (900.0, 0.25)],
           "gc_on": [(300.0, 0.0), (600.0, 0.3), (900.0, 0.2)]}
    v = verdict(earl, trl)
    assert v["trl_best_curve"] == [(300.0, 0.2), (600.0, 0.3), (900.0, 0.25)]
    assert v["earl_at_least_after_first"] is True  # behind at the first point only
    assert v["earl_time_to_trl_final_s"] == 600.0  # EARL reached TRL's best final (0.25) then
    trl["gc_on"] = [(300.0, 0.0), (600.0, 0.35), (900.0, 0.2)]
    assert verdict(earl, trl)["earl_at_least_after_first"] is False
    assert verdict(earl, {})["versus"] is None  # every arm failed: nothing to compare


def test_tree_cpu_keeps_exited_processes_and_tells_reused_pids_apart() -> None:
    cpu = TreeCpu()
    cpu.update([(10, 1.0, 2.0), (11, 1.5, 1.0)])
    cpu.update([(10, 1.0, 5.0)])  # 11 exited: its last reading stays
    cpu.update([(11, 9.0, 0.5)])  # pid 11 again, another process
    assert cpu.total() == pytest.approx(6.5)
    assert cpu.processes() == 3


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def _scripted(codec: ChatCodec, calls: list[int], fail: bool = False) -> rr.GenerateBatch:
    """A batch generator that solves SymbolicTasks (the recipe's warm-start script)."""
    respond = chain_smollm2.warm_start_responder(codec)

    def generate(batch: list[list[int]]) -> list[list[int]]:
        calls.append(len(batch))
        if fail:
            raise RuntimeError("generation failed")
        return [respond(p, random.Random(0)) for p in batch]

    return generate


def test_rollout_plays_the_recipe_agent_batched_and_masks_tool_output(codec: ChatCodec) -> None:
    tasks = [SymbolicTasks(seed=3).sample(k) for k in range(6)]
    calls: list[int] = []
    engine = rr.BatchedEngine(_scripted(codec, calls), window=2048, stop_ids=codec.stop_ids)
    config = rr.sampling(128, 1.0, codec.stop_ids, 2048, None)
    trajs = asyncio.run(rr.play(chain_smollm2.agent, tasks, engine, codec, config))
    out = rr.trl_fields(trajs, codec.end_id)
    assert out["episode_reward"] == [1.0] * 6  # the script solves every task
    assert calls[0] == 6  # every episode's first turn in one generation call
    assert sum(calls) == sum(int(t["steps"]) + 1 for t in tasks)  # a call per step, an answer
    for t, prompt, comp, mask in zip(trajs, out["prompt_ids"], out["completion_ids"],
                                     out["env_mask"], strict=True):
        assert prompt + comp == t.token_ids
        assert len(mask) == len(comp) and mask[0] == 1  # the completion opens with the model
        text = codec.decode([tok for tok, m in zip(comp, mask, strict=True) if m])
        assert "<tool_response>" not in text and "<tool_call>" in text  # model tokens only
        assert "<tool_response>" in codec.decode(comp)


def test_a_failed_generation_fails_its_episodes_instead_of_hanging(codec: ChatCodec) -> None:
    calls: list[int] = []
    engine = rr.BatchedEngine(_scripted(codec, calls, fail=True), window=2048,
                              stop_ids=codec.stop_ids)
    config = rr.sampling(128, 1.0, codec.stop_ids, 2048, None)
    tasks = [SymbolicTasks(seed=3).sample(k) for k in range(2)]
    trajs = asyncio.run(rr.play(chain_smollm2.agent, tasks, engine, codec, config))
    assert all(t.failed and "generation failed" in str(t.error) for t in trajs)
    out = rr.trl_fields(trajs, codec.end_id)
    assert out["episode_reward"] == [0.0, 0.0]
    assert out["completion_ids"] == [[codec.end_id]] * 2 and out["env_mask"] == [[0]] * 2


def test_cpu_between_reads_a_window_of_the_timeline() -> None:
    from _race_measure import cpu_between

    line = [(0.0, 0.0), (10.0, 30.0), (20.0, 40.0), (30.0, 60.0)]  # a busy start-up first
    assert cpu_between(line, 10.0, 30.0) == 30.0
    assert cpu_between(line, 15.0, 25.0) == pytest.approx(15.0)  # interpolated
    assert cpu_between(line, -5.0, 99.0) == 60.0  # clamped at the ends
    with pytest.raises(ValueError, match="reading"):
        cpu_between([], 0.0, 1.0)


def test_peers_per_cpu_second_shares_the_window_of_its_rate() -> None:
    import peers

    steps = [{"wall_s": 20.0 + i, "reward": 0.0} for i in range(11)]  # steps from 20 s to 30 s
    tree = peers.Tree(stdout="", peak_rss_mb=0.0, cpu_s=100.0,
                      cpu_timeline=[(0.0, 0.0), (20.0, 60.0), (30.0, 80.0), (40.0, 100.0)])
    s = peers.summarize(steps, 32, 8.0, 40.0, tree, threshold=1.0)
    assert s["trajectories_per_s"] == 32.0 and s["cpu_s"] == 20.0 and s["cores_used"] == 2.0
    assert s["trajectories_per_cpu_s"] == 16.0  # 10 steps x 32 over 20 CPU-s, not start-up's
    assert s["trajectories_per_cpu_s_whole_run"] == 3.52  # 11 x 32 / 100


def test_a_screened_arm_is_rated_from_its_loop_start_to_its_last_step() -> None:
    from race_chain import screen_rate

    trl = {"loop_start_s": 100.0, "batch_size": 64,
           "steps": [{"step": 1, "wall_s": 400.0}, {"step": 2, "wall_s": 500.0}]}
    r = screen_rate(trl)  # the first generation's time counts: 128 trajectories in 400 s
    assert r["steps"] == 2 and r["trajectories"] == 128 and r["trajectories_per_s"] == 0.32
    assert screen_rate({**trl, "steps": []})["trajectories_per_s"] is None


def test_the_base_model_is_evaluated_once_for_every_side(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    import race_chain

    ran: list[str] = []  # the folders evaluated
    monkeypatch.setattr(race_chain, "policy_folder",
                        lambda key, work, base: (tmp_path / f"{key[0]}-{key[1]}", None))
    monkeypatch.setattr(race_chain, "evaluate",
                        lambda folder, n, out: ran.append(folder.name) or {"accuracy": 0.25})
    keys = [("earl", None), ("gc_off", None), ("earl", "start"), ("gc_off", "start")]
    got = race_chain.evaluate_policies(keys, tmp_path, tmp_path, 8, 2)
    assert sorted(ran) == ["base-None", "earl-start", "gc_off-start"]  # one base evaluation
    assert set(got) == set(keys) and got[("gc_off", None)]["accuracy"] == 0.25


def test_a_killed_side_names_the_signal_and_its_peak_memory() -> None:
    from race_chain import Tree, exit_reason

    assert exit_reason(Tree(rc=1)) == "exited 1"
    why = exit_reason(Tree(rc=-9, peak_rss_mb=23456.0))
    assert why.startswith("killed by SIGKILL") and "23,456 MiB" in why
