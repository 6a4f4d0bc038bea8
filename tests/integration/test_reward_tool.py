"""The reward model as an action on the shared tool executor, scored like the RewardModel."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)


async def test_reward_model_runs_as_an_executor_action(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from earl.agents.tools import Tool
    from earl.models.reward_model import score_text
    from earl.runtime.tools import ExecutorConfig, ToolExecutor
    from earl.stages.reward import RewardModel, RewardModelConfig, build_tiny_reward_model

    path = str(build_tiny_reward_model(tmp_path / "rm", layers=1))
    tool = Tool.from_function(score_text)
    assert tool.ref == "earl.models.reward_model:score_text"
    texts = ["the answer is 4", "no idea"]
    want = RewardModel(RewardModelConfig(model=path)).score(
        [AutoTokenizer.from_pretrained(path).encode(t) for t in texts])
    async with ToolExecutor(ExecutorConfig(max_workers=2, default_timeout_s=90)) as ex:
        results = [await ex.run(tool, {"model": path, "text": t}) for t in texts]
        bad = await ex.run(tool, {"model": path, "text": ""})
    assert all(r.ok for r in results), [r.output for r in results]
    assert [round(float(r.output), 4) for r in results] == [round(float(w), 4) for w in want]
    assert not bad.ok and "text is empty" in bad.output
