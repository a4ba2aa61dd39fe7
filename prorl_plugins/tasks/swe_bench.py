"""SWE-bench-format rows of the `swe` task (SWE-bench, its Lite and Verified sets, SWE-Gym): the repository lives
in the instance's image, at /testbed, checked out at base_commit; eval grades the agent's patch as SWE-bench does.

Row: {"instance_id": "astropy__astropy-12907", "repo": "astropy/astropy", "base_commit": "d16bfe05a744...",
      "problem_statement": "...", "test_patch": "diff --git a/... (a unified diff, as git writes it)",
      "FAIL_TO_PASS": [test names], "PASS_TO_PASS": [test names] (lists, or JSON strings of lists, as in the
      datasets), optional: "version" (with `repo`, it picks swebench's test command), "image" (a name under the
      runtime's --image-dir), "image_template", "repo_path" (where the image holds the repository; /testbed),
      "test_cmd" (SWE-bench's kind: the test patch's test files are appended) or "test_command" (the whole
      command, run as it is), "env" (the sandbox's environment, replacing TESTBED_ENV), "limits"}
Other fields (the gold `patch`, `hints_text`, ...) are ignored; the gold patch is never shown.

The image is the row's `image`, else its `image_template`, else the rollout service's PRORL_SWE_IMAGE_TEMPLATE,
else DEFAULT_IMAGE_TEMPLATE, formatted with {instance_id} (as in the row), {image_id} (as SWE-bench's published
images spell it: lower case, `__` as `_1776_`), {repo} and {version}.

The sandbox works where SWE-bench's agents work: in /testbed (`repo_path`) itself. The runtime shows the image's
root read-only, so the sandbox's workspace is mounted at /testbed and seeded with a copy of the image's /testbed
(`seed_workdir`: again at every wipe), build products and all. Most SWE-bench images install the repository in
editable mode from /testbed (an egg-link, a `.pth` file, a src-layout package's path hook); for those that install
a copy, /testbed is first on PYTHONPATH: the code Python imports is the agent's, as in SWE-bench.

init: the seeded /testbed is checked to be a git repository, checked out at base_commit where its HEAD is not
there already (a SWE-bench image's is, and its tree holds the uncommitted changes of swebench's `pre_install`
steps, which a forced checkout would undo; nothing is cleaned either: untracked build products are the
environment's), and the test patch is checked to apply; the agent never sees the patch.

eval, as SWE-bench grades, trusting nothing the agent could have planted (the pipeline has ended its processes):
1. the agent's repository is read through the runtime's file API (its `.git` pruned of objects first, so that a
   big repository fits) and its changes computed in this process (swe_grading): its git never runs;
2. the sandbox is wiped, which seeds /testbed afresh from the image (which the agent could not write: the runtime
   copies it from the read-only image), so git run there by eval is trusted; the fresh tree, read back (its .git
   set aside in /tmp meanwhile), is what the agent's changes are taken relative to;
3. the test patch is applied to the fresh copy (git apply), then the agent's changes, except (`outside`) at
   every path the test patch touches and the test packages' __init__.py, at the test runner the command names
   (tests/runtests.py, bin/test) and the modules beside it, at every file that configures how tests are
   collected or run (conftest.py, sitecustomize.py, pytest.ini, tox.ini, setup.cfg, pyproject.toml, ...: any of
   them can load a plugin that reports every test passed), installation records (*.egg-info, *.dist-info,
   .pth: entry points such as pytest plugins), the root's dotfiles, compiled Python (`__pycache__`, .pyc), new
   modules in the repository's root or a test's directory (they would shadow pytest or the standard library)
   and what lies below one of its symlinks (swe_protected.py: the rule the task's own rows get too); then the
   grader's canary tests (swe_canary.py) are added to the test patch's files that hold a named test;
4. the tests run as a one-shot process (swebench's test command for the repo and version, else `python3 -m
   pytest -rA` on the test patch's test files; the image's conda `testbed` environment activated where it has
   one; a run that times out scores 0, and its exit status is not read: as in SWE-bench, tests outside the two
   lists may fail; HOME is a fresh directory in /tmp, so no dotfile the agent left configures conda, git or
   Python there), and swebench's log parser for the repo reads the log: every FAIL_TO_PASS test must be PASSED
   (XFAIL, which SWE-bench counts as passed, is what one pytest.xfail() in the code under test makes of every
   test that reaches it), every PASS_TO_PASS test PASSED or XFAIL. A test missing from the
   log fails, and so does one that any line of the log on its own reports as failed: swebench's parsers keep a
   test's last line, which a line printed by the code under test after pytest's summary would otherwise be.

The canaries make a rewritten runner visible: code under test that monkeypatches pytest when imported reaches
them too, and a canary that must fail reading as passed, or missing from the log, scores 0 as tampered (the
artifact `tampered` says why). Not defended: code that tells the canaries from the real tests and reports them
truthfully while lying about the rest (docs/security.md).

Not done, unlike SWE-bench's eval script: swebench's `install` step is not run again before the tests (it installs
into the image's read-only site-packages). An editable install already points at /testbed, and the repository
is first on PYTHONPATH for the images that install a copy (Django 1.x-2.x, requests); compiled extensions are
those the image built, and a package below lib/ or src/ installed as a copy runs the image's copy.
"""

from __future__ import annotations

import asyncio
import codecs
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import sys
import threading
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError
from sandbox_runtime.client import SandboxAPIError
from sandbox_runtime.models import SandboxSpec

from .swe_canary import TAMPERED, Planted, plant, tampering
from .swe_grading import AgentChanges, agent_changes, bounded_patch, graded_tree, repository_tree
from .swe_protected import outside

REPO_PATH = "/testbed"
DEFAULT_IMAGE_TEMPLATE = "sweb.eval.x86_64.{image_id}.sif"
IMAGE_TEMPLATE_ENV = "PRORL_SWE_IMAGE_TEMPLATE"
FALLBACK_TEST_CMD = "python3 -m pytest -rA"
# SWE-bench's images keep the instance's environment in conda's `testbed` env, which their Dockerfile activates in
# root's .bashrc only: first on PATH for the agent's shell (which reads no .bashrc), activated properly for the
# graded run. A directory that does not exist costs nothing, so images without conda (SWE-Gym's own builds, the
# tests' Debian image) run as they are. Nothing else: the image's own installation finds the repository.
TESTBED_ENV = {
    "PATH": "/opt/miniconda3/envs/testbed/bin:/opt/miniconda3/condabin:/opt/miniconda3/bin:"
    "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}
CONDA_ACTIVATE = (
    "if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate && conda activate testbed; fi"
)
REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "FAIL_TO_PASS")
CHECKOUT_TIMEOUT_S = 900.0  # a big repository, on a slow shared file system
MOVE_TIMEOUT_S = 900.0  # a big .git, copied to /tmp and back (another mount: mv copies)
TEST_TIMEOUT_S = 1800.0  # SWE-bench's own per-instance default
TEST_LOG_BYTES = 8 << 20
TREE_BYTES = 1 << 30  # what a repository's files may hold in all, read into this process for grading
_COMMIT = re.compile(r"[0-9a-f]{7,64}")
_DIFF_HEADER = re.compile(r'^diff --git (?P<old>"(?:[^"\\]|\\.)*"|\S+) (?P<new>"(?:[^"\\]|\\.)*"|\S+)$', re.MULTILINE)
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def is_bench_row(row: Mapping[str, Any]) -> bool:
    """Whether `row` is SWE-bench's format (the repository in an image) rather than the task's own (`files`)."""
    return "files" not in row and ("base_commit" in row or "test_patch" in row)


# --- The row ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchRow:
    """A checked SWE-bench row."""

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    test_patch: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    version: str | None
    image: str
    repo_path: str
    test_paths: frozenset[str]  # every path the test patch touches, before and after
    test_cmd: str | None  # the row's, SWE-bench's kind
    test_command: str | None  # the row's, run as it is
    env: dict[str, str]
    limits: dict[str, Any]


def bench_row(row: Mapping[str, Any], image_template: str | None = None) -> BenchRow:
    """The row checked, or TaskConfigError naming the first field that is missing or wrong. `image_template` is the
    task's, used where the row names neither an image nor a template of its own."""
    missing = [name for name in REQUIRED if not row.get(name)]
    if missing:
        raise TaskConfigError(f"a SWE-bench row needs {', '.join(map(repr, missing))}")
    for name in ("instance_id", "repo", "base_commit", "problem_statement", "test_patch"):
        if not isinstance(row[name], str):
            raise TaskConfigError(f"{name!r} must be a string")
    base_commit = row["base_commit"].strip().lower()
    if not _COMMIT.fullmatch(base_commit):
        raise TaskConfigError(f"'base_commit' must be a commit hash (hex digits), not {row['base_commit']!r}")
    fail_to_pass = named_tests(row, "FAIL_TO_PASS")
    if not fail_to_pass:
        raise TaskConfigError("'FAIL_TO_PASS' names no test: there would be nothing to grade")
    version = row.get("version")
    if version is not None and not isinstance(version, str | int | float):
        raise TaskConfigError("'version' must be a string such as '4.3'")
    repo_path = row.get("repo_path", REPO_PATH)
    if not isinstance(repo_path, str) or not repo_path.startswith("/") or ".." in repo_path.split("/"):
        raise TaskConfigError(f"'repo_path' must be an absolute path inside the image, not {repo_path!r}")
    try:  # the sandbox's workdir: not a system directory such as /usr or /tmp
        repo_path = SandboxSpec(image="x", workdir=repo_path, seed_workdir=True).workdir
    except ValueError as exc:
        raise TaskConfigError(f"'repo_path' {repo_path!r} cannot be the sandbox's workdir: {exc}") from None
    test_cmd, test_command = (_optional_string(row, name) for name in ("test_cmd", "test_command"))
    # The repository first on sys.path: some SWE-bench images install it as a copy in site-packages (Django
    # 1.x-2.x `setup.py install`, requests `pip install .`), which would otherwise be what runs, not the agent's.
    env, limits = row.get("env", {**TESTBED_ENV, "PYTHONPATH": repo_path}), row.get("limits", {})
    if not isinstance(env, dict) or not isinstance(limits, dict):
        raise TaskConfigError("'env' and 'limits' must be objects")
    return BenchRow(
        instance_id=row["instance_id"],
        repo=row["repo"],
        base_commit=base_commit,
        problem_statement=row["problem_statement"],
        test_patch=row["test_patch"],
        fail_to_pass=fail_to_pass,
        pass_to_pass=named_tests(row, "PASS_TO_PASS"),
        version=None if version is None else str(version),
        image=image_name(row, image_template),
        repo_path=repo_path,
        test_paths=frozenset(patch_paths(row["test_patch"])),
        test_cmd=test_cmd,
        test_command=test_command,
        env=env,
        limits=limits,
    )


def named_tests(row: Mapping[str, Any], field: str) -> list[str]:
    """A SWE-bench test list: a list of names, or a JSON string of one (as SWE-bench rows store them)."""
    value = row.get(field) or []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise TaskConfigError(f"{field} must be a list of test names or a JSON string of one") from None
    if not isinstance(value, list) or not all(isinstance(name, str) for name in value):
        raise TaskConfigError(f"{field} must be a list of test names")
    return value


def _optional_string(row: Mapping[str, Any], name: str) -> str | None:
    value = row.get(name)
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise TaskConfigError(f"{name!r} must be a non-empty string (a shell command)")
    return value


def image_name(row: Mapping[str, Any], template: str | None = None) -> str:
    """The image the row runs in: its `image`, else a template (the row's `image_template`, else `template`, the
    task's) with {instance_id}, {image_id} (SWE-bench's spelling: lower case, `__` as `_1776_`), {repo}, {version}.
    TaskConfigError when there is neither, or the name is not one the runtime takes."""
    image = row.get("image")
    if image is None:
        template = row.get("image_template", template)
        if not template:
            raise TaskConfigError("the row names no 'image' and there is no image template ('image_template')")
        if not isinstance(template, str):
            raise TaskConfigError("'image_template' must be a string such as 'sweb.eval.x86_64.{image_id}.sif'")
        instance_id = str(row.get("instance_id", ""))
        fields = {
            "instance_id": instance_id,
            "image_id": instance_id.lower().replace("__", "_1776_"),
            "repo": str(row.get("repo", "")),
            "version": str(row.get("version", "")),
        }
        try:
            image = template.format(**fields)
        except (KeyError, IndexError, ValueError) as exc:
            raise TaskConfigError(
                f"'image_template' {template!r} is not a template of {', '.join(f'{{{f}}}' for f in fields)}: {exc}"
            ) from None
    if not isinstance(image, str):
        raise TaskConfigError("'image' must be a string: an image name under the runtime's --image-dir")
    try:
        SandboxSpec(image=image)
    except ValueError as exc:
        raise TaskConfigError(f"'image' {image!r} is not an image name the runtime takes: {exc}") from None
    return image


def patch_paths(patch: str) -> list[str]:
    """Every path a unified diff (as git writes it) touches, the old and the new name of each file, in order;
    TaskConfigError for text that is no such diff or names a path outside the repository."""
    paths: list[str] = []
    headers = list(_DIFF_HEADER.finditer(patch))
    if not headers:
        raise TaskConfigError("'test_patch' is not a unified diff as git writes it (no 'diff --git' line)")
    for header in headers:
        for side, prefix in (("old", "a/"), ("new", "b/")):
            path = _unquoted(header[side])
            if not path.startswith(prefix):
                raise TaskConfigError(f"'test_patch' has a file header without {prefix!r}: {header[0]!r}")
            path = path[len(prefix) :]
            parts = path.split("/")
            if any(part in ("", ".", "..") for part in parts) or any(part.lower() == ".git" for part in parts):
                raise TaskConfigError(f"'test_patch' touches {path!r}, which is no path inside the repository")
            if path not in paths:
                paths.append(path)
    return paths


def _unquoted(name: str) -> str:
    """A path as git quotes one with unusual characters: "a/t\\303\\251st.py" (C escapes of UTF-8 bytes)."""
    if not name.startswith('"'):
        return name
    try:
        return codecs.escape_decode(name[1:-1].encode())[0].decode()
    except (ValueError, UnicodeDecodeError):
        raise TaskConfigError(f"'test_patch' has a file name git did not quote as expected: {name}") from None


# --- swebench: its test commands and log parsers ----------------------------------------------------------------


@dataclass(frozen=True)
class _Swebench:
    specs: Mapping[str, Mapping[str, Mapping[str, Any]]]  # MAP_REPO_VERSION_TO_SPECS
    extensions: Mapping[str, str]  # MAP_REPO_TO_EXT: "py" for the Python repositories
    parsers: Mapping[str, Callable[[str, Any], dict[str, str]]]  # MAP_REPO_TO_PARSER
    pytest_parser: Callable[[str, Any], dict[str, str]]
    test_directives: Callable[[dict[str, Any]], list[str]]
    passed: frozenset[str]  # the statuses SWE-bench counts as passed: PASSED, XFAIL
    failed: frozenset[str]


_SWEBENCH: _Swebench | None = None
_SWEBENCH_LOCK = threading.Lock()


def swebench() -> _Swebench:
    """swebench's tables and functions, imported once (from a worker thread: it takes about a second).

    `swebench/__init__.py` and `swebench/harness/__init__.py` import the whole harness (docker, modal, ghapi,
    datasets): they are skipped, by placing a bare package for each in sys.modules before the modules that are
    used are imported (constants, log parsers, test directives: their own imports bring only requests, dotenv,
    unidiff and datasets). A later `import swebench` elsewhere in the process gets the bare package, whose
    submodules all still import."""
    global _SWEBENCH
    with _SWEBENCH_LOCK:
        if _SWEBENCH is None:
            _SWEBENCH = _import_swebench()
        return _SWEBENCH


def _import_swebench() -> _Swebench:
    found = importlib.util.find_spec("swebench") if "swebench" not in sys.modules else sys.modules["swebench"].__spec__
    if found is None or not found.submodule_search_locations:
        raise TaskConfigError(
            "SWE-bench rows are graded with the swebench package, which is not installed where this rollout "
            "service runs: pip install 'prorl-adapter[swebench]'"
        )
    root = next(iter(found.submodule_search_locations))
    for name, path in (("swebench", root), ("swebench.harness", os.path.join(root, "harness"))):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [path]
            package.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            package.__spec__.submodule_search_locations = [path]
            sys.modules[name] = package
    from swebench.harness.constants import MAP_REPO_TO_EXT, MAP_REPO_VERSION_TO_SPECS, TestStatus
    from swebench.harness.log_parsers import MAP_REPO_TO_PARSER
    from swebench.harness.log_parsers.python import parse_log_pytest
    from swebench.harness.test_spec.python import get_test_directives

    return _Swebench(
        specs=MAP_REPO_VERSION_TO_SPECS,
        extensions=MAP_REPO_TO_EXT,
        parsers=MAP_REPO_TO_PARSER,
        pytest_parser=parse_log_pytest,
        test_directives=get_test_directives,
        passed=frozenset({TestStatus.PASSED.value, TestStatus.XFAIL.value}),
        failed=frozenset({TestStatus.FAILED.value, TestStatus.ERROR.value}),
    )


def _specs(row: BenchRow) -> Mapping[str, Any] | None:
    """swebench's specs for the row's repository and version, None where it has none."""
    return swebench().specs.get(row.repo, {}).get(row.version or "")


def graded_command(row: BenchRow) -> str:
    """The command the graded run ends with: the row's `test_command` as it is; else a test command with the test
    patch's test files appended as SWE-bench's eval script appends them (the row's `test_cmd`, else swebench's for
    the repository and version); for a repository whose swebench test command is a list (not Python), those
    commands in turn; else FALLBACK_TEST_CMD."""
    if row.test_command:
        return row.test_command
    specs = _specs(row)
    command = row.test_cmd or (specs or {}).get("test_cmd") or FALLBACK_TEST_CMD
    if isinstance(command, list):
        return "\n".join(command)
    if row.test_cmd is None and specs is not None and swebench().extensions.get(row.repo, "py") != "py":
        return command
    directives = swebench().test_directives({"repo": row.repo, "test_patch": row.test_patch})
    return " ".join([command, *map(shlex.quote, directives)])


def shown_command(row: BenchRow) -> str:
    """The test command as the prompt gives it: without the test patch's files, which the agent never sees."""
    if row.test_command:
        return row.test_command
    command = row.test_cmd or (_specs(row) or {}).get("test_cmd") or FALLBACK_TEST_CMD
    return command if isinstance(command, str) else " && ".join(command)


def graded_env(row: BenchRow) -> dict[str, str]:
    """The graded run's environment: the row's, with a home of its own in the freshly wiped /tmp, so that no
    dotfile the agent left in the repository (the sandbox's HOME) configures conda, git or Python there."""
    home = f"/tmp/graded-home-{uuid.uuid4().hex}"
    return {
        **row.env,
        "HOME": home,
        "XDG_CONFIG_HOME": f"{home}/.config",
        "XDG_CACHE_HOME": f"{home}/.cache",
        "XDG_DATA_HOME": f"{home}/.local/share",
        "PYTHONNOUSERSITE": "1",
    }


def graded_script(row: BenchRow) -> str:
    """The graded run's bash script: the conda environment where the image has one, swebench's `eval_commands`
    for the repository (environment variables; what fails on the read-only root is skipped), the tests."""
    eval_commands = (_specs(row) or {}).get("eval_commands", []) if not row.test_command else []
    repo = shlex.quote(row.repo_path)
    return "\n".join(['mkdir -p "$HOME"', CONDA_ACTIVATE, *eval_commands, f"cd {repo}", graded_command(row)]) + "\n"


# The summary unittest's runner (Django's too) prints for each test that did not pass, whatever its own output did
# to the `name (module.Class) ... FAIL` line before it.
_UNITTEST_SUMMARY = re.compile(r"^(?:FAIL|ERROR): (\S+ \([\w.]+\))\s*$", re.MULTILINE)


def parsed_log(row: BenchRow, log: str) -> dict[str, str]:
    """Test name -> status, as swebench's parser for the repository (its pytest parser for one it does not know)
    reads `log`; nothing for a log the parser chokes on (what the code under test printed)."""
    package = swebench()
    parse = package.parsers.get(row.repo, package.pytest_parser)
    spec = types.SimpleNamespace(
        instance_id=row.instance_id,
        repo=row.repo,
        version=row.version,
        FAIL_TO_PASS=row.fail_to_pass,
        PASS_TO_PASS=row.pass_to_pass,
    )
    try:
        return parse(_ANSI_COLOUR.sub("", log), spec)
    except Exception:
        return {}


def grade_log(row: BenchRow, log: str) -> tuple[bool, list[str]]:
    """Whether every FAIL_TO_PASS and PASS_TO_PASS test passed in the log, by swebench's parser for the
    repository (its pytest parser for one it does not know), and 'name: STATUS' for each that did not.

    A test passes when the parser reads the log as PASSED or XFAIL, and no line of the log, read on its own,
    reports it FAILED or ERROR (a unittest runner's summary line `FAIL: name (module.Class)` among them, which
    swebench's django parser keys by the bare name); a test the log never mentions is 'missing' and fails."""
    package = swebench()
    log = _ANSI_COLOUR.sub("", log)
    statuses = parsed_log(row, log)
    failed_somewhere = {
        name for line in log.splitlines() for name, status in parsed_log(row, line).items() if status in package.failed
    } | {match[1] for match in _UNITTEST_SUMMARY.finditer(log)}
    failures = []
    must_pass = set(row.fail_to_pass)
    for name in dict.fromkeys([*row.fail_to_pass, *row.pass_to_pass]):
        status = statuses.get(name, "missing")
        # A FAIL_TO_PASS test must pass outright: one line, pytest.xfail() in the code under test, would turn
        # every test that reaches it into XFAIL, which SWE-bench counts as passed.
        accepted = {"PASSED"} if name in must_pass else package.passed
        if status not in accepted or name in failed_somewhere:
            failures.append(f"{name}: {status if name not in failed_somewhere else 'FAILED'}")
    return not failures, failures


# --- The sandbox, init ------------------------------------------------------------------------------------------


def sandbox_spec(row: Mapping[str, Any], image_template: str | None) -> dict[str, Any]:
    """The sandbox of a SWE-bench row: its image, the workspace at the repository's path, seeded with the image's
    repository, the conda environment first on PATH. A row too broken to name an image gets a plain sandbox,
    where init then fails with what is wrong with it."""
    try:
        checked = bench_row(row, image_template)
    except TaskConfigError:
        return {}
    return {
        "image": checked.image,
        "workdir": checked.repo_path,
        "seed_workdir": True,
        "env": checked.env,
        "limits": checked.limits,
    }


async def init(env: SandboxHandle, row: BenchRow) -> None:
    """The image's repository, seeded into the sandbox's workspace, at base_commit, and the test patch checked
    to apply there (then removed: the agent never sees it). TaskConfigError for an image or row that cannot
    serve."""
    await asyncio.to_thread(swebench)  # fails early where swebench is missing; imported once per process
    await fresh_checkout(env, row)
    patch = f"/tmp/test-patch-{uuid.uuid4().hex}.diff"
    await env.write_file(patch, row.test_patch)
    check = await env.run(
        script=f"git apply --check {shlex.quote(patch)} 2>&1; status=$?; rm -f {shlex.quote(patch)}; exit $status",
        cwd=row.repo_path,
        timeout=120,
    )
    if check.status != "completed" or check.exit_code != 0:
        raise TaskConfigError(f"'test_patch' does not apply at base_commit {row.base_commit}: {check.output[-800:]}")


async def fresh_checkout(env: SandboxHandle, row: BenchRow) -> None:
    """The repository the runtime seeded from the image (at creation, or at a wipe: only what the image holds,
    so git runs here without the agent's config or hooks; the image's own hooks are switched off too), checked
    out at base_commit unless its HEAD is there already (SWE-bench's images: their tree's uncommitted changes,
    swebench's `pre_install` edits, are part of the environment and stay)."""
    repo, base = shlex.quote(row.repo_path), shlex.quote(row.base_commit)
    git = "git -c safe.directory='*' -c core.hooksPath=/dev/null -c advice.detachedHead=false"
    script = f"""
cd {repo} || exit 3
if [ ! -d .git ]; then echo "{row.repo_path} in image {row.image} is not a git repository"; exit 3; fi
head=$({git} rev-parse -q --verify HEAD 2>/dev/null)
case "$head" in {base}*) exit 0 ;; esac
{git} checkout -q -f {base} 2>&1 || {{ echo "base_commit {base} is not in {repo}"; exit 5; }}
"""
    result = await env.run(script=script, timeout=CHECKOUT_TIMEOUT_S, max_output_bytes=64 << 10)
    if result.status != "completed" or result.exit_code != 0:
        raise TaskConfigError(
            f"could not check out the repository of image {row.image!r}: {result.status}, {result.output[-800:]}"
        )


# --- The prompts --------------------------------------------------------------------------------------------------


def system_prompt(row: BenchRow, tools: str = "the bash tool") -> str:
    return (
        f"You resolve an issue in the git repository in {row.repo_path}, using {tools} (one call per turn). "
        "Make your changes there: the environment runs the code from there. "
        "Change the code, not the tests: the tests are replaced by the graders' own. Call finish when the issue "
        "is resolved."
    )


def user_prompt(row: BenchRow) -> str:
    return (
        f"{row.problem_statement}\n\nThe repository ({row.repo}, at commit {row.base_commit[:12]}) is in "
        f"{row.repo_path}. Run the tests with: cd {row.repo_path} && {shown_command(row)}"
    )


# --- eval ---------------------------------------------------------------------------------------------------------


async def evaluate(env: SandboxHandle, row: BenchRow, state: EpisodeState) -> dict[str, float]:
    # 1. The agent's tree, read by the runtime; its git objects and index are nothing to grade and may be large.
    repo = row.repo_path
    agent_tree: bytes | None = None
    await env.run(argv=["rm", "-rf", "--", *(f"{repo}/.git/{name}" for name in ("objects", "lfs", "modules"))])
    try:
        agent_tree = await env.download_archive(repo)
    except SandboxAPIError as exc:  # no readable repository (too large): no patch
        if exc.status >= 500:
            raise
    # 2. The wipe seeds the repository afresh from the image; its tree as the original (its .git set aside in /tmp
    # while it is read: the workspace is the repository, and /tmp the one other place the sandbox may write).
    await env.wipe()
    await fresh_checkout(env, row)
    aside = f"/tmp/.git-{uuid.uuid4().hex}"
    await _checked_run(env, ["mv", "--", f"{repo}/.git", aside], timeout=MOVE_TIMEOUT_S)
    original_archive = await env.download_archive(repo)
    await _checked_run(env, ["mv", "--", aside, f"{repo}/.git"], timeout=MOVE_TIMEOUT_S)
    if agent_tree is None:
        return {"outcome": 0.0}
    try:  # off the event loop: reading, diffing and packing a big tree is seconds of CPU
        graded = await asyncio.to_thread(graded_changes, row, original_archive, agent_tree)
    except ValueError:  # an unreadable or oversized tree: no patch
        return {"outcome": 0.0}
    state.artifacts["git_patch"] = graded.patch
    if graded.truncated:  # the files the patch shows only as changed, for size: what it cannot show is named
        state.artifacts["patch_truncated"] = "\n".join(graded.truncated)
    # 3. The test patch on the fresh copy, then the agent's changes outside the test machinery, then the canaries.
    patch = f"/tmp/test-patch-{uuid.uuid4().hex}.diff"
    await env.write_file(patch, row.test_patch)
    applied = await env.run(script=f"git apply {shlex.quote(patch)} 2>&1", cwd=repo, timeout=120)
    if applied.status != "completed" or applied.exit_code != 0:
        raise TaskConfigError(f"'test_patch' no longer applies to a fresh checkout: {applied.output[-800:]}")
    kept = graded.kept
    if kept.deleted:
        listing = f"/tmp/deleted-{uuid.uuid4().hex}"
        await env.write_file(listing, b"".join(path.encode() + b"\0" for path in sorted(kept.deleted)))
        await _checked_run(env, ["xargs", "-0", "-r", "-a", listing, "rm", "-f", "--"], cwd=repo)
    if kept.written or kept.symlinks:
        try:  # the runtime refuses a patch whose links lead out of the repository: such a patch scores nothing
            await env.upload_archive(repo, graded_tree({}, {}, kept))
        except SandboxAPIError as exc:
            if exc.status >= 500:
                raise
            return {"outcome": 0.0}
    planted = await plant_canaries(env, row)
    # 4. The tests, and the log read by swebench's parser.
    result = await env.run(
        script=graded_script(row),
        cwd=repo,
        env=graded_env(row),
        timeout=TEST_TIMEOUT_S,
        max_output_bytes=TEST_LOG_BYTES,
    )
    if result.status != "completed":
        return {"outcome": 0.0}
    if tampered := tampering(await asyncio.to_thread(parsed_log, row, result.output), planted):
        state.artifacts[TAMPERED] = tampered
        return {"outcome": 0.0}
    passed, failures = await asyncio.to_thread(grade_log, row, result.output)
    state.artifacts["test_failures"] = "\n".join(failures)
    return {"outcome": 1.0 if passed else 0.0}


@dataclass(frozen=True)
class GradedChanges:
    patch: str  # all the agent's changes, for people and trainers (`git_patch`)
    kept: AgentChanges  # those that `outside` keeps: what is applied
    truncated: tuple[str, ...] = ()  # the text files `patch` leaves out for size


def graded_changes(row: BenchRow, original_archive: bytes, agent_tree: bytes) -> GradedChanges:
    """The agent's changes relative to the fresh checkout (a tar.gz of it without its .git), in pure Python:
    ValueError for a tree that cannot be read or is over TREE_BYTES."""
    try:
        original, original_links = repository_tree(original_archive, TREE_BYTES)
    except ValueError as exc:  # the image's own tree: not the agent's doing
        raise RuntimeError(f"the fresh checkout cannot be read: {exc}") from exc
    contents = {path: content for path, (content, _) in original.items()}
    changes = _unchanged_dropped(agent_changes(agent_tree, contents, TREE_BYTES), original, original_links)
    kept = outside(changes, row.test_paths, original.keys() | original_links.keys(), graded_command(row))
    patch, truncated = bounded_patch(changes, contents)
    return GradedChanges(patch, kept, tuple(truncated))


async def plant_canaries(env: SandboxHandle, row: BenchRow) -> Planted:
    """The grader's canary tests (swe_canary) added to the test patch's Python files that hold a named test, as
    they are in the sandbox now, with the test patch applied."""
    test_files = {}
    for path in sorted(row.test_paths):
        if path.endswith(".py"):
            try:
                test_files[path] = await env.read_file(f"{row.repo_path}/{path}")
            except SandboxAPIError as exc:  # a test file the patch deletes
                if exc.status >= 500:
                    raise
    planted = plant(test_files, [*row.fail_to_pass, *row.pass_to_pass], passing=row.pass_to_pass)
    for path, content in planted.files.items():
        await env.write_file(f"{row.repo_path}/{path}", content)
    return planted


async def _checked_run(env: SandboxHandle, argv: list[str], cwd: str | None = None, timeout: float = 300) -> None:
    """A step of eval's own on the fresh copy, which must succeed (a failure is the runtime's or the image's)."""
    result = await env.run(argv=argv, cwd=cwd, timeout=timeout)
    if result.status != "completed" or result.exit_code != 0:
        raise RuntimeError(f"eval step {argv[:2]} failed: {result.status}, {result.output[-500:]}")


def _unchanged_dropped(
    changes: AgentChanges, original: Mapping[str, tuple[bytes, int]], links: Mapping[str, str]
) -> AgentChanges:
    """`changes` without what equals the original: agent_changes takes every original file as non-executable and
    knows no original symlinks, while a real repository has both."""
    return AgentChanges(
        written={path: entry for path, entry in changes.written.items() if original.get(path) != entry},
        symlinks={path: target for path, target in changes.symlinks.items() if links.get(path) != target},
        deleted=changes.deleted,
    )
