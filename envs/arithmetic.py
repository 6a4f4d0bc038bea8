"""Arithmetic word problems and the `calculator` tool.

`ArithmeticProblems(seed)` yields short word problems whose answer is an integer; the model may
call `calculator` (a safe evaluator: numbers, + - * / // % **, parentheses; `evaluate` also binds
names, e.g. a question's `quantities` a, b, c) and must end with the number. `score(text, answer)` reads the last integer in the model's final text.
`CalcTasks` is the `calc` recipe's task family, sized for a tiny char-level model: six short
one-operator templates, small numbers in the order the expression uses them, and disjoint "train" /
"eval" splits (by expression); its tasks are plain dicts `{"question", "answer"}` and `write_jsonl`
writes them for `earl train --tasks FILE.jsonl`.
No tokens or engines here; `earl.agents.calc` is the agent loop.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEMO_KNOWN", "ArithmeticProblems", "CalcTasks", "Problem", "calculator", "demo_expression",
           "evaluate", "quantities", "score", "write_jsonl"]

_OPS: dict[type[ast.AST], Callable[..., float | int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
_NUM = re.compile(r"-?\d+")


def _eval(node: ast.AST, names: dict[str, int]) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body, names)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left, names), _eval(node.right, names)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand, names))
    known = f"; known: {', '.join(names)}" if names else ""
    what = f"unknown name {node.id!r}{known}" if isinstance(node, ast.Name) else \
        f"unsupported syntax: {type(node).__name__}"
    raise ValueError(what)


def evaluate(expression: str, names: dict[str, int] | None = None) -> str:
    """The value of an arithmetic expression (+ - * / // % ** and parentheses) as text, an
    integral float as an int; `names` binds variables (e.g. a problem's quantities).

    Raises:
        ValueError: too long, unparsable, an unknown name, division by zero, huge powers.
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        value = _eval(ast.parse(expression, mode="eval"), names or {})
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def calculator(expression: str) -> str:
    """Evaluate arithmetic: + - * / // % ** ( ).

    Args:
        expression: e.g. 3*(4+5)
    """
    return evaluate(expression)


def quantities(question: str) -> dict[str, int]:
    """The question's numbers in order, named a, b, c, ... (what `calc_agent`'s calculator
    binds, so the model can write "a*b+c")."""
    return {chr(97 + i): int(n) for i, n in enumerate(re.findall(r"\d+", question)[:26])}


@dataclass(frozen=True, slots=True)
class Problem:
    """One word problem: the question, its integer answer and the expression behind it."""

    question: str
    answer: int
    expression: str


_TEMPLATES = (
    ("{n} has {a} {x}s and buys {b} boxes of {c}. How many {x}s now?", "{a}+{b}*{c}"),
    ("A shelf holds {a} {x}s. {n} removes {b} and then triples the rest. How many?",
     "({a}-{b})*3"),
    ("{n} splits {a}*{c} {x}s into {b} equal piles. How many per pile (rounded down)?",
     "({a}*{c})//{b}"),
    ("{n} saves {a} coins a day for {b} days and spends {c}. How many coins are left?",
     "{a}*{b}-{c}"),
)
_NAMES = ("Ann", "Bo", "Cy", "Di", "Ed")
_THINGS = ("apple", "pen", "card", "egg", "book")


class ArithmeticProblems:
    """Deterministic stream of problems: `problem(i)` is the same for a given seed."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def problem(self, index: int) -> Problem:
        rng = random.Random(self.seed * 1_000_003 + index)
        text, expr = rng.choice(_TEMPLATES)
        a, b, c = rng.randint(12, 99), rng.randint(2, 11), rng.randint(2, 19)
        fields = {"n": rng.choice(_NAMES), "x": rng.choice(_THINGS), "a": a, "b": b, "c": c}
        expression = expr.format(**fields)
        return Problem(question=text.format(**fields), answer=int(calculator(expression)),
                       expression=expression)


def score(text: str, answer: int) -> float:
    """1.0 if the last integer in `text` equals `answer`, else 0.0."""
    nums = _NUM.findall(text)
    return 1.0 if nums and int(nums[-1]) == answer else 0.0


# The `calc` recipe's family: one operator per task, two wordings per operator ("more" +,
# "loses"/"gives away" -, "bags of"/"boxes of" *), so no operator is a safe default and what
# the policy must learn is which operator each wording means. Ranges per number keep answers
# spread out (10..171), so guessing one without the calculator rarely pays.
CALC_TEMPLATES = (
    ("{n} has {a} {x}s and gets {b} more. How many {x}s?", "{a}+{b}",
     ((10, 49), (10, 49))),
    ("{n} had {a} {x}s and found {b} more. How many now?", "{a}+{b}",
     ((10, 49), (10, 49))),
    ("{n} has {a} {x}s and loses {b}. How many {x}s?", "{a}-{b}", ((40, 99), (10, 29))),
    ("{n} had {a} {x}s and gave away {b}. How many now?", "{a}-{b}", ((40, 99), (10, 29))),
    ("{n} buys {a} bags of {b} {x}s. How many {x}s?", "{a}*{b}", ((2, 9), (11, 19))),
    ("{n} has {a} boxes of {b} {x}s. How many {x}s?", "{a}*{b}", ((2, 9), (11, 19))),
)
# The wordings `demo_expression`'s demonstrator knows: one per operator.
DEMO_KNOWN = {"gets": "+", "loses": "-", "buys": "*"}
_CALC_NAMES = ("Ann", "Bob", "Cyd")
_CALC_THINGS = ("pen", "egg", "cup")
SPLITS = ("train", "eval")


def _split_of(expression: str) -> str:
    """"eval" for about 1 in 4 expressions (e.g. "7+5"), else "train" (stable)."""
    digest = hashlib.sha256(expression.encode()).digest()
    return "eval" if digest[0] % 4 == 0 else "train"


class CalcTasks:
    """Deterministic tasks of one split: `sample(k)` is the same dict for a given seed and k.

    A task's split follows from its expression ("7+5"): no eval task's expression is the
    expression of any train task, whatever the wording (names and objects never count as new).
    Implements the `earl.recipe.TaskSource` protocol (`sample(k)`).

    Args:
        split: "train" or "eval".
        seed: stream seed.
        cycle: templates in turn (`k % 6`) rather than drawn, so any six consecutive tasks hold
            every wording once (an RL step over six groups then sees each wording equally).
    """

    def __init__(self, split: str = "train", seed: int = 0, cycle: bool = False) -> None:
        if split not in SPLITS:
            raise ValueError(f"CalcTasks split must be one of {SPLITS}, got {split!r}")
        self.split, self.seed, self.cycle = split, seed, cycle

    def sample(self, k: int) -> dict[str, object]:
        rng = random.Random(f"calc:{self.split}:{self.seed}:{k}")
        t = rng.randrange(len(CALC_TEMPLATES))
        if self.cycle:
            t = k % len(CALC_TEMPLATES)
        text, expr, ranges = CALC_TEMPLATES[t]
        while True:  # numbers of this template, in this split, with a positive answer
            nums = dict(zip("abc", (rng.randint(lo, hi) for lo, hi in ranges), strict=False))
            expression = expr.format(**nums)
            answer = int(calculator(expression))
            if answer >= 1 and _split_of(expression) == self.split:
                break
        question = text.format(n=rng.choice(_CALC_NAMES), x=rng.choice(_CALC_THINGS), **nums)
        return {"question": question, "answer": answer}

    def take(self, n: int) -> list[dict[str, object]]:
        """The first `n` samples."""
        return [self.sample(k) for k in range(n)]


def demo_expression(question: str, rng: random.Random) -> str:
    """An imperfect demonstrator's calculator expression for a `CalcTasks` question: its two
    numbers in order joined by the right operator for the one wording per operator it knows
    (`DEMO_KNOWN`), by one drawn uniformly from + - * for the other wording. A warm start on
    its transcripts teaches the tool format and half the wordings; RL has to learn the rest."""
    a, b = list(quantities(question).values())[:2]
    known = next((op for word, op in DEMO_KNOWN.items() if word in question), None)
    return f"{a}{known or rng.choice('+-*')}{b}"


def write_jsonl(path: str | Path, tasks: Iterable[dict[str, object]]) -> Path:
    """Write one task per line (the format `earl train --tasks FILE.jsonl` reads)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as f:
        for task in tasks:
            f.write(json.dumps(task) + "\n")
    return out
