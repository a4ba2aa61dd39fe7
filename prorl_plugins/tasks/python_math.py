"""`python_math`: solve a question with a Python tool; the final answer is compared with the reference.

Instance: {"question": "What is 17 * 23?", "answer": "391"}; numbers compare with a relative tolerance of 1e-6, and
an answer given as `\\boxed{...}` is read inside its box. It also serves ProRL Agent's `deepscaler` rows
(`prompt: [{"content": question}]`, `reward_model: {"ground_truth": answer}`, either also as a JSON string).
"""

from __future__ import annotations

import json
import math
from typing import Any

from prorl_adapter.tasks import FINISH, EpisodeState, SandboxHandle, TaskConfigError, TaskHandler, Tool, python_tool

BOX = "\\boxed{"


def unboxed(answer: str) -> str:
    """The content of the last `\\boxed{...}` in `answer` (a math model's way to mark its answer), braces inside
    it balanced; else `answer`."""
    start = answer.rfind(BOX)
    if start < 0:
        return answer
    depth = 0
    for end in range(start + len(BOX), len(answer)):
        if answer[end] == "{":
            depth += 1
        elif answer[end] == "}":
            if depth == 0:
                return answer[start + len(BOX) : end]
            depth -= 1
    return answer


def answers_match(given: str | None, expected: str) -> bool:
    if given is None:
        return False
    given, expected = unboxed(given).strip().rstrip("."), unboxed(expected).strip()
    try:
        return math.isclose(float(given.replace(",", "")), float(expected.replace(",", "")), rel_tol=1e-6)
    except ValueError:
        return given.lower() == expected.lower()


def _json_or_value(value: Any) -> Any:
    """ProRL's rows keep some fields as JSON strings (as parquet files store them)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


class PythonMathTask(TaskHandler):
    name = "python_math"
    prorl_data_sources = ("deepscaler",)
    supports_agent_programs = False  # graded on the `finish` tool's answer, which only the built-in loop has

    def from_prorl_instance(self, data_source: str, row: dict[str, Any]) -> dict[str, Any]:
        prompt = _json_or_value(row.get("prompt"))
        reward_model = _json_or_value(row.get("reward_model"))
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            prompt = prompt[0].get("content")
        if not isinstance(prompt, str) or not prompt:
            raise TaskConfigError("the row needs 'prompt': a list whose first entry has the problem as 'content'")
        if not isinstance(reward_model, dict) or reward_model.get("ground_truth") is None:
            raise TaskConfigError("the row needs 'reward_model' with the answer as 'ground_truth'")
        return {**row, "question": prompt, "answer": str(reward_model["ground_truth"])}

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [python_tool(self.tool_timeout_s), FINISH]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return (
            "Solve the problem. You may run Python with the python tool; give the final answer, "
            "a number only, with the finish tool."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance["question"])

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        if "question" not in instance or "answer" not in instance:
            raise TaskConfigError("a python_math instance needs 'question' and 'answer'")

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        return {"outcome": 1.0 if answers_match(state.answer, str(instance["answer"])) else 0.0}
