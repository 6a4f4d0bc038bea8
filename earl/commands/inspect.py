"""`earl inspect`: look at the trajectories a run dumped, or replay one game.

    earl inspect runs/latest                     # summary per step range + outcome counts
    earl inspect runs/latest --show 3            # decode 3 trajectories (last step first)
    earl inspect runs/latest --replay SAMPLE_ID  # re-play its moves in the env, check the outcome
    earl inspect runs/latest --json              # summary as one JSON line

Reads `trajectories.jsonl` (and the run's tokenizer) only; starts no actors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

Record = dict[str, Any]  # one line of trajectories.jsonl, as JSON gives it


def _load(run: Path) -> list[Record]:
    path = run / "trajectories.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found: pass a run directory written by `earl train` "
                         "(with dump_trajectories=true) or a trajectories.jsonl file")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _tokenizer(run: Path):
    from transformers import AutoTokenizer

    folder = run / "weights" if run.is_dir() else run.parent / "weights"
    if not (folder / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer in {str(folder)!r}; inspect needs the run's weights/ folder")
    return AutoTokenizer.from_pretrained(str(folder))


def summary(trajs: list[Record]) -> dict[str, object]:
    steps = sorted({int(t["step"]) for t in trajs})
    out: dict[str, object] = {"trajectories": len(trajs), "steps": len(steps)}
    if not steps:
        return out
    quarters = [steps[int(i * (len(steps) - 1) / 3)] for i in range(4)]
    rows = []
    for lo, hi in itertools.pairwise(quarters):
        sel = [t for t in trajs if lo <= int(t["step"]) <= hi]
        c = Counter(str(t["info"].get("outcome", "?")) for t in sel)
        n = max(len(sel), 1)
        rows.append({"steps": f"{lo}-{hi}", "games": len(sel), "win": c["win"] / n,
                     "draw": c["draw"] / n, "loss": c["loss"] / n,
                     "mean_tokens": sum(len(t["token_ids"]) for t in sel) / n})
    out["by_steps"] = rows
    return out


def replay(t: Record, tok) -> dict[str, object]:
    """Re-play the recorded moves in a fresh env with the same seed; compare outcomes."""
    from earl.envs.tictactoe import TicTacToe
    from earl.eval import env_config

    seed = int(t["info"]["seed"])
    env = TicTacToe(env_config(seed % 2 == 0))
    env.reset(seed)
    ids: list[int] = t["token_ids"]
    outcome = "unfinished"
    moves = []
    for start, end in t["turn_spans"]:
        text = tok.decode(ids[start:end], skip_special_tokens=True)
        moves.append(text)
        res = env.step(text)
        if res.done:
            outcome = str(res.info["outcome"])
            break
    recorded = str(t["info"].get("outcome"))
    return {"sample_id": t["sample_id"], "moves": moves, "replayed": outcome,
            "recorded": recorded, "match": outcome == recorded}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="earl inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory (or its trajectories.jsonl)")
    p.add_argument("--show", type=int, default=0, help="decode N trajectories")
    p.add_argument("--replay", help="sample_id to replay in the environment")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    run = Path(a.run)
    try:
        trajs = _load(run)
        if a.replay:
            match = [t for t in trajs if t["sample_id"] == a.replay]
            if not match:
                raise ValueError(f"--replay {a.replay!r}: no such sample_id in this run")
            res = replay(match[-1], _tokenizer(run))
            print(json.dumps(res) if a.json else
                  f"{res['sample_id']}: moves {res['moves']} -> {res['replayed']} "
                  f"(recorded {res['recorded']}, {'OK' if res['match'] else 'MISMATCH'})")
            return 0 if res["match"] else 1
        s = summary(trajs)
        if a.json:
            print(json.dumps(s))
        else:
            print(f"{s['trajectories']} trajectories over {s['steps']} steps")
            for r in s.get("by_steps", []):  # type: ignore[attr-defined]
                print(f"  steps {r['steps']:>9}: {r['games']:5d} games  win {r['win']:.2f} "
                      f"draw {r['draw']:.2f} loss {r['loss']:.2f}  {r['mean_tokens']:.0f} tok")
        if a.show:
            tok = _tokenizer(run)
            for t in trajs[::-1][:a.show]:
                print(f"--- {t['sample_id']} step {t['step']} reward {t['reward']} "
                      f"{t['info']} advantage {t['advantage']:+.2f}")
                print(tok.decode(t["token_ids"], skip_special_tokens=False))
    except ValueError as exc:
        print(f"earl inspect: {exc}", file=sys.stderr)
        return 2
    return 0
