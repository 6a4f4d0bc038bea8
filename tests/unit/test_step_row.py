"""`step_row`: a trained step's metrics row counts its own episodes' turns and model tokens
(what `bench/peers.py` compares with TRL's as the same work)."""

from __future__ import annotations

from earl.loop.schedule import StepRecord
from earl.loop.step_log import step_row
from earl.stages.batch_types import BatchResult, Episode


def _episode(i: int, turns: int, generated: int) -> Episode:
    return Episode(sample_id=f"s{i}", group_id="g0", reward=1.0, tokens=3 * generated,
                   generated=generated, turns=turns, version_sum=4 * generated,
                   first_version=4)


def test_turns_and_generated_means_are_the_steps_episodes() -> None:
    eps = [_episode(0, 1, 8), _episode(1, 3, 20), _episode(2, 5, 32)]
    rec = StepRecord(version=5, result=BatchResult(batch=4, episodes=eps, samples=3,
                                                   seconds=1.0),
                     train={"loss": 0.5}, step_s=2.0, lr_scale=1.0)
    row = step_row(rec, steps=10)
    assert row["episodes"] == 3
    assert row["turns_mean"] == 3.0
    assert row["generated_mean"] == 20.0
    assert row["staleness"] == 0.0  # every token sampled by version 4, trained at step 5
    assert row["train/loss"] == 0.5


def test_staleness_max_is_the_oldest_token_the_trainer_kept_in_the_loss() -> None:
    eps = [_episode(0, 1, 8)]  # first token by version 4
    res = BatchResult(batch=9, episodes=eps, samples=1, seconds=1.0)
    rec = StepRecord(version=10, result=res, train={}, step_s=1.0, lr_scale=1.0)
    assert step_row(rec, steps=20)["staleness_max"] == 5  # from the episodes
    rec.train = {"oldest_version": 7.0, "stale_tokens": 3.0}  # the trainer masked older ones
    row = step_row(rec, steps=20)
    assert row["staleness_max"] == 2 and row["train/stale_tokens"] == 3.0
