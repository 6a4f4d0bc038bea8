"""The import graph of EARL's four packages: layers import downward only, and nothing cycles.

Every module under `earl/`, `runtime/`, `agents/` and `envs/` is parsed (no import runs), and
each `import` statement, at module level, inside functions or under `TYPE_CHECKING`, becomes an
edge to the module it names; `from pkg import name` points at `pkg.name` when that is a module.
The parent packages Python imports on the way are not edges.

The layer rules read every edge: naming a type of the layer above is depending on it. The cycle
rule skips the `if TYPE_CHECKING:` blocks, which run under the type checker only: two modules
naming each other's types there never import each other.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Import name -> folder, as `[tool.setuptools] package-dir` in pyproject.toml maps them.
PACKAGES = {"earl": "earl", "earl.runtime": "runtime", "earl.agents": "agents",
            "earl.envs": "envs"}
# What a recipe may import from EARL: the public surface `earl`, and the agents and envs a user
# reads and copies (STYLE.md: "recipes ... written only against the public API").
RECIPE_MAY_IMPORT = ("earl", "earl.agents", "earl.envs", "earl.recipes")


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((name, *parts))] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             known: Iterable[str]) -> list[str]:
    """The EARL modules one import statement loads by name."""
    known = set(known)

    def owner(name: str) -> str | None:  # the longest prefix of `name` that is a module
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    if isinstance(node, ast.Import):
        found = [owner(a.name) for a in node.names]
        return [t for t in found if t is not None]
    base = node.module or ""
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        target = sub if sub in known else owner(base)
        if target is not None:
            out.append(target)
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(node: ast.AST, typing: bool) -> Iterable[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, those under `if TYPE_CHECKING:` only if `typing`."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and _is_type_checking(child.test) and not typing:
            for other in child.orelse:
                yield from _imports(ast.Module(body=[other], type_ignores=[]), typing)
        else:
            yield from _imports(child, typing)


@cache
def graph(typing: bool = True) -> dict[str, frozenset[str]]:
    """Module -> the EARL modules it imports (itself excluded); with `typing=False`, the imports
    that run (those under `if TYPE_CHECKING:` left out)."""
    modules = _modules()
    edges: dict[str, frozenset[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        found: set[str] = set()
        for node in _imports(tree, typing):
            found.update(_targets(node, name, is_package, modules))
        found.discard(name)
        edges[name] = frozenset(found)
    return edges


def _cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """One shortest cycle through each strongly connected component of more than one module
    (through its first module by name), as the path `[a, b, ..., a]`."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    cycles = []
    for comp in components:
        members = set(comp)
        start = comp[0]
        # Breadth-first from `start` back to itself inside the component.
        parent: dict[str, str] = {}
        frontier = [start]
        found = None
        while frontier and found is None:
            nxt = []
            for v in frontier:
                for w in sorted(edges[v] & members):
                    if w == start:
                        found = v
                        break
                    if w not in parent:
                        parent[w] = v
                        nxt.append(w)
                if found is not None:
                    break
            frontier = nxt
        assert found is not None
        path = [found]
        while path[-1] != start:
            path.append(parent[path[-1]])
        cycles.append([*reversed(path), start])
    return cycles


def _tangle(edges: dict[str, frozenset[str]], start: str) -> list[str]:
    """The modules that `start` reaches and that reach it back (its component)."""

    def reach(graph: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in graph.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    back: dict[str, set[str]] = {}
    for v, ws in edges.items():
        for w in ws:
            back.setdefault(w, set()).add(v)
    return sorted(reach({v: set(ws) for v, ws in edges.items()}) & reach(back))


def _violations(prefix: str, allowed: tuple[str, ...]) -> list[str]:
    """`module -> target` for each EARL import of a module under `prefix` outside `allowed`."""

    def under(name: str, roots: Iterable[str]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    return [f"{m} -> {t}" for m, targets in sorted(graph().items()) if under(m, [prefix])
            for t in sorted(targets)
            if not any(t == a if a == "earl" else under(t, [a]) for a in allowed)]


def test_the_graph_sees_every_kind_of_import() -> None:
    g = graph()
    assert len(g) > 100
    assert "earl.runtime.dock" in g["earl.stages.reference"]  # module level, `from x import y`
    assert "earl.stages.trainer_feed" in g["earl.loop.training"]  # inside a function
    assert "earl.stages.trainer_dist" in g["earl.stages.trainer_torch"]  # y is a submodule
    assert "earl.agents.chat" in g["earl.agents"]  # a package's __init__
    assert "earl" in g["earl.recipes.tictactoe"]  # `from earl import ...`
    assert "earl.stages.trainer_torch" in g["earl.stages.trainer_ckpt"]  # TYPE_CHECKING
    assert "earl.stages.trainer_torch" not in graph(typing=False)["earl.stages.trainer_ckpt"]
    assert "earl.runtime.dock" in graph(typing=False)["earl.loop.ledger"]


def test_cycles_are_found_and_reported() -> None:
    edges = {"a": frozenset({"b"}), "b": frozenset({"c", "d"}), "c": frozenset({"a"}),
             "d": frozenset(), "e": frozenset({"e"})}
    assert _cycles(edges) == [["a", "b", "c", "a"]]  # a self-import is not an edge here


def test_no_import_cycle() -> None:
    edges = graph(typing=False)
    lines = []
    for cycle in _cycles(edges):
        lines.append(" -> ".join(cycle))
        tangled = _tangle(edges, cycle[0])
        if len(tangled) > len(cycle) - 1:
            lines.append(f"  (in a tangle of {len(tangled)}: {', '.join(tangled)})")
    assert not lines, "import cycles:\n" + "\n".join(lines)


def test_the_loop_has_no_cycle_even_between_its_types() -> None:
    """Within `earl.loop`, not even the type checker's imports cycle: a module that names
    `Job` is above `Job` (the run's context knows no part, stage or loop that uses it)."""
    edges = {m: frozenset(t for t in ts if t.startswith("earl.loop."))
             for m, ts in graph().items() if m.startswith("earl.loop.")}
    cycles = [" -> ".join(c) for c in _cycles(edges)]
    assert not cycles, "earl.loop's type-level import cycles:\n" + "\n".join(cycles)


def test_runtime_imports_nothing_above_it() -> None:
    bad = _violations("earl.runtime", ("earl.runtime",))
    assert not bad, "earl.runtime imports from above the machine:\n" + "\n".join(bad)


def test_stages_never_import_the_loop() -> None:
    bad = [f"{m} -> {t}" for m, ts in sorted(graph().items())
           if m == "earl.stages" or m.startswith("earl.stages.")
           for t in sorted(ts) if t == "earl.loop" or t.startswith("earl.loop.")]
    assert not bad, "stage actors import the loop above them:\n" + "\n".join(bad)


def test_recipes_use_the_public_api_only() -> None:
    bad = _violations("earl.recipes", RECIPE_MAY_IMPORT)
    assert not bad, ("recipes import past the public API (`earl`, `earl.agents`, `earl.envs`):\n"
                     + "\n".join(bad))
