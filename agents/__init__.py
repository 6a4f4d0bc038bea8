"""Agents as async coroutines: the rollout API, tools, and ready-made loops for the envs.

An agent is `async def agent(rollout, sample) -> float | None` (the reward, or None to reject
the trajectory). `run_agent` runs one and returns its token-exact `Trajectory`:

    from earl.agents import ChatCodec, RolloutConfig, run_agent

    async def agent(rollout, problem):
        messages = [{"role": "user", "content": problem.question}]
        for _ in range(4):
            turn = await rollout.generate(messages, tools=[calculator])
            messages.append(turn.message)
            if not turn.tool_calls:  # only a final answer scores, never a tool's output
                return float(turn.content.strip() == str(problem.answer))
            for call in turn.tool_calls:
                messages.append(await rollout.call_tool(call))
        return 0.0

    traj = await run_agent(agent, problem, engine=engine, codec=ChatCodec(tokenizer))

Game loops: `earl.agents.tictactoe.tictactoe_agent` (its greedy evaluation lives with the
Tic-Tac-Toe recipe, `earl.recipes.tictactoe.evaluation`), `earl.agents.connect4.connect4_agent`;
tool loops: `earl.agents.calc.calc_agent`, `earl.agents.calc.python_agent`.
Agents written against the `openai` client: serve each session with
`run_agent(..., endpoint=earl.agents.openai_server.OpenAIEndpoint())` (example:
`earl.agents.openai_calc.agent`).
"""

from earl.agents.chat import ChatCodec as ChatCodec
from earl.agents.rollout import Agent as Agent
from earl.agents.rollout import AssistantTurn as AssistantTurn
from earl.agents.rollout import Rollout as Rollout
from earl.agents.rollout import RolloutConfig as RolloutConfig
from earl.agents.rollout import run_agent as run_agent
from earl.agents.tools import Tool as Tool
from earl.agents.tools import ToolCall as ToolCall
from earl.agents.tools import ToolResult as ToolResult
from earl.agents.tools import parse_tool_calls as parse_tool_calls

__all__ = ["Agent", "AssistantTurn", "ChatCodec", "Rollout", "RolloutConfig", "Tool", "ToolCall",
           "ToolResult", "parse_tool_calls", "run_agent"]
