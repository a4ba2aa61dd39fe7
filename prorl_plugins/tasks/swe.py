"""`swe`: a git repository with a failing test; the agent edits the code; eval grades its patch the way
SWE-bench does, on a fresh checkout with the original tests restored.

Instance: {"problem_statement": "...", "files": {"path": "content", ...}, "test_files": {"path": "content"},
           "test_command": "python3 -m unittest -v",
           optional: "FAIL_TO_PASS": [test names], "PASS_TO_PASS": [test names] (lists, or JSON strings of lists
           as in SWE-bench rows), "test_framework": "unittest" | "pytest" (default: pytest if the command
           names it, else unittest)}

Eval trusts nothing the agent could have planted (swe_grading.py has the rules):
1. the pipeline has ended every process the agent started;
2. the repository is read through the runtime's file API (links stored as links, never followed), and the
   patch is computed from it in this process: the agent's git (config, hooks, attributes, excludes) never runs;
3. the sandbox is wiped (workspace and /tmp emptied), and the original files with the patch applied and the
   original tests restored are written back;
4. the test command runs as a one-shot process whose exit status comes from the kernel; where the instance
   names the tests that must pass, each must appear as passed in the log (an early `exit 0` passes nothing).

SWE-bench-format rows (SWE-bench, SWE-Gym: `instance_id`, `repo`, `base_commit`, `test_patch`, ...; the repository
in the instance's image at /testbed) are served by swe_bench.py on the same rules, graded by swebench's own log
parsers. Their image is the row's `image`, else an image template (the row's `image_template`, else this task's:
`SweTask(image_template=...)`, else the rollout service's environment variable PRORL_SWE_IMAGE_TEMPLATE, else
`sweb.eval.x86_64.{image_id}.sif`, SWE-bench's image names as files under the runtime's --image-dir).
"""

from __future__ import annotations

import os
from typing import Any

from prorl_adapter.tasks import Environment, EpisodeState, TaskConfigError, TaskHandler
from sandbox_runtime.client import SandboxAPIError

from . import swe_bench
from .swe_bench import named_tests
from .swe_grading import agent_changes, graded_tree, parse_test_log, tests_verdict, unified_patch

REPO = "repo"
TEST_LOG_BYTES = 8 << 20  # a verbose log in full: a named test cut out of the middle would count as missing


ROW_FIELDS = ("problem_statement", "files", "test_files", "test_command")


class SweTask(TaskHandler):
    name = "swe"
    tool_timeout_s = 60.0
    prorl_data_sources = ("swebench",)

    def __init__(self, image_template: str | None = None) -> None:
        # For SWE-bench rows that name no image; None: PRORL_SWE_IMAGE_TEMPLATE, else SWE-bench's names.
        self.image_template = image_template

    def _image_template(self) -> str:
        if self.image_template is not None:
            return self.image_template
        return os.environ.get(swe_bench.IMAGE_TEMPLATE_ENV, swe_bench.DEFAULT_IMAGE_TEMPLATE)

    def _bench_row(self, instance: dict[str, Any]) -> swe_bench.BenchRow | None:
        """The SWE-bench row checked (TaskConfigError naming what is wrong); None for a row of the task's own."""
        return swe_bench.bench_row(instance, self._image_template()) if swe_bench.is_bench_row(instance) else None

    def from_prorl_instance(self, data_source: str, row: dict[str, Any]) -> dict[str, Any]:
        """A ProRL `swebench` row: a SWE-bench or SWE-Gym row (the repository in the instance's image), or one that
        carries the repository itself, as this task's own rows do."""
        if self._bench_row(row) is None:
            if not any(row.get(name) for name in ("files", "test_files", "test_command")):
                raise TaskConfigError(
                    "the row brings no repository: a SWE-bench row needs 'base_commit' and 'test_patch' (its "
                    "repository in the instance's image), this task's own rows 'files', 'test_files' and "
                    f"'test_command' ({row.get('instance_id', 'no instance_id')})"
                )
            check_row(row)
        return row

    def sandbox_spec(self, instance: dict[str, Any]) -> dict[str, Any]:
        if swe_bench.is_bench_row(instance):
            return swe_bench.sandbox_spec(instance, self._image_template())
        return super().sandbox_spec(instance)

    def system_prompt(self, instance: dict[str, Any]) -> str:
        if row := self._bench_row(instance):
            return swe_bench.system_prompt(row)
        return (
            f"You fix bugs in the git repository in ./{REPO} using the bash tool (one call per turn, inside "
            "<tool_call></tool_call>). Do not edit the tests. Call finish when the tests pass."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        if row := self._bench_row(instance):
            return swe_bench.user_prompt(row)
        return f"{instance['problem_statement']}\n\nRun the tests with: cd {REPO} && {instance['test_command']}"

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        if row := self._bench_row(instance):
            return await swe_bench.init(env, row)
        check_row(instance)
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
        if row := self._bench_row(instance):
            return await swe_bench.evaluate(env, row, state)
        repo = f"{env.workdir}/{REPO}"  # absolute: nothing depends on a session's cwd
        original = {**instance["files"], **instance["test_files"]}
        try:
            changes = agent_changes(await env.download_archive(repo), original)
        except (SandboxAPIError, ValueError):  # no readable repository (replaced by a link, too large): no patch
            return {"outcome": 0.0}
        state.artifacts["git_patch"] = unified_patch(changes, original)
        await env.wipe()
        try:  # the runtime refuses a patch whose links lead out of the repository: such a patch scores nothing
            await env.upload_archive(repo, graded_tree(original, instance["test_files"], changes))
        except SandboxAPIError as exc:
            if exc.status >= 500:
                raise
            return {"outcome": 0.0}
        result = await env.run(
            script=instance["test_command"], cwd=repo, timeout=self.tool_timeout_s, max_output_bytes=TEST_LOG_BYTES
        )
        if result.status != "completed":
            return {"outcome": 0.0}
        must_pass = named_tests(instance, "FAIL_TO_PASS") + named_tests(instance, "PASS_TO_PASS")
        if not must_pass:
            return {"outcome": 1.0 if result.exit_code == 0 else 0.0}
        framework = instance.get("test_framework") or ("pytest" if "pytest" in instance["test_command"] else "unittest")
        passed, _ = tests_verdict(parse_test_log(result.output, framework), must_pass, framework)
        return {"outcome": 1.0 if passed else 0.0}


def check_row(instance: dict[str, Any]) -> None:
    """What an swe instance must hold, each of the right type (TaskConfigError naming the first that is not)."""
    missing = [name for name in ROW_FIELDS if not instance.get(name)]
    if missing:
        raise TaskConfigError(f"an swe instance needs {', '.join(map(repr, missing))}")
    for name in ("problem_statement", "test_command"):
        if not isinstance(instance[name], str):
            raise TaskConfigError(f"{name!r} must be a string")
    for name in ("files", "test_files"):
        files = instance[name]
        if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise TaskConfigError(f"{name!r} must map each path to its content (strings)")
    named_tests(instance, "FAIL_TO_PASS"), named_tests(instance, "PASS_TO_PASS")
