"""Subcommands of the `earl` CLI, one module each."""
