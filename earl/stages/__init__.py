"""Stage actors: the processes of an RL step that sit above the actor runtime.

`rollout` (vLLM behind `RolloutActor`, tensor parallel on CPU too), `producer` (producer actors:
agent coroutines against the rollout, their experience kept in their own dock shard;
`advantages` turns trajectories into training columns, `healing_engine` rides out a rollout
replica's restart, `batch_types` are the records they exchange with the driver), `reference`
(log-probs of the KL anchor), `reward` (rule and model rewards), `trainer` (DDP/FSDP2 x DTensor
TP/megatron learner; `trainer_feed` is its data path from the dock), `weights` (bucketed weight
publishing) and `reconfigure` (re-create a trainer or rollout group with a new layout, state
resharded). They build on `earl.runtime` (actors, dock, transports) and on `earl.algorithms`;
nothing in `earl.runtime` imports them, and they never import the loop that drives them
(`earl.loop`).
"""
