"""`shell`: reach a goal in a shell; a check command decides.

Instance: {"goal": "...", "check": "<bash command, exit 0 = solved>", "setup": "<optional bash run at init>"}
"""

from __future__ import annotations

from typing import Any

from prorl_adapter.tasks import Environment, EpisodeState, TaskConfigError, TaskHandler


class ShellTask(TaskHandler):
    name = "shell"

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return (
            "You operate a Linux shell through tools. Call one tool per turn inside <tool_call></tool_call>. "
            "Call finish when the goal is reached."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return str(instance["goal"])

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        for field in ("goal", "check"):
            if not instance.get(field):
                raise TaskConfigError(f"a shell task instance needs {field!r}")
        if instance.get("setup"):
            result = await env.exec(instance["setup"], timeout=60)
            if result.exit_code != 0:
                raise TaskConfigError(f"setup failed with exit code {result.exit_code}: {result.output[-500:]}")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        result = await env.run(script=instance["check"], timeout=60)
        return {"outcome": 1.0 if result.status == "completed" and result.exit_code == 0 else 0.0}
