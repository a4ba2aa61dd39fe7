"""`python_math`: solve a question with a Python tool; the final answer is compared with the reference.

Instance: {"question": "What is 17 * 23?", "answer": "391"}; numbers compare with a relative tolerance of 1e-6.
"""

from __future__ import annotations

import math
from typing import Any

from prorl_adapter.tasks import FINISH, Environment, EpisodeState, TaskConfigError, TaskHandler, Tool, python_tool


def answers_match(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    given, expected = given.strip().rstrip("."), expected.strip()
    try:
        return math.isclose(float(given.replace(",", "")), float(expected.replace(",", "")), rel_tol=1e-6)
    except ValueError:
        return given.lower() == expected.lower()


class PythonMathTask(TaskHandler):
    name = "python_math"

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [python_tool(self.tool_timeout_s), FINISH]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return (
            "Solve the problem. You may run Python with the python tool; give the final answer, "
            "a number only, with the finish tool. Call tools inside <tool_call></tool_call>."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance["question"])

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        if "question" not in instance or "answer" not in instance:
            raise TaskConfigError("a python_math instance needs 'question' and 'answer'")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        return {"outcome": 1.0 if answers_match(state.answer, str(instance["answer"])) else 0.0}
