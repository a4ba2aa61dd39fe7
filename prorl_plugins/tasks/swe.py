"""`swe`: a git repository with a failing test; the agent edits the code; eval grades its patch the way
SWE-bench does, on a fresh checkout with the original tests restored.

Instance: {"problem_statement": "...", "files": {"path": "content", ...}, "test_files": {"path": "content"},
           "test_command": "python3 -m unittest -v",
           optional: "FAIL_TO_PASS": [test names], "PASS_TO_PASS": [test names] (lists, or JSON strings of lists
           as in SWE-bench rows), "test_framework": "unittest" | "pytest" (default: pytest if the command
           names it, else unittest), "tools": the agent's tools by name (editor_tools.swe_tools; default:
           the task's, ["bash", "finish"] unless `SweTask(tools=...)` says)}

Eval trusts nothing the agent could have planted (swe_grading.py has the rules):
1. the pipeline has ended every process the agent started;
2. the repository is read through the runtime's file API (links stored as links, never followed), and the
   patch is computed from it in this process: the agent's git (config, hooks, attributes, excludes) never runs;
3. the sandbox is wiped (workspace and /tmp emptied), and the original files are written back with the agent's
   changes that `swe_protected.outside` keeps (the rule SWE-bench rows get: no new module at the repository's root
   or in a test's directory, no compiled Python, no test configuration), the original tests restored, and the
   grader's canary tests (swe_canary.py) added to them;
4. the test command runs as a one-shot process whose exit status comes from the kernel, and the log is read: a
   canary that reports the wrong outcome, or none, scores 0 as tampered; where the instance names the tests that
   must pass, each must appear as passed in the log (an early `exit 0` passes nothing); where it names none, no
   real test may read as failed (the exit status is 1: the canaries that must fail failed), and every test the
   command's test files define, as the runner collects them, must appear as passed or skipped (an `os._exit(0)`
   on a failing test's input passes nothing). A row whose test files hold no Python test gets no canaries, and its
   exit status is the verdict, as before. A row whose command stops at the first failure or selects tests by name
   is refused when loaded (`swe_canary.command_problem`).

The patch and the graded tree are computed on a worker thread: seconds of CPU for a big tree never stall the
service's event loop (and `unified_patch` bounds its own work).

SWE-bench-format rows (SWE-bench, SWE-Gym: `instance_id`, `repo`, `base_commit`, `test_patch`, ...; the repository
in the instance's image at /testbed) are served by swe_bench.py on the same rules, graded by swebench's own log
parsers. Their image is the row's `image`, else an image template (the row's `image_template`, else this task's:
`SweTask(image_template=...)`, else the rollout service's environment variable PRORL_SWE_IMAGE_TEMPLATE, else
`sweb.eval.x86_64.{image_id}.sif`, SWE-bench's image names as files under the runtime's --image-dir).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any

from prorl_adapter.editor_tools import swe_tools
from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError, TaskHandler, Tool
from sandbox_runtime.client import SandboxAPIError

from . import swe_bench
from .swe_bench import named_tests
from .swe_canary import (
    TAMPERED,
    CollectedTest,
    Planted,
    collected_tests,
    command_problem,
    files_run,
    missing_tests,
    plant,
    ran_count,
    tampering,
    without_canaries,
)
from .swe_grading import PASSED, SKIPPED, agent_changes, bounded_patch, graded_tree, parse_test_log, tests_verdict
from .swe_protected import outside

REPO = "repo"
TEST_LOG_BYTES = 8 << 20  # a verbose log in full: a named test cut out of the middle would count as missing


ROW_FIELDS = ("problem_statement", "files", "test_files", "test_command")
DEFAULT_TOOLS = ("bash", "finish")  # editor_tools.EDITOR_TOOLS adds str_replace_editor and search


class SweTask(TaskHandler):
    name = "swe"
    tool_timeout_s = 60.0
    prorl_data_sources = ("swebench",)

    def __init__(self, image_template: str | None = None, tools: tuple[str, ...] = DEFAULT_TOOLS) -> None:
        # For SWE-bench rows that name no image; None: PRORL_SWE_IMAGE_TEMPLATE, else SWE-bench's names.
        self.image_template = image_template
        # The agent's tools for rows that name none (a row's "tools" wins); checked here, so a typo fails at once.
        self.tool_names = tuple(tool.name for tool in swe_tools(list(tools), self.tool_timeout_s))

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return swe_tools(instance.get("tools", list(self.tool_names)), self.tool_timeout_s)

    def _tools_phrase(self, instance: dict[str, Any]) -> str:
        names = [tool.name for tool in self.tools(instance) if tool.name != "finish"] or ["finish"]
        if len(names) == 1:
            return f"the {names[0]} tool"
        return f"the {', '.join(names[:-1])} and {names[-1]} tools"

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
            return swe_bench.system_prompt(row, self._tools_phrase(instance))
        return (
            f"You fix bugs in the git repository in ./{REPO} using {self._tools_phrase(instance)} (one call per "
            "turn). "
            "Do not edit the tests. Call finish when the tests pass."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        if row := self._bench_row(instance):
            return swe_bench.user_prompt(row)
        return f"{instance['problem_statement']}\n\nRun the tests with: cd {REPO} && {instance['test_command']}"

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        self.tools(instance)  # a row's unknown tool fails its init, naming it
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

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        if row := self._bench_row(instance):
            return await swe_bench.evaluate(env, row, state)
        repo = f"{env.workdir}/{REPO}"  # absolute: nothing depends on a session's cwd
        must_pass = named_tests(instance, "FAIL_TO_PASS") + named_tests(instance, "PASS_TO_PASS")
        framework = instance.get("test_framework") or ("pytest" if "pytest" in instance["test_command"] else "unittest")
        try:
            archive = await env.download_archive(repo)
            # Off the event loop: reading, diffing and packing a tree is seconds of CPU for a big one.
            graded = await asyncio.to_thread(graded_own_row, archive, instance, must_pass, framework)
        except (SandboxAPIError, ValueError):  # no readable repository (replaced by a link, too large): no patch
            return {"outcome": 0.0}
        state.artifacts["git_patch"] = graded.patch
        if graded.truncated:  # the files the patch shows only as changed, for size: what it cannot show is named
            state.artifacts["patch_truncated"] = "\n".join(graded.truncated)
        await env.wipe()
        try:  # the runtime refuses a patch whose links lead out of the repository: such a patch scores nothing
            await env.upload_archive(repo, graded.tree)
        except SandboxAPIError as exc:
            if exc.status >= 500:
                raise
            return {"outcome": 0.0}
        result = await env.run(
            script=instance["test_command"], cwd=repo, timeout=self.tool_timeout_s, max_output_bytes=TEST_LOG_BYTES
        )
        if result.status != "completed":
            return {"outcome": 0.0}
        outcome, artifacts = graded_outcome(graded, result.output, result.exit_code, must_pass, framework)
        state.artifacts.update(artifacts)
        return {"outcome": outcome}


def graded_outcome(
    graded: GradedRow, log: str, exit_code: int | None, must_pass: list[str], framework: str
) -> tuple[float, dict[str, str]]:
    """An own row's outcome from its graded run's log and exit status, and the artifacts that say why
    (`tampered`, `test_failures`)."""
    if not graded.planted.canaries:  # no Python test to put canaries beside: the command's word, as it was
        if not must_pass:
            return (1.0 if exit_code == 0 else 0.0), {}
        passed, _ = tests_verdict(parse_test_log(log, framework), must_pass, framework)
        return (1.0 if passed else 0.0), {}
    statuses = parse_test_log(log, framework)
    if tampered := tampering(statuses, graded.planted):
        return 0.0, {TAMPERED: tampered}
    real = without_canaries(statuses, graded.planted)
    if must_pass:
        passed, failures = tests_verdict(real, must_pass, framework)
    else:  # the canaries that must fail make the exit status 1: every test the log reports must not fail, and
        # every test the command runs must be reported
        failures = [f"{name}: {status}" for name, status in real.items() if status not in (PASSED, SKIPPED)]
        failures += unreported(real, graded.expected, graded.planted, log, framework)
        passed = not failures
    return (1.0 if passed else 0.0), {"test_failures": "\n".join(failures)}


@dataclass(frozen=True)
class GradedRow:
    """What eval makes of an own row's repository, in pure Python, before anything runs."""

    patch: str  # the agent's changes, for people and trainers (`git_patch`)
    tree: bytes  # the tar.gz the tests run on
    planted: Planted  # the canaries in its test files
    expected: tuple[CollectedTest, ...] = ()  # a row that names no tests: every test its command runs
    truncated: tuple[str, ...] = ()  # the text files `patch` leaves out for size


def unreported(
    real: dict[str, str], expected: tuple[CollectedTest, ...], planted: Planted, log: str, framework: str
) -> list[str]:
    """For a row that names no tests, why the log does not show every test the command runs: each missing by name
    (a run the code under test ended with os._exit(0) after the tests that passed); in a quiet log, which names only
    what failed, the run's own count short of the tests and canaries (none of which may then be missing)."""
    if any(status == PASSED for status in real.values()):
        return missing_tests(real, expected)
    ran = ran_count(log, framework)
    wanted = len(expected) + len(planted.canaries)
    return [] if ran is not None and ran >= wanted else [f"the run reports {ran} tests of at least {wanted}: missing"]


def graded_own_row(archive: bytes, instance: dict[str, Any], must_pass: list[str], framework: str) -> GradedRow:
    """The tree an own row's tests run on: the original files with the agent's changes that `outside` keeps (the
    rule SWE-bench rows get), the original tests restored with the grader's canaries among them."""
    test_files = instance["test_files"]
    original = {**instance["files"], **test_files}
    changes = agent_changes(archive, original)
    kept = outside(changes, test_files, original, instance["test_command"])
    runs = files_run(instance["test_command"], framework, test_files, original)
    planted = plant(test_files, must_pass, framework, passing=named_tests(instance, "PASS_TO_PASS"), runs=runs)
    expected = () if must_pass else tuple(collected_tests(test_files, framework, runs))
    tree = graded_tree(original, {**test_files, **planted.files}, kept)
    patch, truncated = bounded_patch(changes, original)
    return GradedRow(patch, tree, planted, expected, tuple(truncated))


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
    framework = instance.get("test_framework") or ("pytest" if "pytest" in instance["test_command"] else "unittest")
    if problem := command_problem(instance["test_command"], framework, {**instance["files"], **instance["test_files"]}):
        raise TaskConfigError(problem)
