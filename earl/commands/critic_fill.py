"""How full the Tic-Tac-Toe critic's tables are in a run's checkpoint in force, and the size
their JSON would reach full: what `earl chaos --soak` bounds the checkpoint by.

Standard library only, so the soak runs it as a script in a child process
(``python -I critic_fill.py RUN_FOLDER`` prints the JSON): parsing MBs of JSON in the soak's
driver would fragment the heap of a process whose memory the soak measures.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

__all__ = ["critic_fill"]


def critic_fill(root: Path) -> dict[str, float] | None:
    """How full the checkpoint in force's critic tables are (the producers' states that carry
    their caps: `TabularCritic`), and the size their JSON would reach full: the checkpoint
    grows while they fill, up to that bound. None without such a checkpoint."""
    try:
        folder = json.loads((root / "checkpoint" / "manifest.json").read_text())["folder"]
        states = [json.loads(p.read_text())
                  for p in sorted((root / "checkpoint" / folder / "producers").glob("*.json"))]
    except (OSError, ValueError, KeyError):  # none yet, or replaced while read
        return None
    fill = {"mib": 0.0, "full_mib": 0.0, "states": 0, "replies": 0}
    for d in states:
        if not isinstance(d, dict) or "max_states" not in d:
            return None
        n, r = len(d["values"]), sum(len(row) for _, row in d["q"])
        values_b, q_b = len(json.dumps(d["values"])), len(json.dumps(d["q"]))
        fill["mib"] += len(json.dumps(d)) / 2**20
        fill["full_mib"] += (values_b * d["max_states"] / max(n, 1)
                             + q_b * d["max_states"] * d["max_replies"] / max(r, 1)) / 2**20
        fill["states"] += n
        fill["replies"] += r
    return {k: round(v, 3) for k, v in fill.items()}


if __name__ == "__main__":
    print(json.dumps(critic_fill(Path(sys.argv[1]))))
