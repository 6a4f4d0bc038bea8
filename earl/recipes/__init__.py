"""Shipped recipes (`earl train --recipe NAME`), one package per task, each written only against
the public API: `tictactoe` (the default main job, with its critic and evaluation), `calc`
(multi-turn math with the calculator tool), `calc_smollm2` (the same on SmolLM2-135M with LoRA),
`chain_smollm2` (SmolLM2-135M on two- and three-step word problems, a calculator call a step),
`connect4` (EARL's evaluation game, long contexts) and `gauntlet` (Tic-Tac-Toe games in one
context until the first loss: contexts grow as the agent learns). Each package defines `recipe`; `earl.recipe.recipe_names` finds them by scanning this
folder, so a new recipe is a new folder and nothing else."""
