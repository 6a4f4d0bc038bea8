"""The Tic-Tac-Toe gauntlet (earl.agents.gauntlet) and its recipe (earl.recipes.gauntlet) on the
SimEngine: games follow one another in one context until a loss or the cap, an illegal move ends
the gauntlet, the trajectory cap is reported as truncation, info and per-move rewards agree,
the warm start yields soft targets, the critic credits moves per game, and the metric."""

from __future__ import annotations

import asyncio
import random

import pytest

from earl.agents.chat import ChatCodec
from earl.agents.gauntlet import GauntletConfig, game_seed, make_gauntlet_agent
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tictactoe import free_squares, sim_responder
from earl.engine import Responder, SamplingParams, SimConfig, SimEngine
from earl.envs.tictactoe import minimax_move
from earl.models.tiny import build_tokenizer
from earl.recipes.gauntlet import GAUNTLET, metric, recipe, safe_squares, warm_start
from earl.recipes.gauntlet.critic import GameCritic, split_games
from earl.recipes.tictactoe.critic import TabularCritic
from earl.runtime.types import Trajectory
from earl.stages.batch_types import Episode, episode_of

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def _board(codec: ChatCodec, prompt_ids: list[int]) -> str:
    """The last board of a prompt as 9 chars of 'X', 'O', ' ' (the agent plays X)."""
    rows = codec.decode(prompt_ids[-48:]).rsplit("<|im_end|>", 1)[0].split("\n")[-3:]
    return "".join("X" if c.islower() else "O" if c.isupper() else " " for r in rows for c in r)


def perfect(codec: ChatCodec) -> Responder:
    """A responder that plays minimax for X: it never loses a game (ties broken by the
    prompt, so the same prompt gets the same move)."""
    def respond(prompt_ids: list[int], rng: random.Random) -> list[int]:
        square = minimax_move(_board(codec, prompt_ids), "X", random.Random(len(prompt_ids))) + 1
        return codec.encode_text(str(square)) + [codec.end_id]
    return respond


def play(codec: ChatCodec, responder: Responder, seeds: range, config: GauntletConfig,
         max_total_tokens: int | None = None) -> list[Trajectory]:
    engine = SimEngine(SimConfig(time_scale=0.0, seed=3), responder=responder)
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=4, stop_token_ids=codec.stop_ids),
                        max_total_tokens=max_total_tokens)
    agent = make_gauntlet_agent(config)

    async def main() -> list[Trajectory]:
        # a fixed sample id per seed: the simulated engine's draws follow the session, so the
        # played games (and what the tests below count) are the same on every run
        return [await run_agent(agent, s, engine=engine, codec=codec, config=cfg,
                                sample_id=f"seed{s}") for s in seeds]

    return asyncio.run(asyncio.wait_for(main(), 60))


def check_consistent(t: Trajectory, config: GauntletConfig, codec: ChatCodec) -> None:
    """What a user reads off a gauntlet agrees with itself and with the transcript."""
    info = t.info
    assert not t.failed, t.error
    assert len(t.turn_rewards) == t.num_turns == info["moves"]
    assert t.reward == pytest.approx(sum(t.turn_rewards))
    ends = [r for r in t.turn_rewards if r != 0]  # one nonzero reward per finished game
    assert len(ends) == info["games"]
    assert sum(r == config.survive for r in ends) == info["survived"]
    assert info["survived"] == info["wins"] + info["draws"]
    assert sum(r == config.loss for r in ends[:-1]) == 0  # only the last game can be a loss
    assert (info["outcome"] == "loss") == (bool(ends) and ends[-1] == config.loss)
    assert info["illegal"] in (0, 1) and info["truncated"] in (0, 1)
    headers = codec.decode(t.token_ids).count("Next game:")  # one per game after the first
    assert headers == info["games"] - 1 or (info["truncated"] and headers == info["games"])


def test_legal_play_goes_on_after_a_game_and_ends_at_a_loss_or_the_cap(codec) -> None:
    cfg = GauntletConfig(max_games=6, opens="alternate")
    trajs = play(codec, sim_responder(codec), range(40), cfg)
    for t in trajs:
        check_consistent(t, cfg, codec)
        assert t.info["illegal"] == 0 and t.info["truncated"] == 0
        lost = t.info["outcome"] == "loss"
        assert lost or t.info["games"] == cfg.max_games
        assert t.info["survived"] == t.info["games"] - lost
        assert t.reward == t.info["survived"] * cfg.survive + lost * cfg.loss
    games = [t.info["games"] for t in trajs]
    assert max(games) > 1 and min(games) == 1  # some continue past the first game, some don't
    assert any(t.info["games"] == cfg.max_games and t.info["outcome"] != "loss" for t in trajs)


def test_a_player_that_never_loses_plays_to_the_cap_and_contexts_grow_with_it(codec) -> None:
    cfg = GauntletConfig(max_games=8, opens="opponent")
    good = play(codec, perfect(codec), range(4), cfg)
    bad = play(codec, sim_responder(codec), range(40), cfg)
    for t in good:
        check_consistent(t, cfg, codec)
        assert t.info["games"] == t.info["survived"] == 8 and t.info["outcome"] != "loss"
        assert t.reward == 8 * cfg.survive
    assert min(len(t) for t in good) > 4 * sorted(len(t) for t in bad)[len(bad) // 2]


def test_an_illegal_move_ends_the_gauntlet(codec) -> None:
    cfg = GauntletConfig(max_games=10, loss=-2.0)
    first = play(codec, sim_responder(codec, illegal_rate=1.0), range(4), cfg)
    for t in first:
        check_consistent(t, cfg, codec)
        assert t.info["games"] == 1 and t.info["illegal"] == 1
        assert t.info["outcome"] == "loss" and t.info["survived"] == 0
        assert t.turn_rewards == [-2.0] and t.reward == -2.0
    later = play(codec, sim_responder(codec, illegal_rate=0.15), range(60), cfg)
    for t in later:
        check_consistent(t, cfg, codec)
    late_illegal = [t for t in later if t.info["illegal"] == 1 and t.info["games"] > 1]
    assert late_illegal  # an illegal move after a survived game still ends it, as a loss
    assert all(t.info["outcome"] == "loss" for t in late_illegal)


def test_the_trajectory_cap_is_truncation_not_a_crash(codec) -> None:
    cfg = GauntletConfig(max_games=20, opens="opponent")
    for t in play(codec, perfect(codec), range(3), cfg, max_total_tokens=500):
        assert not t.failed and t.info["truncated"] == 1 and t.truncated
        assert 0 < t.info["games"] < 20 and t.info["outcome"] != "loss"
        assert len(t.token_ids) <= 500
        check_consistent(t, cfg, codec)


def test_games_have_their_own_seeds_and_who_opens(codec) -> None:
    cfg = GauntletConfig(max_games=4, opens="opponent")
    a, b = play(codec, perfect(codec), range(5, 6), cfg), play(codec, perfect(codec),
                                                              range(5, 6), cfg)
    assert a[0].token_ids == b[0].token_ids  # the episode seed fixes every game
    assert game_seed(5, 3) != game_seed(6, 3) and game_seed(5, 0) != game_seed(5, 1)
    boards = codec.decode(a[0].token_ids).split("Next game:\n")
    assert len(boards) == 4  # every new game starts with one O on the board (opponent opens)
    assert all(sum(ch.isupper() for ch in b.split("<|im_end|>")[0][-11:]) == 1 for b in boards)
    alt = play(codec, perfect(codec), range(2), GauntletConfig(max_games=2, opens="alternate"))
    opening = [codec.decode(t.token_ids).split("<|im_end|>")[0][-11:] for t in alt]
    assert opening[0] == "123\n456\n789"  # seed 0: the agent opens game 0 on an empty board
    assert sum(ch.isupper() for ch in opening[1]) == 1  # seed 1: the opponent does
    with pytest.raises(ValueError, match="opens"):
        GauntletConfig(opens="sometimes")
    with pytest.raises(ValueError, match="loss must cost"):
        GauntletConfig(loss=0.5)


def test_the_warm_start_returns_soft_targets_on_legal_moves(codec) -> None:
    ids, targets = asyncio.run(asyncio.wait_for(warm_start(codec, 12, 0), 60))
    assert len(ids) == len(targets) == 12
    lengths = sorted(len(x) for x in ids)
    assert lengths[-1] > 4 * lengths[0]  # the cautious half reaches long contexts
    for x, rows in zip(ids, targets, strict=True):
        assert rows.ndim == 2 and rows.shape[1] == 3 and rows[:, 0].max() < len(x)
        by_pos: dict[int, float] = {}
        for pos, tok, w in rows:
            by_pos[int(pos)] = by_pos.get(int(pos), 0.0) + w
            if tok != codec.end_id:  # a digit: a free square of the board just shown
                legal = free_squares(codec.decode([int(v) for v in x[max(0, int(pos) - 48):
                                                                    int(pos)]]))
                assert codec.decode([int(tok)]) in legal
        assert all(abs(s - 1.0) < 1e-9 for s in by_pos.values())  # each position sums to 1


def test_safe_squares_wins_then_blocks() -> None:
    tail = "<|im_start|>user\nab3\nDE6\n789<|im_end|>\n<|im_start|>assistant\n"
    assert safe_squares(tail) == ["3"]  # X on 1, 2: win on 3 (before blocking O on 6)
    tail = "<|im_start|>user\na23\nDE6\n7h9<|im_end|>\n<|im_start|>assistant\n"
    assert safe_squares(tail) == ["6"]  # block O's row 4-5-6
    assert safe_squares("123\n456\n789<|im_end|>") == list("123456789")


def test_the_critic_credits_each_move_by_its_own_game(codec) -> None:
    cfg = GauntletConfig(max_games=5, opens="opponent")
    trajs = [t for t in play(codec, sim_responder(codec), range(40), cfg)
             if t.info["games"] == 2 and t.info["outcome"] == "loss"]
    assert trajs
    t = trajs[0]
    games, rewards, where = split_games([t], [t.turn_rewards])
    assert len(games) == 2 and where[0] == (0, 0) and where[1][1] == len(rewards[0])
    assert rewards[0][-1] == 1.0 and rewards[1][-1] == -1.0
    adv = GameCritic(alpha=0.2, lam=0.5).advantages([t], [t.turn_rewards])[0]
    assert len(adv) == t.num_turns
    n1 = len(rewards[0])
    assert all(a > 0 for a in adv[:n1])  # the survived game is credited, though the gauntlet lost
    assert adv[-1] < 0
    whole = TabularCritic(alpha=0.2, lam=0.5).advantages([t], [t.turn_rewards])[0]
    assert whole[n1 - 1] < adv[n1 - 1]  # the whole-gauntlet table blames game 1 for game 2
    # a game's first observation is the tokens since the previous move, as in the whole gauntlet
    g2 = games[1]
    assert g2.token_ids == t.token_ids[t.turn_spans[n1 - 1][1]:]
    critic = GameCritic(alpha=0.2, lam=0.5, q_weight=2.0)
    for _ in range(3):
        critic.update(trajs, [x.turn_rewards for x in trajs])
    for i, k, act, gain in critic.better_actions(trajs):
        assert 0 <= k < trajs[i].num_turns and gain > 0 and act
    state = critic.state_dict()
    again = GameCritic(alpha=0.2, lam=0.5, q_weight=2.0)
    again.load_state_dict(state)
    assert again.advantages(trajs, [x.turn_rewards for x in trajs]) == \
        critic.advantages(trajs, [x.turn_rewards for x in trajs])


def test_metric_counts_games_per_gauntlet_and_failures_lose(codec) -> None:
    cfg = GauntletConfig(max_games=GAUNTLET.max_games, opens="opponent")
    eps = [episode_of(t) for t in play(codec, perfect(codec), range(2), cfg)]
    eps.append(Episode(sample_id="f", group_id="f", reward=None, failed=True, tokens=90,
                       info={"games": 3, "survived": 2}))
    m = metric(eps)
    assert m["episodes"] == 3
    assert m["games_survived"] == pytest.approx(2 * GAUNTLET.max_games / 3)
    assert m["win_draw_rate"] == pytest.approx(2 * GAUNTLET.max_games / (2 * GAUNTLET.max_games
                                                                        + 1))
    assert m["cap_rate"] == pytest.approx(2 / 3) and m["truncated_rate"] == 0
    assert m["win_rate"] + m["draw_rate"] + m["loss_rate"] == pytest.approx(1.0)
    assert m["tokens"] == pytest.approx(sum(e.tokens for e in eps) / 3)
    assert max(e.tokens for e in eps) <= recipe.config["model"]["max_model_len"]  # type: ignore[index]
    assert recipe.target_key in m
