"""EARL: an asynchronous actor-based dataflow runtime for agentic RL of LLMs.

This is the public surface; import from here. Torch-heavy parts (`earl.algorithms`, the trainer,
the vLLM rollout) are imported from their own modules so that `import earl` stays light.

    import earl

    class Counter(earl.Actor):
        @earl.endpoint
        async def incr(self, k: int) -> int: ...

    async with earl.Runtime() as rt:
        counter = await rt.spawn("counter", Counter)
        await counter.incr.call_one(1)
"""

from earl.agents import Agent as Agent
from earl.agents import AssistantTurn as AssistantTurn
from earl.agents import ChatCodec as ChatCodec
from earl.agents import Rollout as Rollout
from earl.agents import RolloutConfig as RolloutConfig
from earl.agents import ToolCall as ToolCall
from earl.agents import run_agent as run_agent
from earl.engine import ContextLengthError as ContextLengthError
from earl.engine import Engine as Engine
from earl.engine import Generation as Generation
from earl.engine import SamplingParams as SamplingParams
from earl.engine import SimConfig as SimConfig
from earl.engine import SimEngine as SimEngine
from earl.recipe import Critic as Critic
from earl.recipe import EvalSet as EvalSet
from earl.recipe import IterTasks as IterTasks
from earl.recipe import ListTasks as ListTasks
from earl.recipe import Recipe as Recipe
from earl.recipe import SeedTasks as SeedTasks
from earl.recipe import native_dtype as native_dtype
from earl.recipe import turn_targets as turn_targets
from earl.run import RunResult as RunResult
from earl.run import train as train
from earl.runtime import Actor as Actor
from earl.runtime import ActorDied as ActorDied
from earl.runtime import ActorError as ActorError
from earl.runtime import ActorGroup as ActorGroup
from earl.runtime import RestartPolicy as RestartPolicy
from earl.runtime import Runtime as Runtime
from earl.runtime import RuntimeConfig as RuntimeConfig
from earl.runtime import endpoint as endpoint
from earl.runtime.types import Trajectory as Trajectory
from earl.stages.batch_types import Episode as Episode

__version__ = "0.1.0"

__all__ = [
    "Actor", "ActorDied", "ActorError", "ActorGroup", "Agent", "AssistantTurn", "ChatCodec",
    "ContextLengthError", "Critic", "Engine", "Episode", "EvalSet", "Generation", "IterTasks",
    "ListTasks", "Recipe", "RestartPolicy", "Rollout", "RolloutConfig", "RunResult", "Runtime",
    "RuntimeConfig", "SamplingParams", "SeedTasks", "SimConfig", "SimEngine", "ToolCall",
    "Trajectory", "endpoint", "native_dtype", "run_agent", "train", "turn_targets",
]
