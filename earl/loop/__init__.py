"""The general RL loop behind `earl train`, as small parts with one job each.

`gate` (the staleness bound), `schedule` (which batch is produced, trained, evaluated and
checkpointed when; unit-tested with fakes), `parts` (the schedule's protocols over actor
groups: production, training, evaluation), `checkpoint` (one manifest per checkpoint),
`healing` and `healing_parts` (a run that survives its actors' deaths), `selection` and
`selection_actors` (the parallelism selector applied to live actors), `stage_configs` (each
stage's actor config, built from the run's config) and `transcripts` (supervised warm-start
data). `earl.run` wires them to actors.

The loop sits above the stage actors (`earl.stages`: rollout, producer, reference, trainer)
and imports them, never the reverse; the records it exchanges with the producers
(`BatchResult`, `Episode`, `GroupTask`) come from `earl.stages.batch_types`.
"""
