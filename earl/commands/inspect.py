"""`earl inspect`: look at the trajectories any run dumped (games, tool use, user agents).

    earl inspect runs/latest                     # summary per step range
    earl inspect runs/latest --show 3            # decode 3 trajectories, loss mask marked
    earl inspect runs/latest --replay SAMPLE_ID  # board games: re-play the moves, check outcome
    earl inspect runs/latest --json              # summary as one JSON line

The summary splits the run's steps into up to four disjoint ranges and gives, per range, the
episodes, mean reward, the share with reward >= 1, failed and truncated shares, mean tokens and
generated tokens, and the mean of every numeric `info` key (plus outcome rates for games).
`--show` prints each trajectory with the tokens the policy generated (loss mask 1, what the
trainer learns from) between `⟦` and `⟧`; prompts, tool results and observations are plain.
Reads `trajectories.jsonl` (and the per-rank `trajectories.N.jsonl`, and the gzip segments a
bounded dump rotated out, `earl.stages.dump`) and the run's tokenizer only; starts no actors.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from earl.stages.dump import dump_files

Record = dict[str, Any]  # one line of trajectories.jsonl, as JSON gives it
OPEN, CLOSE = "⟦", "⟧"   # around generated (loss-mask) tokens in --show
_TOKENIZER_DIRS = ("weights", "weights_best", "weights_start")


def _load(run: Path) -> list[Record]:
    path = run / "trajectories.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise ValueError(f"{str(path)!r} not found: pass a run directory written by `earl train` "
                         "(with dump_trajectories=true) or a trajectories.jsonl file")
    lives = [path, *sorted(path.parent.glob(f"{path.stem}.*.jsonl"))]  # other producer ranks
    files = [f for live in lives for f in dump_files(live)]  # gzip segments, oldest first
    out: list[Record] = []
    for f in files:
        lines = (gzip.decompress(f.read_bytes()) if f.suffix == ".gz"
                 else f.read_bytes()).decode().splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                if lineno == len(lines):
                    continue  # the last line, cut by a crash mid-write
                raise ValueError(f"{f}:{lineno} is not valid JSON") from None
            out.append(rec)
    return out


def _tokenizer(run: Path) -> Any:
    from transformers import AutoTokenizer

    root = run if run.is_dir() else run.parent
    for name in _TOKENIZER_DIRS:
        if (root / name / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(str(root / name))
    config = root / "config.json"
    if config.is_file():
        path = json.loads(config.read_text()).get("model", {}).get("path", "")
        if path and (Path(path) / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(path)
    raise ValueError(f"no tokenizer in {str(root)!r} ({', '.join(_TOKENIZER_DIRS)}) or at the "
                     "config's model.path; inspect needs the run's weights folder")


def _ranges(steps: list[int], parts: int = 4) -> list[tuple[int, int]]:
    """Up to `parts` disjoint, contiguous [lo, hi] ranges covering the sorted distinct `steps`."""
    n = len(steps)
    cuts = sorted({round(i * n / parts) for i in range(parts + 1)})
    return [(steps[a], steps[b - 1]) for a, b in itertools.pairwise(cuts) if b > a]


def _row(sel: list[Record]) -> dict[str, object]:
    n = max(len(sel), 1)
    rewards = [0.0 if t.get("failed") or t.get("reward") is None else float(t["reward"])
               for t in sel]
    row: dict[str, object] = {
        "episodes": len(sel),
        "reward": sum(rewards) / n,
        "reward_ge_1": sum(r >= 1.0 for r in rewards) / n,
        "failed": sum(bool(t.get("failed")) for t in sel) / n,
        "truncated": sum(bool(t.get("truncated")) for t in sel) / n,
        "tokens": sum(len(t["token_ids"]) for t in sel) / n,
        "generated": sum(sum(t["loss_mask"]) for t in sel) / n,
    }
    outcomes = Counter(str(t["info"]["outcome"]) for t in sel if "outcome" in t.get("info", {}))
    for k, c in sorted(outcomes.items()):
        row[f"outcome_{k}"] = c / n
    numeric: dict[str, list[float]] = {}
    for t in sel:
        for k, v in t.get("info", {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "seed":
                numeric.setdefault(k, []).append(float(v))
    for k, vs in sorted(numeric.items()):
        row[f"info.{k}"] = sum(vs) / len(vs)
    return row


def summary(trajs: list[Record]) -> dict[str, object]:
    """Per step range: counts and means (every trajectory in exactly one range)."""
    steps = sorted({int(t["step"]) for t in trajs})
    out: dict[str, object] = {"trajectories": len(trajs), "steps": len(steps)}
    rows = []
    for lo, hi in _ranges(steps):
        row: dict[str, object] = {"steps": f"{lo}-{hi}"}
        row.update(_row([t for t in trajs if lo <= int(t["step"]) <= hi]))
        rows.append(row)
    out["by_steps"] = rows
    return out


def render(t: Record, decode: Any) -> str:
    """The trajectory's text with each run of generated tokens (loss mask 1) in ⟦ ⟧."""
    ids, mask = t["token_ids"], t["loss_mask"]
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and mask[j] == mask[i]:
            j += 1
        text = decode(ids[i:j])
        parts.append(f"{OPEN}{text}{CLOSE}" if mask[i] else text)
        i = j
    return "".join(parts)


def replay(t: Record, tok: Any) -> dict[str, object]:
    """Re-play a board game's recorded moves in a fresh env with the same seed; compare
    outcomes. Works for Tic-Tac-Toe and Connect Four records (their info carries the seed).
    A move's text is decoded as the agent saw it (`ChatCodec.decode` of the turn without its
    stop token, special tokens kept): a turn the model filled with odd tokens reads the same."""
    from earl.agents.chat import ChatCodec
    from earl.agents.connect4 import game_config
    from earl.envs.connect4 import INTRO as C4_INTRO
    from earl.envs.connect4 import ConnectFour
    from earl.envs.tictactoe import TicTacToe, TicTacToeConfig

    info = t.get("info", {})
    if "seed" not in info or "outcome" not in info:
        raise ValueError(f"--replay {t['sample_id']!r}: not a board-game trajectory (its info "
                         "has no seed/outcome); use --show to read it")
    seed = int(info["seed"])
    ids: list[int] = t["token_ids"]
    first_turn = t["turn_spans"][0][0] if t["turn_spans"] else len(ids)
    prompt = tok.decode(ids[:first_turn], skip_special_tokens=False)
    env: Any = ConnectFour(game_config(seed % 2 == 0)) if C4_INTRO.split(".")[0] in prompt \
        else TicTacToe(TicTacToeConfig(agent_first=seed % 2 == 0))
    env.reset(seed)
    outcome = "unfinished"
    moves = []
    codec = ChatCodec(tok)
    for start, end in t["turn_spans"]:
        body = ids[start:end]
        if body and body[-1] in codec.stop_ids:
            body = body[:-1]
        text = codec.decode(body)
        moves.append(text)
        res = env.step(text)
        if res.done:
            outcome = str(res.info["outcome"])
            break
    recorded = str(info.get("outcome"))
    return {"sample_id": t["sample_id"], "moves": moves, "replayed": outcome,
            "recorded": recorded, "match": outcome == recorded}


def _print_summary(s: dict[str, object]) -> None:
    print(f"{s['trajectories']} trajectories over {s['steps']} steps")
    for r in s["by_steps"]:  # type: ignore[attr-defined]
        extra = "  ".join(f"{k} {v:.2f}" for k, v in r.items()
                          if k.startswith(("outcome_", "info.")))
        print(f"  steps {r['steps']:>9}: {r['episodes']:5d} episodes  reward {r['reward']:+.3f}"
              f"  >=1 {r['reward_ge_1']:.2f}  failed {r['failed']:.2f}  "
              f"{r['tokens']:.0f} tok ({r['generated']:.0f} generated)  {extra}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="earl inspect", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="run directory (or its trajectories.jsonl)")
    p.add_argument("--show", type=int, default=0,
                   help="decode N trajectories (last first); generated tokens in ⟦ ⟧")
    p.add_argument("--replay", help="sample_id of a board game to replay in its environment")
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
            _print_summary(s)
        if a.show:
            tok = _tokenizer(run)

            def decode(ids: list[int]) -> str:
                return str(tok.decode(ids, skip_special_tokens=False))

            for t in sorted(trajs, key=lambda t: int(t["step"]))[::-1][:a.show]:
                print(f"--- {t['sample_id']} step {t['step']} reward {t['reward']} "
                      f"failed {t.get('failed', False)} {t['info']} "
                      f"advantage {t.get('advantage', 0.0):+.2f}")
                print(render(t, decode))
    except ValueError as exc:
        print(f"earl inspect: {exc}", file=sys.stderr)
        return 2
    return 0
