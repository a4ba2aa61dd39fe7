"""`swe`: a git repository with a failing test; the agent edits the code, and at eval its patch is applied to a
clean checkout with the original tests restored, and the tests run in the same sandbox.

Instance: {"problem_statement": "...", "files": {"path": "content", ...}, "test_files": {"path": "content"},
           "test_command": "python3 -m unittest -q"}
"""

from __future__ import annotations

import shlex
from typing import Any

from prorl_adapter.tasks import Environment, EpisodeState, TaskConfigError, TaskHandler

REPO = "repo"
PATCH = "/tmp/agent.patch"


class SweTask(TaskHandler):
    name = "swe"
    tool_timeout_s = 60.0

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return (
            f"You fix bugs in the git repository in ./{REPO} using the bash tool (one call per turn, inside "
            "<tool_call></tool_call>). Do not edit the tests. Call finish when the tests pass."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return f"{instance['problem_statement']}\n\nRun the tests with: cd {REPO} && {instance['test_command']}"

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        for field in ("problem_statement", "files", "test_files", "test_command"):
            if not instance.get(field):
                raise TaskConfigError(f"an swe instance needs {field!r}")
        for path, content in {**instance["files"], **instance["test_files"]}.items():
            await env.write_file(f"{REPO}/{path}", content)
        result = await env.exec(
            f"cd {env.workdir}/{REPO} && git init -q && git add -A && "
            "git -c user.name=prorl -c user.email=prorl@localhost commit -qm base && echo ok",
            timeout=60,
        )
        if not result.output.endswith("ok\n"):
            raise TaskConfigError(f"could not create the repository: {result.output[-500:]}")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        tests = list(instance["test_files"])
        excludes = " ".join(f"--exclude={shlex.quote(t)}" for t in tests)
        repo = f"{env.workdir}/{REPO}"  # absolute: the session's cwd is whatever the last command left
        await env.exec(
            f"cd {repo} && git add -A && git diff --cached --binary > {PATCH} && git reset -q --hard && git clean -qfd"
        )
        for path, content in instance["test_files"].items():
            await env.write_file(f"{REPO}/{path}", content)
        applied = await env.exec(f"cd {repo} && (test ! -s {PATCH} || git apply {excludes} {PATCH}) && echo applied")
        if not applied.output.endswith("applied\n"):
            return {"outcome": 0.0}  # the patch does not apply to a clean checkout
        result = await env.exec(f"cd {repo} && {instance['test_command']}", timeout=self.tool_timeout_s)
        passed = result.status == "completed" and result.exit_code == 0
        return {"outcome": 1.0 if passed else 0.0}
