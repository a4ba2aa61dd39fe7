"""`arithmetic`: generated integer arithmetic that a Python tool answers, for a plain instruct model.

The instance is python_math's ({"question": "What is 41 * 38?", "answer": "1558"}), and so is the grading of a
`finish` answer; without one, what the policy's last python block prints is the answer (`ArithmeticTask`). A
plain instruct model (SmolLM2-135M) writes actions as fenced text blocks, so the task's action format is
`fenced`, and the user prompt shows the block to write. `arithmetic_instances` makes the questions, seeded,
with a difficulty (`ArithmeticLevel`) that sets how often the untrained model succeeds (docs/cpu-trainer.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

from prorl_adapter.tasks import EpisodeState, SandboxHandle, Tool

from .python_math import PythonMathTask, answers_match

OPERATORS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticLevel:
    """How hard the questions are: `operations` operators between numbers of `min_digits`..`max_digits` digits,
    drawn from `operators` (Python's precedence applies, the question's text is the expression)."""

    operations: int = 1
    min_digits: int = 1
    max_digits: int = 1
    operators: tuple[str, ...] = OPERATORS

    def __post_init__(self) -> None:
        if self.operations < 1 or not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"an arithmetic level needs operations >= 1 and 1 <= min_digits <= max_digits: {self}")
        if not self.operators or set(self.operators) - set(OPERATORS):
            raise ValueError(f"operators must be a non-empty subset of {OPERATORS}: {self.operators}")


def arithmetic_instances(count: int, seed: int, level: ArithmeticLevel = ArithmeticLevel()) -> list[dict[str, Any]]:
    """`count` questions drawn from `seed` (the same arguments give the same questions), each with its id and its
    answer computed here."""
    rng = random.Random(f"arithmetic-{seed}")
    rows = []
    for index in range(count):
        digits = [rng.randint(level.min_digits, level.max_digits) for _ in range(level.operations + 1)]
        numbers = [rng.randint(10 ** (d - 1), 10**d - 1) for d in digits]
        operators = [rng.choice(level.operators) for _ in range(level.operations)]
        expression = " ".join([str(numbers[0]), *(f"{op} {n}" for op, n in zip(operators, numbers[1:]))])
        answer = value(numbers, operators)
        rows.append({"id": f"arith-{seed}-{index}", "question": f"What is {expression}?", "answer": str(answer)})
    return rows


def value(numbers: list[int], operators: list[str]) -> int:
    """`numbers[0] op numbers[1] op ...` with Python's precedence: products first, then sums left to right."""
    terms, signs = [numbers[0]], []
    for op, number in zip(operators, numbers[1:]):
        if op == "*":
            terms[-1] *= number
        else:
            signs.append(op)
            terms.append(number)
    total = terms[0]
    for op, term in zip(signs, terms[1:]):
        total = total + term if op == "+" else total - term
    return total


PROGRAM = "program"  # EpisodeState.artifacts key: the last python block the policy ran
PROGRAM_PATH = "/tmp/graded_program.py"


class ArithmeticTask(PythonMathTask):
    """Graded on the `finish` answer where the policy gave one, else on what its last python block prints, run
    again at eval in a fresh process (its last line of output). Measured (docs/cpu-trainer.md): the untrained
    SmolLM2-135M-Instruct at temperature 1.0 wrote no ```finish block in 64 episodes of 2-3 turns, so a task
    graded on `finish` alone starts at 0% and GRPO has nothing to compare; its python blocks print the right
    number often enough to learn from. The program is the policy's own text, rerun after every process it
    started has ended (`SandboxHandle.run`), so no output it left behind is trusted."""

    name = "arithmetic"
    prorl_data_sources = ()
    action_format = "fenced"

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        python, finish = super().tools(instance)
        inner = python.run

        async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
            state.artifacts[PROGRAM] = str(args.get("code", ""))
            return await inner(env, args, state)

        return [replace(python, run=run), finish]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You are a careful assistant who computes with Python instead of guessing."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        # Measured on the untrained model (docs/cpu-trainer.md): an example block made it write python blocks,
        # but a fixed example ahead of the question was copied (a third of its programs printed the example);
        # a worked example first and the question last, as few-shot prompts go, primes it for this question.
        return (
            "Compute each result with Python: reply with a Python code block that prints it.\n\n"
            "Question: What is 7 + 5?\n```python\nprint(7 + 5)\n```\n\n"
            f"Question: {instance['question']}"
        )

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        if state.answer is not None or PROGRAM not in state.artifacts:
            return await super().evaluate(env, instance, state)
        await env.write_file(PROGRAM_PATH, state.artifacts[PROGRAM])
        result = await env.run(argv=["python3", PROGRAM_PATH], timeout=self.tool_timeout_s, max_output_bytes=4096)
        lines = result.output.strip().splitlines()
        printed = lines[-1] if result.exit_code == 0 and lines else None
        return {"outcome": 1.0 if answers_match(printed, str(instance["answer"])) else 0.0}
