"""`earl bench NAME [args]`: run one benchmark script from bench/ and pass its output through.

The benchmarks live in the repository's bench/ folder (they are scripts, not part of the installed
package), so this command only works from a source checkout, which is how EARL is installed.
With `--save` a benchmark also writes its result, with the machine's facts, to bench/results/;
`python bench/report.py` builds the README's table from those files.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
NOT_BENCHMARKS = {"report"}  # bench/report.py builds the README's table from saved results


def available() -> list[str]:
    return sorted(p.stem for p in BENCH_DIR.glob("*.py")
                  if not p.stem.startswith("_") and p.stem not in NOT_BENCHMARKS)


def main(argv: list[str]) -> int:
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: earl bench NAME [--json] [--quick] [--save] ...\n\nbenchmarks: "
              + ", ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"earl bench: unknown benchmark {name!r}; choose one of {', '.join(names)}",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, str(BENCH_DIR / f"{name}.py"), *rest])
