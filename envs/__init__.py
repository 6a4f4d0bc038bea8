"""Environments: plain synchronous games and tasks with reset(seed)/step(action) and rewards.

- `earl.envs.tictactoe.TicTacToe`: vs random or minimax, one digit per move.
- `earl.envs.connect4.ConnectFour`: vs random or depth-limited minimax, one column per move.
- `earl.envs.arithmetic`: word problems and the `calculator` tool.
- `earl.envs.python_tool.python`: the sandboxed `python` tool.
- `earl.envs.sim_tools`: synthetic tools (sleep, fail, crash) for tests and `earl stress`.

They know nothing about tokens or engines; the agent loops in `earl.agents` play them.
"""
