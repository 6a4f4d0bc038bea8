"""Fault schedules drawn from a seed (`earl chaos --draw`): the same seed draws the same
schedule; faults are distinct, in step order, within the run; only deaths healed in place
overlap; stall:tool comes last, kill:resave after a checkpoint."""

from __future__ import annotations

import pytest

from earl.commands.chaos_draw import DRAWN, HEALED_IN_PLACE, draw


def test_a_seed_draws_one_schedule_and_seeds_differ() -> None:
    assert draw(4, 7, 10) == draw(4, 7, 10)
    assert len({draw(4, s, 10).faults for s in range(20)}) > 10


@pytest.mark.parametrize("seed", range(60))
def test_drawn_schedules_keep_their_rules(seed: int) -> None:
    n = 1 + seed % 6
    d = draw(n, seed, 8)
    assert len(set(d.faults)) == n and set(d.faults) <= set(DRAWN)
    assert "lose:sample" not in d.faults and "kill:rollout_span" not in d.faults
    assert list(d.after_step) == sorted(d.after_step)
    assert all(1 <= s <= 6 for s in d.after_step) and all(0 <= a <= 1 for a in d.at)
    assert not d.overlap[0]
    for i in range(1, n):
        if d.overlap[i]:
            assert d.faults[i] in HEALED_IN_PLACE and d.faults[i - 1] in HEALED_IN_PLACE
    if "stall:tool" in d.faults:
        assert d.faults[-1] == "stall:tool"
    if "kill:resave" in d.faults:
        assert d.after_step[d.faults.index("kill:resave")] >= 2


def test_bad_draws_are_refused() -> None:
    with pytest.raises(ValueError, match="--draw"):
        draw(0, 1, 8)
    with pytest.raises(ValueError, match="--steps"):
        draw(2, 1, 2)
