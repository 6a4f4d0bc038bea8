"""Shipped recipes (`earl train --recipe NAME`), each written only against the public API:
`tictactoe` (the default main job), `calc` (multi-turn math with the calculator tool) and
`connect4` (EARL's evaluation game, growing contexts). Each module defines `recipe`."""
