"""`group.ep(Cls.method)` gives a type checker the endpoint's argument and return types."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SNIPPET = textwrap.dedent('''
    from earl.runtime import Actor, ActorGroup, endpoint

    class Counter(Actor):
        @endpoint
        async def incr(self, k: int) -> int:
            return k

    async def use(g: ActorGroup[Counter]) -> None:
        reveal_type(await g.ep(Counter.incr).call_one(1))
        reveal_type(await g.ep(Counter.incr).call(1))
        await g.ep(Counter.incr).call_one("one")
''')


REPO = Path(__file__).resolve().parents[2]


def _source_tree(root: Path) -> Path:
    """The `earl` package laid out as imported (runtime/ -> earl/runtime ...) for mypy, which
    does not follow the editable install's folder mapping."""
    pkg = root / "earl"
    pkg.mkdir(parents=True)
    for p in (REPO / "earl").iterdir():
        (pkg / p.name).symlink_to(p)
    for name in ("runtime", "agents", "envs"):
        (pkg / name).symlink_to(REPO / name)
    return root


@pytest.mark.slow  # mypy over the whole package without a cache: ~46 s
def test_ep_is_typed(tmp_path: Path) -> None:
    src = tmp_path / "snippet.py"
    src.write_text(SNIPPET)
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--ignore-missing-imports",
         "--cache-dir", str(tmp_path / "cache"), str(src)],
        check=False, capture_output=True, text=True, timeout=240,
        env={**os.environ, "MYPYPATH": str(_source_tree(tmp_path / "src"))}).stdout
    revealed = [line.split("Revealed type is ")[1] for line in out.splitlines()
                if "Revealed type is" in line]
    assert [r.replace("builtins.", "") for r in revealed] == ['"int"', '"list[int]"'], out
    assert 'incompatible type "str"; expected "int"' in out, out
