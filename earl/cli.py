"""The `earl` command line: a thin dispatcher to `earl.commands.<name>:main(argv)`.

Each subcommand lives in its own module with its own argparse, so importing the CLI stays cheap
(no torch or vLLM import until a subcommand needs it).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": "Train a policy (default: tiny model on Tic-Tac-Toe, CPU).",
    "eval": "Evaluate a saved policy (a run folder or an HF folder) greedily (--json).",
    "stress": "Stress-test multi-turn tool use with N concurrent agent sessions.",
    "bench": "Run a benchmark from bench/ and print its JSON.",
    "inspect": "Inspect or replay trajectories dumped by a run.",
    "chaos": "Run a small live job with injected faults; report each and the invariants (--json).",
}


def _usage() -> str:
    lines = ["usage: earl <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, help_ in COMMANDS.items()]
    lines += ["", "Run `earl <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"earl: unknown command {name!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"earl.commands.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
