"""The general RL loop behind `earl train`, as small parts with one job each.

`gate` (the staleness bound), `producer` (producer actors: agent coroutines + their warehouse
shard), `advantages` (episodes -> per-token advantages: GRPO, per-turn PPO credit, a critic),
`prepare` (reference scores on the dock), `learner` (train step + weight sync),
`evaluation`, `checkpoint` (one manifest per checkpoint), `stop` (steps, time, target) and
`schedule`, which runs them. `earl.run` wires them to actors.
"""
