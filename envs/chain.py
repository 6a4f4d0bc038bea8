"""Multi-step word problems and their one-operation calculator (the `chain_smollm2` task).

A `ChainTasks` problem starts from a quantity and changes it two or three times in words
("Then Ann gives away 12. After that the pile grows 3 times."); the answer is the exact final
integer. `calculate` does one operation on two numbers per call (`37-9`, `12*3`, `48/4`), so a
solver calls it once per step, feeding each result into the next call.

Splits share no template: a template is a frame (the opening and the question, e.g. "On Monday
{n} had {a} {x}s. ... How many {x}s does {n} have after that?") with its steps, and the train
and eval frames are disjoint (`TRAIN_FRAMES`, `EVAL_FRAMES`). The step phrasings (`STEPS`: four
wordings per operator) are the task's vocabulary and occur in both splits, in combinations and
frames an eval task never shares with a train task: what a policy learns about a wording
carries over, a memorized problem does not.

`SymbolicTasks` is another kind of problem for a warm start: steps written as symbols ("Start
with 54. Then / 2. Next + 29. What is the result?", with a few openings and questions), so transcripts solving it teach the
tool-call format and chaining results (start from the first number, one call per step, answer
with the last result), not what any wording means.

No tokens or engines here; the agent loop is `earl.agents.calc.solve`.
"""

from __future__ import annotations

import random
import re

__all__ = ["EVAL_FRAMES", "OPERATORS", "STEPS", "TRAIN_FRAMES", "ChainTasks", "SymbolicTasks",
           "calculate", "symbolic_steps"]

OPERATORS = "+-*/"
# Per operator, how a step says it ({n} the person, {x} the thing, {b} the step's number).
STEPS: dict[str, tuple[str, ...]] = {
    "+": ("{n} gets {b} more", "{n} finds {b} more", "a friend gives {n} {b} more",
          "{n} wins {b} more"),
    "-": ("{n} gives away {b}", "{n} loses {b}", "{n} sells {b} of them",
          "{n} throws out {b}"),
    "*": ("{n} ends up with {b} times as many", "the pile grows to {b} times its size",
          "{n} trades each {x} for {b} new ones", "{n} makes the pile {b} times as big"),
    "/": ("{n} splits them into {b} equal piles and keeps one pile",
          "{n} shares them equally with {b} people in all and keeps one share",
          "{n} keeps only one {x} in every {b}", "{n} packs them in {b} equal bags and keeps one"),
}
# (opening, question): the frame of a problem; the two splits' frames are disjoint.
TRAIN_FRAMES = (
    ("{n} has {a} {x}s.", "How many {x}s does {n} have now?"),
    ("{n} starts with {a} {x}s.", "How many {x}s does {n} end with?"),
    ("At first {n} owns {a} {x}s.", "How many {x}s does {n} own at the end?"),
    ("{n} collected {a} {x}s.", "How many {x}s are left with {n}?"),
)
EVAL_FRAMES = (
    ("On Monday {n} had {a} {x}s.", "How many {x}s does {n} have after that?"),
    ("{n}'s bag holds {a} {x}s.", "What is the number of {x}s {n} has now?"),
    ("{n} keeps {a} {x}s in a drawer.", "How many {x}s are there in the end?"),
)
_THEN = ("Then", "Next", "After that", "Later")
_NAMES = ("Ann", "Bob", "Cyd", "Dee", "Eli")
_THINGS = ("pen", "egg", "cup", "card", "shell")
SPLITS = ("train", "eval")
_CALL = re.compile(r"^\s*(-?\d+)\s*(\+|-|\*|x|//|/)\s*(-?\d+)\s*$")


def calculate(expression: str) -> str:
    """One arithmetic operation on two integers: +, -, * (or x), / (or //, whole division).

    Args:
        expression: two numbers and one operator, e.g. 37-9

    Returns:
        The result as text: an integer, or a decimal when a division leaves a remainder.

    Raises:
        ValueError: anything but one operation on two integers, or division by zero.
    """
    m = _CALL.match(expression)
    if m is None:
        raise ValueError(f"one operation on two numbers per call, e.g. 12+7; got {expression!r}")
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    if op in ("/", "//"):
        if b == 0:
            raise ValueError("division by zero")
        return str(a // b) if a % b == 0 else f"{a / b:.4g}"
    return str(a + b if op == "+" else a - b if op == "-" else a * b)


def _apply(value: int, op: str, b: int) -> int:
    return int(calculate(f"{value}{op}{b}"))


def _operand(rng: random.Random, value: int, op: str) -> int | None:
    """A step's number for `op` on `value` keeping the chain a positive integer <= 999."""
    if op == "+":
        return rng.randint(5, 40)
    if op == "-":
        return rng.randint(2, min(40, value - 1)) if value > 2 else None
    if op == "*":
        return rng.randint(2, 5) if value * 2 <= 999 else None
    divisors = [d for d in range(2, 7) if value % d == 0]
    return rng.choice(divisors) if divisors else None


def _chain(rng: random.Random, n_steps: int) -> tuple[int, list[tuple[str, int]]]:
    """A start and `n_steps` (operator, number) steps whose values stay in 1..999."""
    while True:
        start = value = rng.randint(10, 60)
        steps: list[tuple[str, int]] = []
        for _ in range(n_steps):
            op = rng.choice(OPERATORS)
            b = _operand(rng, value, op)
            if b is None:
                break
            value = _apply(value, op, b)
            if not 1 <= value <= 999:
                break
            steps.append((op, b))
        if len(steps) == n_steps:
            return start, steps


class ChainTasks:
    """Deterministic word problems of one split: `sample(k)` is the same dict for a seed and k.

    A task is `{"question", "answer", "steps"}` (plain data; `earl.recipe.TaskSource`).

    Args:
        split: "train" (frames `TRAIN_FRAMES`) or "eval" (`EVAL_FRAMES`).
        seed: stream seed.
        min_steps, max_steps: how many operations a problem takes (drawn uniformly).
    """

    def __init__(self, split: str = "train", seed: int = 0, min_steps: int = 2,
                 max_steps: int = 3) -> None:
        if split not in SPLITS:
            raise ValueError(f"ChainTasks split must be one of {SPLITS}, got {split!r}")
        if not 1 <= min_steps <= max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        self.split, self.seed = split, seed
        self.min_steps, self.max_steps = min_steps, max_steps

    def sample(self, k: int) -> dict[str, object]:
        rng = random.Random(f"chain:{self.split}:{self.seed}:{k}")
        start, steps = _chain(rng, rng.randint(self.min_steps, self.max_steps))
        opening, question = rng.choice(TRAIN_FRAMES if self.split == "train" else EVAL_FRAMES)
        n, x = rng.choice(_NAMES), rng.choice(_THINGS)
        parts = [opening.format(n=n, x=x, a=start)]
        value = start
        for op, b in steps:
            clause = rng.choice(STEPS[op]).format(n=n, x=x, b=b)
            parts.append(f"{rng.choice(_THEN)} {clause}.")
            value = _apply(value, op, b)
        parts.append(question.format(n=n, x=x))
        return {"question": " ".join(parts), "answer": value, "steps": len(steps)}

    def take(self, n: int) -> list[dict[str, object]]:
        """The first `n` samples."""
        return [self.sample(k) for k in range(n)]


# How a `SymbolicTasks` problem opens and asks: varied, so a warm start teaches that the first
# number is the start whatever the words around it, and none of them a task's frame.
_SYM_OPEN = ("Start with {a}.", "Take {a}.", "Begin at {a}.", "The number is {a}.", "x = {a}.",
             "The count starts at {a}.", "Let the value be {a}.")
_SYM_ASK = ("What is the result?", "What is the final number?", "Give the final value.")


class SymbolicTasks:
    """Warm-start problems of another kind: "Start with 54. Then / 2. Next + 29. What is the
    result?", 1-3 steps whose operators are written as symbols (`symbolic_steps` reads them
    back). No person, no thing, no wording of `STEPS`. Same dict shape as `ChainTasks`."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sample(self, k: int) -> dict[str, object]:
        rng = random.Random(f"symbolic:{self.seed}:{k}")
        start, steps = _chain(rng, rng.randint(1, 3))
        parts, value = [rng.choice(_SYM_OPEN).format(a=start)], start
        for op, b in steps:
            parts.append(f"{rng.choice(_THEN)} {op} {b}.")
            value = _apply(value, op, b)
        parts.append(rng.choice(_SYM_ASK))
        return {"question": " ".join(parts), "answer": value, "steps": len(steps)}


_SYMBOLIC = re.compile(
    "(?:" + "|".join(re.escape(o).replace(r"\{a\}", r"(\d+)") for o in _SYM_OPEN) + ")"
    + r"((?: (?:" + "|".join(_THEN) + r") [+\-*/] \d+\.)+) "
    + "(?:" + "|".join(re.escape(q) for q in _SYM_ASK) + ")")


def symbolic_steps(question: str) -> tuple[int, list[tuple[str, int]]]:
    """The start and (operator, number) steps of a `SymbolicTasks` question.

    Raises:
        ValueError: the question is not a `SymbolicTasks` one.
    """
    m = _SYMBOLIC.fullmatch(question)
    if m is None:
        raise ValueError(f"not a SymbolicTasks question: {question!r:.80}")
    start = next(int(g) for g in m.groups()[:-1] if g is not None)
    steps = [(op, int(b)) for op, b in re.findall(r"([+\-*/]) (\d+)\.", m.groups()[-1])]
    return start, steps
