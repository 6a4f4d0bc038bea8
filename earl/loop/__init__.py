"""The general RL loop behind `earl train`, as small parts with one job each.

`main` (the run and its attempts, top down), `stages` (each stage one declaration: how its
group is built and a restarted rank rebuilt), `spawn` (an attempt's stages and parts),
`supervisor` (every restart and rewind, and their limits), `gate` (the staleness bound),
`schedule` (which batch is produced, trained, evaluated and checkpointed when; unit-tested
with fakes), `production`, `training`, `evaluation` (the schedule's parts over actor groups),
`checkpoint` (one manifest per checkpoint), `ledger` (what `earl chaos` judges a run by),
`selection` and `selection_actors` (the parallelism selector applied to live actors),
`stage_configs` (each stage's actor config, built from the run's config) and `warm_start`
(the supervised warm start and its transcripts).

The loop sits above the stage actors (`earl.stages`: rollout, producer, reference, trainer)
and imports them, never the reverse; the records it exchanges with the producers
(`BatchResult`, `Episode`, `GroupTask`) come from `earl.stages.batch_types`.
"""
