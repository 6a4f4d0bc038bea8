"""The Tic-Tac-Toe recipe's TabularCritic: values keyed by observation tokens, lambda-return
advantages; the recipe hands it to producers by reference."""

from __future__ import annotations

import pytest

from earl.recipe import critic_ref, load_critic, load_recipe
from earl.recipes.tictactoe import critic as tictactoe_critic
from earl.recipes.tictactoe.critic import TabularCritic, observation_keys, returns_to_go
from earl.runtime.types import Trajectory


def traj(obs: list[list[int]], sid: str = "s", moves: list[int] | None = None) -> Trajectory:
    """Turns alternate: observation tokens, then a 2-token assistant turn `[move, 2]`."""
    ids, spans = [], []
    for i, o in enumerate(obs):
        ids += o
        spans.append((len(ids), len(ids) + 2))
        ids += [moves[i] if moves else 7, 2]
    n = len(ids)
    return Trajectory(sample_id=sid, group_id="g", token_ids=ids, loss_mask=[0] * n,
                      logprobs=[0.0] * n, versions=[-1] * n, turn_spans=spans)


def test_keys_are_the_observation_tokens() -> None:
    a, b = traj([[1, 2], [3]]), traj([[1, 2], [4]])
    ka, kb = observation_keys(a), observation_keys(b)
    assert ka[0] == kb[0] and ka[1] != kb[1]
    assert returns_to_go([0.0, 0.0, 1.0]) == [1.0, 1.0, 1.0]


def test_hand_computed_advantages() -> None:
    c = TabularCritic(alpha=0.5, lam=0.5)
    t1, t2 = traj([[1], [2]]), traj([[1], [3]])
    # nothing seen: values 0, advantages are the lambda-returns
    assert c.advantages([t1], [[0.0, 1.0]]) == [[0.5, 1.0]]
    c.update([t1, t2], [[0.0, 1.0], [0.0, -1.0]])
    # V([1]) = 1 then 1 + 0.5 * (-1 - 1) = 0; V([2]) = 1; V([3]) = -1
    assert c.values[observation_keys(t1)[0]] == pytest.approx(0.0)
    (adv,) = c.advantages([t1], [[0.0, 1.0]])
    # turn 1: G = 1, A = 1 - V([2]) = 0; turn 0: G = 0 + 0.5 * 1 + 0.5 * V([2]) = 1, A = 1 - 0
    assert adv == pytest.approx([1.0, 0.0])
    (adv,) = c.advantages([t2], [[0.0, -1.0]])
    assert adv == pytest.approx([-1.0, 0.0])  # the move into the losing state is blamed


def test_q_table_blames_a_move_that_loses_only_sometimes() -> None:
    # From observation [1], move 8 loses 1 game in 4 and move 9 never does; later observations
    # differ per game so the lambda-return alone credits each game's outcome.
    c = TabularCritic(alpha=0.2, lam=1.0, q_weight=2.0)
    games = [(traj([[1], [10 + i]], moves=[8, 7]), [0.0, -1.0 if i % 4 == 0 else 1.0])
             for i in range(40)]
    safe = [(traj([[1], [100 + i]], moves=[9, 7]), [0.0, 1.0]) for i in range(40)]
    games = [g for pair in zip(games, safe, strict=True) for g in pair]  # interleaved
    for t, r in games:
        c.update([t], [r])
    lucky = traj([[1], [999]], moves=[8, 7])  # a won game that made the risky move
    (adv,) = c.advantages([lucky], [[0.0, 1.0]])
    assert adv[0] < 0  # blamed although this game was won
    plain = TabularCritic(alpha=0.2, lam=1.0)
    for t, r in games:
        plain.update([t], [r])
    assert plain.advantages([lucky], [[0.0, 1.0]])[0][0] > 0.05  # without Q: credited
    assert c.advantages([traj([[1], [5]], moves=[9, 7])], [[0.0, 1.0]])[0][0] > 0
    # self-imitation: the lucky game's first turn should have answered 9 instead
    ((i, k, tokens, gain),) = c.better_actions([lucky], min_visits=3, margin=0.1)
    assert (i, k, tokens) == (0, 0, (9, 2)) and gain > 0.1
    assert c.better_actions([traj([[1], [5]], moves=[9, 7])]) == []  # took the best one


def test_state_roundtrip_and_bad_args() -> None:
    c = TabularCritic(q_weight=1.0)
    c.update([traj([[1], [2]])], [[0.0, 0.5]])
    d = TabularCritic(q_weight=1.0)
    d.load_state_dict(c.state_dict())
    assert d.values == c.values and d.turn_means == c.turn_means and d.q == c.q and d.q
    with pytest.raises(ValueError, match="alpha"):
        TabularCritic(alpha=0.0)
    with pytest.raises(ValueError, match="lam"):
        TabularCritic(lam=2.0)
    with pytest.raises(ValueError, match="q_weight"):
        TabularCritic(q_weight=-1.0)


def test_the_recipe_supplies_its_critic_by_reference() -> None:
    recipe = load_recipe("tictactoe")
    assert recipe.critic is tictactoe_critic and recipe.config["algorithm"]["critic"] == "recipe"
    ref = critic_ref(recipe.critic)
    assert ref == "earl.recipes.tictactoe:critic"  # what a producer imports
    built = load_critic(ref)
    assert isinstance(built, TabularCritic)
    assert (built.alpha, built.lam, built.q_weight) == (0.2, 0.5, 2.0)
    with pytest.raises(TypeError, match="module level"):
        critic_ref(lambda: TabularCritic())


def test_a_long_run_of_new_observations_keeps_the_table_bounded() -> None:
    """A policy that still plays junk makes a new observation every game: the table forgets
    the least recently updated past `max_states` (it is checkpointed with the producer); one
    every game updates stays, with its running value."""
    c = TabularCritic(max_states=100, q_weight=1.0)
    games = [traj([[1000 + i], [2]]) for i in range(500)]
    for g in games:
        c.update([g], [[0.0, 1.0]])
    assert len(c.values) == 100 and len(c.q) == 100
    newest, oldest = observation_keys(games[-1])[0], observation_keys(games[0])[0]
    assert newest in c.values and oldest not in c.values
    shared = observation_keys(traj([[2]]))[0]  # every game's second observation
    assert list(c.values).index(shared) == 99 and c.values[shared] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="max_states"):
        TabularCritic(max_states=0)


def test_junk_replies_keep_each_observations_row_bounded() -> None:
    """Replies are token sequences: a policy replying junk makes a new one every game at the
    same observation (the 2-hour soak's producer grew by them). A row keeps `max_replies`,
    forgetting the least visited; a reply visited often stays."""
    c = TabularCritic(q_weight=1.0, max_replies=4)
    for i in range(200):
        c.update([traj([[1]], moves=[3])], [[1.0]])  # the good move, every game
        c.update([traj([[1]], moves=[1000 + i])], [[0.0]])  # a junk reply, new each game
    (row,) = c.q.values()
    assert len(row) == 4 and (3, 2) in row and row[(3, 2)][1] == 200
    with pytest.raises(ValueError, match="max_replies"):
        TabularCritic(max_replies=0)
