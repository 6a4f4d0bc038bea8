"""Environments (rules, parsing, opponents) and their agent loops on the simulated engine."""

from __future__ import annotations

import asyncio
import json

import pytest

from earl.agents.calc import calc_agent, tool_sim_responder
from earl.agents.chat import ChatCodec
from earl.agents.connect4 import connect4_agent, connect4_sim_responder
from earl.agents.rollout import RolloutConfig, run_agent
from earl.agents.tictactoe import make_tictactoe_agent, sim_responder, tictactoe_agent
from earl.engine import SamplingParams, SimConfig, SimEngine
from earl.envs.arithmetic import ArithmeticProblems, calculator, score
from earl.envs.connect4 import ConnectFour, ConnectFourConfig
from earl.envs.tictactoe import TicTacToe, TicTacToeConfig
from earl.models.tiny import build_tokenizer


@pytest.fixture(scope="module")
def codec() -> ChatCodec:
    return ChatCodec(build_tokenizer())


def test_tictactoe_rules_and_parsing() -> None:
    env = TicTacToe()
    assert env.reset(1).endswith("\n123\n456\n789")
    step = env.step(" 5\n")
    assert not step.done and "e" in step.observation.split("\n")[1]  # X on square 5
    (taken,) = [i + 1 for i, ch in enumerate(env.board) if ch == "O"]
    step = env.step(f"Move: {taken}")  # the opponent's square: illegal -> loss
    assert step.done and step.info == {"outcome": "loss", "illegal": 1, "moves": 1}
    assert step.reward == -1.0
    env.reset(2)
    assert env.step("no digit here").info["illegal"] == 1
    with pytest.raises(ValueError, match="reset"):
        env.step("1")
    with pytest.raises(ValueError, match="opponent"):
        TicTacToeConfig(opponent="perfect")


def test_opponent_can_open() -> None:
    env = TicTacToe(TicTacToeConfig(agent_first=False))
    obs = env.reset(4)
    assert len(env.legal_moves()) == 8
    assert "O took" in TicTacToe(TicTacToeConfig(agent_first=False, board_style="xo")).reset(4)
    (square,) = set(range(1, 10)) - set(env.legal_moves())
    assert obs.endswith(env.render()) and chr(64 + square) in env.render()


def test_board_styles() -> None:
    env = TicTacToe(TicTacToeConfig(board_style="cells"))
    env.board = "X O  O  X"
    assert env.render() == "a2C\n45F\n78i"
    env = TicTacToe(TicTacToeConfig(board_style="xo"))
    env.board = "X O  O  X"
    assert env.render() == "X2O\n45O\n78X"
    with pytest.raises(ValueError, match="board_style"):
        TicTacToeConfig(board_style="emoji")


def test_minimax_never_loses() -> None:
    import random

    for seed in range(30):
        env = TicTacToe(TicTacToeConfig(opponent="minimax"))
        env.reset(seed)
        rng = random.Random(seed)
        while True:
            step = env.step(str(rng.choice(env.legal_moves())))
            if step.done:
                assert step.info["outcome"] in ("draw", "loss"), env.board
                break


def test_connect_four_rules() -> None:
    env = ConnectFour(ConnectFourConfig(opponent="minimax", depth=2))
    env.reset(0)
    # Stack column 1; minimax must block the vertical three.
    step = env.step("1")
    step = env.step("1") if not step.done else step
    step = env.step("1") if not step.done else step
    assert not step.done and env.grid[3][0] == "O"
    env = ConnectFour()
    env.reset(0)
    for _ in range(3):
        env.grid[5][6] = "O"
    assert env.step("7").info == {"outcome": "loss", "illegal": 1, "moves": 0}
    env.reset(0)
    assert env.step("8").info["illegal"] == 1


def test_calculator_is_safe_and_exact() -> None:
    assert calculator("3 * (4 + 5)") == "27" and calculator("7/2") == "3.5"
    for bad in ("__import__('os')", "open('x')", "2**10**10", "1/0", "a+1"):
        with pytest.raises(ValueError):
            calculator(bad)
    p = ArithmeticProblems(3).problem(5)
    assert p == ArithmeticProblems(3).problem(5) and str(p.answer) == calculator(p.expression)
    assert score(f"so it is {p.answer}", p.answer) == 1.0 and score("12", p.answer + 1) == 0.0


def test_tictactoe_agent_plays_full_games(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0), responder=sim_responder(codec))

    async def main():
        return await asyncio.gather(*(run_agent(tictactoe_agent, s, engine=engine, codec=codec)
                                      for s in range(20)))

    trajs = asyncio.run(main())
    for t in trajs:
        assert not t.failed, t.error
        assert t.info["illegal"] == 0 and t.info["outcome"] in ("win", "draw", "loss")
        assert len(t.turn_rewards) == len(t.turn_spans) == t.info["moves"]
        assert t.reward == pytest.approx(sum(t.turn_rewards))
        text = codec.decode(t.token_ids)
        assert text.count("<|im_start|>user") == len(t.turn_spans)  # a board per move
        for s, e in t.turn_spans:
            assert e - s == 2  # one digit + end token: compact for a char-level model
    assert {t.info["outcome"] for t in trajs} >= {"win", "loss"}


def test_illegal_moves_lose_with_per_move_rewards(codec: ChatCodec) -> None:
    cfg = TicTacToeConfig(legal_move=0.1)
    engine = SimEngine(SimConfig(time_scale=0.0),
                       responder=sim_responder(codec, illegal_rate=0.5))
    agent = make_tictactoe_agent(cfg)

    async def main():
        return await asyncio.gather(*(run_agent(agent, s, engine=engine, codec=codec)
                                      for s in range(10)))

    trajs = asyncio.run(main())
    illegal = [t for t in trajs if t.info["illegal"] == 1]
    assert illegal
    for t in illegal:
        assert t.info["outcome"] == "loss" and t.turn_rewards[-1] == -1.0
        assert all(r == 0.1 for r in t.turn_rewards[:-1])


def test_connect4_agent_plays(codec: ChatCodec) -> None:
    engine = SimEngine(SimConfig(time_scale=0.0), responder=connect4_sim_responder(codec))
    t = asyncio.run(run_agent(connect4_agent, 3, engine=engine, codec=codec))
    assert not t.failed and t.info["illegal"] == 0 and t.info["moves"] >= 4


def test_calc_agent_with_scripted_correct_model(codec: ChatCodec) -> None:
    problem = ArithmeticProblems(0).problem(1)
    call = json.dumps({"name": "calculator", "arguments": {"expression": problem.expression}})
    replies = [f"<tool_call>{call}</tool_call>", None]

    def respond(prompt_ids, rng):
        tail = codec.decode(prompt_ids[-40:])
        text = replies[0] if "<tool_response>" not in tail else \
            "It is " + tail.split("<tool_response>")[-1].split("</tool_response>")[0]
        return codec.encode_text(text) + [codec.end_id]

    engine = SimEngine(SimConfig(time_scale=0.0), responder=respond)
    cfg = RolloutConfig(sampling=SamplingParams(max_tokens=200))
    t = asyncio.run(run_agent(calc_agent, problem, engine=engine, codec=codec, config=cfg))
    assert t.reward == 1.0 and t.info["tool_calls"] == 1 and t.info["tool_errors"] == 0
    # The generic sim responder also completes (its answer is usually wrong).
    engine = SimEngine(SimConfig(time_scale=0.0), responder=tool_sim_responder(codec))
    t = asyncio.run(run_agent(calc_agent, problem, engine=engine, codec=codec, config=cfg))
    assert not t.failed and len(t.turn_spans) == 2 and t.info["tool_calls"] == 1
    t = asyncio.run(run_agent(calc_agent, 5, engine=engine, codec=codec, config=cfg))
    assert t.failed and "Problem" in t.error


def test_free_squares_read_the_last_board_in_either_style() -> None:
    from earl.agents.tictactoe import free_squares

    cells = "<|im_start|>user\n123\n456\n789<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n" \
            "<|im_start|>user\naB3\n4e6\n789<|im_end|>\n<|im_start|>assistant\n"
    assert free_squares(cells) == ["3", "4", "6", "7", "8", "9"]
    assert free_squares("O took 2\nXO3\n456\n789<|im_end|>\n") == list("3456789")
