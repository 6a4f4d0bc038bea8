"""`earl chaos --soak`: its fault schedule and the summary of its samples (RSS growth after
warm-up per actor, the folder's size, steps/s per window), on made-up samples."""

from __future__ import annotations

from bench_scripts import load

from earl.commands.chaos_draw import DRAWN
from earl.commands.chaos_soak import WARMUP_S, WINDOW_S, schedule, summarize


def test_a_soak_draws_a_fault_per_slot_from_its_seed() -> None:
    faults, due = schedule(121, 300, seed=1)
    assert len(faults) == len(due) == 23  # 24 slots of 5 min, none in the last
    assert set(faults) <= set(DRAWN) and len(set(faults)) > 5  # drawn with replacement
    assert all(300 * (i + 1) * 0.8 - 1e-9 <= d <= 300 * (i + 1) + 60 for i, d in enumerate(due))
    assert due == sorted(due)
    assert schedule(121, 300, seed=1) == (faults, due)  # replayed by its seed
    assert schedule(121, 300, seed=2) != (faults, due)


def _rows(rss: dict[str, list[float]], seconds: float, step_s: float = 30.0) -> list[dict]:
    n = int(seconds / step_s) + 1
    return [{"t": i * step_s, "step": 2 * i,
             "rss_mib": {k: v[min(i * len(v) // n, len(v) - 1)] for k, v in rss.items()},
             "folder_mib": {"metrics.jsonl": 0.01 * i, "checkpoint": 3.0}} for i in range(n)]


def test_rss_growth_compares_the_last_window_with_the_one_after_warm_up() -> None:
    end = WARMUP_S + 4 * WINDOW_S
    rows = _rows({"producer[0]": [400.0] * 10 + [500.0] * 10,  # grew by a quarter
                  "trainer[0]": [600.0] * 20}, end)
    s = summarize(rows)
    assert s["rss"]["trainer[0]"]["growth"] == 0.0
    assert s["rss"]["producer[0]"]["growth"] == 0.25 and s["max_rss_growth"] == 0.25
    assert s["folder_mib_end"] > s["folder_mib_after_warmup"] >= 3.0
    assert {w["steps_per_s"] for w in s["steps_per_s"]} == {round(2 / 30, 3)}


def test_a_short_soak_reports_no_growth_rather_than_a_made_up_one() -> None:
    s = summarize(_rows({"rollout[0]": [900.0]}, 300))
    assert s["rss"]["rollout[0]"]["growth"] is None and s["max_rss_growth"] is None
    assert summarize([]) == {"samples": 0}


def test_the_folder_is_bounded_when_only_step_logs_grow_and_by_little_a_step() -> None:
    rows = _rows({"trainer[0]": [600.0]}, WARMUP_S + 2 * WINDOW_S)
    growth = summarize(rows)["folder_growth"]
    # 0.01 MiB per 30 s sample, 2 steps per sample: 5.12 KiB a step of metrics
    assert growth["metrics.jsonl"]["kib_per_step"] == 5.12
    assert growth["checkpoint"] == {"after_warmup_mib": 3.0, "end_mib": 3.0, "kib_per_step": 0.0}
    soak = load("soak")
    assert soak.folder_bounded(growth)["ok"]
    piled = {**growth, "checkpoint": {"after_warmup_mib": 3.0, "end_mib": 9.0, "kib_per_step": 1}}
    assert soak.folder_bounded(piled) == {"value": {
        "step_logs_kib_per_step": 5.12, "trajectories_mib": 0.0,
        "parts_that_grew": ["checkpoint"]}, "ok": False}
    chatty = {**growth, "tb": {"after_warmup_mib": 0.0, "end_mib": 9.0, "kib_per_step": 4.0}}
    assert not soak.folder_bounded(chatty)["ok"]  # 9.12 KiB a step of logs
    assert not soak.folder_bounded({})["ok"]


def _critic_checkpoint(root, states: int, replies: int) -> None:
    """A checkpoint in force whose producer holds a Tic-Tac-Toe critic with `states`
    observations and `replies` replies for each."""
    import json

    from earl.recipes.tictactoe.critic import TabularCritic

    c = TabularCritic(q_weight=4.0, max_states=2000, max_replies=4)
    for s in range(states):
        key = s.to_bytes(4, "little") * 10
        c.values[key] = 0.5
        c.q[key] = {(s, r): (0.5, 1) for r in range(replies)}
    folder = root / "checkpoint" / "step-000010" / "producers"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "0.json").write_text(json.dumps(c.state_dict()))
    (root / "checkpoint" / "manifest.json").write_text(json.dumps({"folder": "step-000010"}))


def test_the_checkpoint_may_grow_while_its_critic_fills_up_to_its_caps(tmp_path) -> None:
    from earl.commands.critic_fill import critic_fill

    assert critic_fill(tmp_path) is None  # no checkpoint yet
    _critic_checkpoint(tmp_path, states=500, replies=1)
    early = critic_fill(tmp_path)
    _critic_checkpoint(tmp_path, states=1000, replies=2)
    end = critic_fill(tmp_path)
    assert (early["states"], end["states"], end["replies"]) == (500, 1000, 2000)
    # full: 2,000 observations with 4 replies each, from each table's size per entry (a row's
    # key counted with its replies: the bound tightens from above as rows fill)
    assert early["mib"] < end["mib"] < end["full_mib"] <= early["full_mib"]
    soak = load("soak")
    rest = 2.0  # the trainer's part of the checkpoint
    part = {"after_warmup_mib": rest + early["mib"], "end_mib": rest + end["mib"] + 1.1,
            "kib_per_step": 1.0, "critic": {"after_warmup": early, "end": end}}
    assert soak.folder_bounded({"checkpoint": part})["ok"]  # the rest grew 1.1 MiB: within 10% + 1
    part_grew = {**part, "end_mib": rest + end["mib"] + 2.0}  # the rest grew by 2 MiB
    assert not soak.folder_bounded({"checkpoint": part_grew})["ok"]
    over = {**part, "critic": {"after_warmup": early, "end": {**end, "full_mib": 0.001}}}
    assert not soak.folder_bounded({"checkpoint": over})["ok"]  # a table past its bound


def test_the_soak_reads_the_critic_fill_in_a_child_process(tmp_path) -> None:
    """The driver never parses the critic's JSON itself (its heap is measured): a child does,
    and its answer is the same."""
    import asyncio

    from earl.commands.chaos_soak import _critic_fill_apart
    from earl.commands.critic_fill import critic_fill

    assert asyncio.run(_critic_fill_apart(tmp_path)) is None
    _critic_checkpoint(tmp_path, states=300, replies=2)
    assert asyncio.run(_critic_fill_apart(tmp_path)) == critic_fill(tmp_path)
