"""A user's LangGraph agent, as its author wrote it: a ReAct agent (`create_react_agent`) over
LangChain's `ChatOpenAI` with a calculator tool. Nothing here is EARL-specific except where the
model's URL and key come from (`rollout.base_url`, `rollout.api_key`). Tests run it against the
endpoint (`test_openai_langgraph.py`) and train it (`test_train_user_agent.py`)."""

from __future__ import annotations

from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from earl.envs.arithmetic import calculator as evaluate
from earl.envs.arithmetic import score

MODEL = "earl-policy"


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: e.g. "3 * (4 + 5)".
    """
    return evaluate(expression)


async def agent(rollout, sample) -> float:  # type: ignore[no-untyped-def]
    """Answer `sample` ({"question", "answer"}); reward 1.0 if the final answer is right."""
    model = ChatOpenAI(model=MODEL, base_url=rollout.base_url, api_key=rollout.api_key,
                       max_retries=0)
    graph = create_react_agent(model, [calculator])
    try:
        out = await graph.ainvoke({"messages": [("user", sample["question"])]},
                                  {"recursion_limit": 8})
    except GraphRecursionError:  # the model kept calling tools
        return 0.0
    return score(str(out["messages"][-1].content), int(sample["answer"]))
