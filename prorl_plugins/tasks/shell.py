"""`shell`: reach a goal in a shell; a check command decides.

Instance: {"goal": "...", "check": "<bash command, exit 0 = solved>", "setup": "<optional bash run at init>"}

The check runs clean (clean_check.py): a one-shot bash in the workspace, with none of the agent's shell state, and a
Python that imports nothing from the workspace (a planted `json.py` is data, not the `json` module).
"""

from __future__ import annotations

from typing import Any

from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError, TaskHandler

from .clean_check import run_check


class ShellTask(TaskHandler):
    name = "shell"

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "You operate a Linux shell through tools. Call one tool per turn. Call finish when the goal is reached."

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance["goal"])

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        for field in ("goal", "check"):
            if not instance.get(field):
                raise TaskConfigError(f"a shell task instance needs {field!r}")
        if instance.get("setup"):
            result = await env.exec(instance["setup"], timeout=60)
            if result.exit_code != 0:
                raise TaskConfigError(f"setup failed with exit code {result.exit_code}: {result.output[-500:]}")

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        result = await run_check(env, instance["check"])
        return {"outcome": 1.0 if result.status == "completed" and result.exit_code == 0 else 0.0}
