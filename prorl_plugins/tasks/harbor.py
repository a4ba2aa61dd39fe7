"""`harbor`: a task in Harbor's format (Terminal-Bench 2.0, SkyRL, rLLM, TRL), run as Harbor runs it, with this
service's sandboxes and integrity rules. The format is read by harbor_format.py; docs/harbor.md is the user's page.

Instance: {"path": "/data/tb2/hello-world"} (a task directory on the rollout service's host), or
          {"dataset": "/data/tb2", "task": "hello-world"} (a task of a dataset directory);
          optional: "image" (an image name under the runtime's --image-dir), "image_template", "tools" (names of
          editor_tools.TOOLS; default: bash and finish), "instance_id" (default: the task directory's name).
Task directories must lie below one of the directories the service allows: `HarborTask(datasets=...)`, else the
rollout service's environment variable PRORL_HARBOR_DATASETS (paths separated by ':'); none allowed until one is.

The sandbox: the task's image, built by the user from environment/ and saved under the runtime's --image-dir as any
format it reads (a root directory, an OCI layout, a docker archive, a SIF). Its name is the instance's `image`, else
an image template (the instance's `image_template`, else `HarborTask(image_template=...)`, else the service's
PRORL_HARBOR_IMAGE_TEMPLATE, else DEFAULT_IMAGE_TEMPLATE) formatted with {name} (the task directory's name), {task}
([task].name, "org/name", else the directory's name) and {dataset}. The agent works where Harbor's container has it
work: [environment].workdir, else the Dockerfile's last WORKDIR (the workspace is seeded from the image's copy of it),
else /app. Limits: [environment].memory_mb and storage_mb (the runtime's memory_mb and disk_mb; above the runtime's
maximum the sandbox is refused with its message); cpus is not a limit the runtime has.

The agent's time: [agent].timeout_sec from the end of init. Past it a tool call answers that the time is up
(and runs nothing) and the agent loop ends the episode (EpisodeState.time_up), as Harbor stops its agent, and the
episode goes on to eval; a command in flight is stopped at the deadline (its timeout is what is left). An agent
program of the user's own (JobRequest.agent) runs its own tools: the job's timeout_s bounds it.

eval, as Harbor's verifier runs, on this service's integrity rules:
1. the pipeline has ended every process the agent started (end_processes);
2. tests/ is written into the sandbox only now, from the service's host, into a directory of /tmp whose name the
   agent could not guess (a sandbox here may write only its workspace and /tmp, so Harbor's fixed /tests, /logs and
   /solution are read-only or missing there: their names in the task's text files are moved below that directory,
   `harbor_format.relocated`); the agent never saw tests/ or solution/, and nothing it left at /tests or
   /logs/verifier is read;
3. tests/test.sh runs as a one-shot process in the workdir, under [verifier].timeout_sec, with [verifier].env and
   clean_check's environment (a fresh HOME in /tmp, no user site, no global git configuration, PYTHONSAFEPATH: the
   workdir is not on Python's path), the agent's git hooks and fsmonitor off, pytest's configuration and conftest
   files left in /tmp removed and an empty pytest.ini beside the tests (pytest searches no further up);
4. the reward is read through the file API: reward.json (named numbers), else reward.txt (a number), as Harbor
   reads them (harbor_format.parse_reward). A verifier that writes neither, runs past its timeout, or writes a
   file that is not a number scores 0 (artifact `verifier_error`).
Not defended, as in Harbor: code under test that finds the reward file and writes it. [verifier].user and
[agent].user are not honoured: every process of a sandbox runs as its one unprivileged user.

solution/solve.sh is the oracle: `prorl-harbor check` (harbor_check.py) runs it, and the untouched sandbox, through
`run_solution` and `run_verifier` below, and expects 1 and 0.
"""

from __future__ import annotations

import asyncio
import io
import os
import shlex
import tarfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prorl_adapter.editor_tools import swe_tools
from prorl_adapter.tasks import EpisodeState, SandboxHandle, TaskConfigError, TaskHandler, Tool
from sandbox_runtime.client import SandboxAPIError
from sandbox_runtime.models import RunResult, SandboxSpec

from . import harbor_format
from .clean_check import check_env, check_script
from .harbor_format import REWARD_JSON, REWARD_TEXT, HarborTaskDir

DEFAULT_IMAGE_TEMPLATE = "harbor/{name}"
IMAGE_TEMPLATE_ENV = "PRORL_HARBOR_IMAGE_TEMPLATE"
DATASETS_ENV = "PRORL_HARBOR_DATASETS"
# The tools an instance may name ("tools") are editor_tools.TOOLS (bash, python, str_replace_editor, search,
# finish), each made with the task's tool timeout; these are the default.
DEFAULT_TOOLS = ("bash", "finish")  # editor_tools.EDITOR_TOOLS adds the editor and search
DEFAULT_AGENT_TIMEOUT_S = 600.0  # a task.toml without [agent].timeout_sec
LOG_TAIL_BYTES = 16 << 10  # of the verifier's output, kept as the artifact `verifier_log`
TIME_UP = "[the agent's time ([agent].timeout_sec = {timeout:g} s) is up: nothing ran; the episode ends]"


@dataclass(frozen=True)
class Verdict:
    """What a verifier run gave: the reward components and the artifacts that say why."""

    components: dict[str, float]
    artifacts: dict[str, str]


class HarborTask(TaskHandler):
    name = "harbor"
    tool_timeout_s = 600.0  # a command's at most; the agent's time left bounds it too

    def __init__(
        self, datasets: list[str | Path] | None = None, image_template: str | None = None, clock=time.monotonic
    ) -> None:
        # None: the service's PRORL_HARBOR_DATASETS, PRORL_HARBOR_IMAGE_TEMPLATE (read when a job needs them).
        self.datasets = None if datasets is None else [Path(path).resolve() for path in datasets]
        self.image_template = image_template
        self.clock = clock
        self._deadlines: dict[str, tuple[float, float]] = {}  # sandbox id -> (the agent's deadline, its timeout)

    # --- The instance -------------------------------------------------------------------------------------------

    def _allowed(self) -> list[Path]:
        if self.datasets is not None:
            return self.datasets
        return [Path(part).resolve() for part in os.environ.get(DATASETS_ENV, "").split(os.pathsep) if part]

    def task(self, instance: Mapping[str, Any]) -> HarborTaskDir:
        """The instance's task directory, checked (TaskConfigError naming what is wrong)."""
        if isinstance(instance.get("path"), str):
            path = Path(instance["path"])
        elif isinstance(instance.get("dataset"), str) and isinstance(instance.get("task"), str):
            if "/" in instance["task"] or instance["task"] in ("", ".", ".."):
                raise TaskConfigError(f"'task' {instance['task']!r} must be a directory name in the dataset")
            path = Path(instance["dataset"]) / instance["task"]
        else:
            raise TaskConfigError("a harbor instance needs 'path' (a task directory) or 'dataset' and 'task'")
        allowed = self._allowed()
        if not allowed:
            raise TaskConfigError(
                f"no directory of Harbor tasks is allowed on this service: set {DATASETS_ENV} (docs/harbor.md)"
            )
        resolved = path.resolve() if path.is_absolute() else path
        if not any(resolved == root or resolved.is_relative_to(root) for root in allowed):
            raise TaskConfigError(f"{path} is not below a directory this service allows ({DATASETS_ENV})")
        return harbor_format.load_task(resolved)

    def image(self, instance: Mapping[str, Any], task: HarborTaskDir) -> str:
        image = instance.get("image")
        if image is None:
            template = instance.get("image_template") or self.image_template
            template = template or os.environ.get(IMAGE_TEMPLATE_ENV) or DEFAULT_IMAGE_TEMPLATE
            if not isinstance(template, str):
                raise TaskConfigError("'image_template' must be a string such as 'harbor/{name}'")
            dataset = Path(instance["dataset"]).name if isinstance(instance.get("dataset"), str) else None
            try:
                image = template.format(**harbor_format.template_fields(task, dataset))
            except (KeyError, IndexError, ValueError) as exc:
                fields = "{name}, {task}, {dataset}"
                raise TaskConfigError(f"image template {template!r} takes {fields}: {exc}") from None
        if not isinstance(image, str):
            raise TaskConfigError("'image' must be a string: an image name under the runtime's --image-dir")
        try:
            SandboxSpec(image=image)
        except ValueError as exc:
            raise TaskConfigError(f"image {image!r} is not an image name the runtime takes: {exc}") from None
        try:
            SandboxSpec(image=image, workdir=task.workdir)
        except ValueError as exc:
            workdir = task.workdir
            raise TaskConfigError(f"{task.path}: its workdir {workdir!r} cannot be a sandbox's: {exc}") from None
        return image

    def instance_id(self, instance: dict[str, Any]) -> str | None:
        explicit = super().instance_id(instance)
        if explicit is not None:
            return explicit
        value = instance.get("task") or (Path(instance["path"]).name if isinstance(instance.get("path"), str) else None)
        return None if value is None else str(value)

    # --- The sandbox, the prompt, the tools ---------------------------------------------------------------------

    def sandbox_spec(self, instance: dict[str, Any]) -> dict[str, Any]:
        """The task's image, its workdir (seeded from the image where the image holds it), [environment].env and
        limits. An instance too broken to name an image gets a plain sandbox, where init fails naming what is
        wrong."""
        try:
            return self.checked_spec(instance)
        except TaskConfigError:
            return {}

    def checked_spec(self, instance: Mapping[str, Any]) -> dict[str, Any]:
        task = self.task(instance)
        environment = task.config.environment
        limits: dict[str, Any] = {"memory_mb": environment.memory_mb or 2048, "pids": 1024}
        if environment.storage_mb:
            limits["disk_mb"] = environment.storage_mb
        return {
            "image": self.image(instance, task),
            "workdir": task.workdir,
            "seed_workdir": task.workdir_from_image,
            "env": literal_env(environment.env, task.path / "task.toml", "[environment].env"),
            "limits": limits,
        }

    def system_prompt(self, instance: dict[str, Any]) -> str:
        try:
            workdir = self.task(instance).workdir
        except TaskConfigError:
            workdir = harbor_format.DEFAULT_WORKDIR
        return (
            f"You complete a task in a Linux sandbox with the tools, one call per turn; the working directory is "
            f"{workdir}. Call finish when the task is done."
        )

    def user_prompt(self, instance: dict[str, Any]) -> str:
        try:
            return self.task(instance).instruction
        except TaskConfigError as exc:
            return f"(this task cannot be loaded: {exc})"

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        """The instance's `tools` (names of TOOLS), else DEFAULT_TOOLS, each stopped at the agent's deadline."""
        return [self._timed(tool) for tool in swe_tools(instance.get("tools", DEFAULT_TOOLS), self.tool_timeout_s)]

    def _timed(self, tool: Tool) -> Tool:
        """`tool` stopped at the agent's deadline: past it, it runs nothing; before it, a command's timeout is at
        most what is left (the sandbox's own handle passes it on)."""
        if tool.run is None:
            return tool
        run = tool.run

        async def timed(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
            deadline = self._deadlines.get(str(getattr(env, "sandbox_id", "")))
            if deadline is None:
                return await run(env, args, state)
            left = deadline[0] - self.clock()
            if left <= 0:
                state.time_up = True  # the agent loop ends the episode here: no more turns for nothing
                state.time_limit_s = deadline[1]
                return TIME_UP.format(timeout=deadline[1])
            return await run(_Bounded(env, left), args, state)

        return replace(tool, run=timed)

    # --- init and eval ------------------------------------------------------------------------------------------

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        """The task checked (its image and workdir are the sandbox's already: environment/ is the image's build
        context, nothing of the task directory enters the sandbox before eval), and the agent's clock started."""
        task = await asyncio.to_thread(self.task, instance)
        await asyncio.to_thread(self.checked_spec, instance)
        self.tools(instance)  # a wrong `tools` fails here, naming it, rather than in the run
        timeout = task.config.agent.timeout_sec or DEFAULT_AGENT_TIMEOUT_S
        now = self.clock()
        self._deadlines = {key: value for key, value in self._deadlines.items() if value[0] + 3600 > now}
        self._deadlines[str(getattr(env, "sandbox_id", ""))] = (now + timeout, timeout)

    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        self._deadlines.pop(str(getattr(env, "sandbox_id", "")), None)
        verdict = await run_verifier(env, await asyncio.to_thread(self.task, instance))
        state.artifacts.update(verdict.artifacts)
        return verdict.components


class _Bounded:
    """A sandbox handle whose commands stop by `left` seconds from now, whatever timeout a tool asks."""

    def __init__(self, env: SandboxHandle, left: float) -> None:
        self._env, self._left, self.workdir = env, left, env.workdir

    def __getattr__(self, name: str) -> Any:
        return getattr(self._env, name)

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None):
        return await self._env.exec(command, timeout=min(timeout, self._left), max_output_bytes=max_output_bytes)

    async def run(self, *, timeout: float = 30.0, **fields: Any):  # the editor's one-shot listings and searches
        return await self._env.run(timeout=min(timeout, self._left), **fields)


def literal_env(env: Mapping[str, str], source: Path, section: str) -> dict[str, str]:
    """A task's environment variables, each a literal: Harbor fills `${VAR}` from its host's environment, which
    never reaches a sandbox here (the server's secrets would)."""
    for name, value in env.items():
        if "${" in value:
            raise TaskConfigError(
                f"{source}: {section} {name!r} takes its value from the host's environment ({value!r}), "
                "which never reaches a sandbox here: give it literally"
            )
    return dict(env)


def _tar(files: Mapping[str, tuple[bytes, int]], base: str) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for path, (content, mode) in files.items():
            data = harbor_format.relocated(content, base)
            info = tarfile.TarInfo(path)
            info.size, info.mode, info.mtime = len(data), mode, 0
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


# What the agent's repository may not run when a verifier calls git: its hooks, its file-system monitor.
GIT_SAFE = {
    "GIT_CONFIG_COUNT": "2",
    "GIT_CONFIG_KEY_0": "core.hooksPath",
    "GIT_CONFIG_VALUE_0": "/dev/null",
    "GIT_CONFIG_KEY_1": "core.fsmonitor",
    "GIT_CONFIG_VALUE_1": "false",
}
# What pytest reads from a directory above its tests: the agent's, where it left them in /tmp.
PYTEST_DISCOVERY = (
    "conftest.py",
    "pytest.ini",
    ".pytest.ini",
    "pyproject.toml",
    "tox.ini",
    "setup.cfg",
    "setup.py",
    "__init__.py",
)


def verifier_env(task: HarborTaskDir, env: Mapping[str, str]) -> dict[str, str]:
    """clean_check's environment (a fresh HOME in /tmp, no user site, no global git configuration, and
    PYTHONSAFEPATH: the working directory is never on Python's path, so a `pytest.py` or `json.py` the agent left
    there is not imported in place of the real one; a test that imports the agent's code names its directory, as
    a test run by Harbor's `uvx pytest` must too), git kept from the repository's hooks, and `env`."""
    task_env = literal_env(env, task.path / "task.toml", "[verifier].env or [solution].env")
    return {**check_env(), **GIT_SAFE, **task_env}


async def _place(env: SandboxHandle, task: HarborTaskDir, what: str, base: str) -> str:
    """tests/ or solution/ (`what`) written into `base`/`what`, Harbor's paths in it moved below `base`; the
    script's path in the sandbox."""
    directory = task.path / what
    files = await asyncio.to_thread(harbor_format.task_files, directory)
    await env.upload_archive(f"{base}/{what}", await asyncio.to_thread(_tar, files, base))
    return f"{base}/{what}/{'test.sh' if what == 'tests' else 'solve.sh'}"


async def run_solution(env: SandboxHandle, task: HarborTaskDir) -> RunResult:
    """solution/solve.sh run as Harbor's oracle agent runs it: in the workdir, with [solution].env, under the
    agent's time."""
    base = f"/tmp/harbor-{uuid.uuid4().hex}"
    script = await _place(env, task, "solution", base)
    return await env.run(
        script=check_script(f"mkdir -p {base}/logs/agent && chmod +x {script} && {script}"),
        cwd=task.workdir,
        env=verifier_env(task, task.config.solution.env),
        timeout=task.config.agent.timeout_sec or DEFAULT_AGENT_TIMEOUT_S,
        max_output_bytes=LOG_TAIL_BYTES,
    )


async def run_verifier(env: SandboxHandle, task: HarborTaskDir) -> Verdict:
    """tests/ placed now, test.sh run, the reward read (the module's docstring, eval). Every agent process must
    have ended before (the pipeline's end_processes)."""
    base = f"/tmp/harbor-{uuid.uuid4().hex}"  # unguessable: nothing the agent left can be there
    script = await _place(env, task, "tests", base)
    verifier = f"{base}{harbor_format.VERIFIER_DIR}"
    log = f"{verifier}/test-stdout.txt"
    # pytest looks for its configuration and conftest.py files up from the tests, through /tmp: the agent's
    # there are removed, and an empty pytest.ini at `base` ends the search (its rootdir, its conftest cut-off).
    leftovers = " ".join(f"/tmp/{name}" for name in PYTEST_DISCOVERY)
    result = await env.run(
        script=check_script(
            f"rm -rf {leftovers} && : > {base}/pytest.ini && "
            f"mkdir -p {verifier} {base}/logs/agent {base}/logs/artifacts && chmod +x {script} && "
            f"{{ {script} > {shlex.quote(log)} 2>&1; status=$?; }}; "
            f"tail -c {LOG_TAIL_BYTES} {shlex.quote(log)} > {shlex.quote(log)}.tail; exit $status"
        ),
        cwd=task.workdir,
        env=verifier_env(task, task.config.verifier.env),
        timeout=task.config.verifier.timeout_sec,
    )
    artifacts = {"verifier_log": await _tail(env, f"{log}.tail")}
    if result.status != "completed":
        timeout = task.config.verifier.timeout_sec
        artifacts["verifier_error"] = f"test.sh ran past [verifier].timeout_sec ({timeout:g} s)"
        return Verdict({"outcome": 0.0}, artifacts)
    for name in (REWARD_JSON, REWARD_TEXT):  # Harbor's order: reward.json first
        try:
            data = await _read(env, f"{verifier}/{name}")
        except SandboxAPIError as exc:  # there, but not a file of its size (a directory, a huge file)
            artifacts["verifier_error"] = f"/logs/verifier/{name} cannot be read: {exc}"
            return Verdict({"outcome": 0.0}, artifacts)
        if data is not None:
            artifacts["verifier_rewards"] = data.decode("utf-8", errors="replace")[:4096]
            try:
                return Verdict(harbor_format.parse_reward(name, data), artifacts)
            except TaskConfigError as exc:  # the code under test may write it: a 0, not a failed eval
                artifacts["verifier_error"] = str(exc)
                return Verdict({"outcome": 0.0}, artifacts)
    artifacts["verifier_error"] = (
        f"test.sh (exit status {result.exit_code}) wrote neither /logs/verifier/{REWARD_TEXT} nor {REWARD_JSON}"
    )
    return Verdict({"outcome": 0.0}, artifacts)


async def _read(env: SandboxHandle, path: str) -> bytes | None:
    """A file the verifier wrote, or None where there is none (404); SandboxAPIError where it is there but cannot be
    read as a file (a directory, a link: the file API follows none, a file past its size limit)."""
    try:
        return await env.read_file(path)
    except SandboxAPIError as exc:
        if exc.status == 404:
            return None
        raise


async def _tail(env: SandboxHandle, path: str) -> str:
    try:
        data = await _read(env, path)
    except SandboxAPIError as exc:
        if exc.status >= 500:
            raise
        return ""
    return "" if data is None else data[-LOG_TAIL_BYTES:].decode("utf-8", errors="replace")
