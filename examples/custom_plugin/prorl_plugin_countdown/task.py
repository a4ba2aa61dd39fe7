"""`countdown`: reach a target number by combining the given numbers with + - * / and parentheses.

Instance: {"numbers": [25, 3, 7], "target": 46, "id": "cd-1"}; each number may be used at most once.

- init writes the puzzle to `puzzle.txt` in the sandbox's working directory;
- the agent gets the default tools, `bash` (it can `cat puzzle.txt` or try an expression with python3) and
  `finish`, whose `answer` is the expression, e.g. "25 + 3 * 7";
- eval parses the answer (never `eval`s it) and scores `outcome` 1.0 when it reaches the target, else 0.0.
"""

from __future__ import annotations

import ast
import operator
from collections import Counter
from fractions import Fraction
from typing import Any

from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError, TaskHandler

PUZZLE_FILE = "puzzle.txt"
MAX_ANSWER_CHARS = 200
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def puzzle(instance: dict[str, Any]) -> tuple[list[int], int]:
    """The instance's numbers and target; `TaskConfigError` (the job fails in init) when they are not ints."""
    numbers, target = instance.get("numbers"), instance.get("target")
    if not isinstance(numbers, list) or not numbers or not all(_is_int(n) for n in numbers):
        raise TaskConfigError(f"a countdown instance needs 'numbers', a non-empty list of ints; got {numbers!r}")
    if not _is_int(target):
        raise TaskConfigError(f"a countdown instance needs 'target', an int; got {target!r}")
    return numbers, target


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of an expression of integers, + - * / and parentheses, and the integers it uses.

    Raises ValueError for anything else (names, calls, powers, unary minus, division by zero).
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    used: list[int] = []

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and _is_int(node.value):
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"only integers, + - * / and parentheses are allowed, not {ast.unparse(node)!r}")

    return value(tree.body), used


def solves(answer: str | None, numbers: list[int], target: int) -> bool:
    """True when `answer` (an expression, optionally followed by "= target") reaches `target` using each of
    `numbers` at most once."""
    if answer is None or len(answer) > MAX_ANSWER_CHARS:
        return False
    try:
        result, used = evaluate_expression(answer.split("=")[0])
    except ValueError:
        return False
    return result == target and not Counter(used) - Counter(numbers)


class CountdownTask(TaskHandler):
    name = "countdown"

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return (
            "Reach the target number by combining the given numbers with + - * / and parentheses, using each "
            f"number at most once. The puzzle is also in {PUZZLE_FILE}; you may compute with the bash tool. Call "
            "one tool per turn, and give your expression, for example (25 - 3) * 2, "
            "as the answer of the finish tool."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        numbers, target = puzzle(instance)
        return f"Numbers: {' '.join(map(str, numbers))}. Target: {target}."

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        numbers, target = puzzle(instance)  # a bad instance fails the job here, with the message above
        await env.write_file(PUZZLE_FILE, f"numbers: {' '.join(map(str, numbers))}\ntarget: {target}\n")

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        numbers, target = puzzle(instance)
        return {"outcome": 1.0 if solves(state.answer, numbers, target) else 0.0}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
