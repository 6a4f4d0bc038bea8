"""Arithmetic word problems and the `calculator` tool.

`ArithmeticProblems(seed)` yields short word problems whose answer is an integer; the model may
call `calculator` (a safe evaluator: numbers, + - * / // % **, parentheses, no names) and must end
with the number. `score(text, answer)` reads the last integer in the model's final text.
No tokens or engines here; `earl.agents.calc` is the agent loop.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["ArithmeticProblems", "Problem", "calculator", "score"]

_OPS: dict[type[ast.AST], Callable[..., float | int]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
        ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}
_NUM = re.compile(r"-?\d+")


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) \
            and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ValueError(f"unsupported syntax: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / // % ** and parentheses.

    Args:
        expression: The expression to evaluate, e.g. "3 * (4 + 5)".
    """
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        value = _eval(ast.parse(expression, mode="eval"))
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from None
    except ZeroDivisionError:
        raise ValueError("division by zero") from None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


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
