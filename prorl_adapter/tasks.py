"""What a task handler is: it owns a task's sandbox set-up (init), the tools its agent gets, and the scoring
(eval). Handlers are provided by plugins (`prorl_register_tasks`); the built-in ones live in `prorl_plugins/tasks`.
"""

from __future__ import annotations

import shlex
import uuid
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

from sandbox_runtime.client import SandboxClient
from sandbox_runtime.models import ExecResult, RunResult
from server_kit.errors import ProrlError

from .models import ActionFormatName


@runtime_checkable
class SandboxHandle(Protocol):
    """An episode's sandbox, as task handlers and tools see it: what a task's init, tools and eval may do.

    `Environment` is the service's: the sandbox runtime's API over HTTP. `prorl_adapter.testing.ScriptedSandbox`
    answers in-process from a script of the test's own, so that a task's logic is tested without any server.
    A failed call raises `sandbox_runtime.client.SandboxAPIError` (404 for a file that is not there).
    """

    workdir: str  # the agent's working directory (the workspace)

    def for_task(self) -> SandboxHandle:
        """The same sandbox, with commands in a shell session of the handler's own (set-up never moves the
        agent's shell)."""
        ...

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None) -> ExecResult:
        """A command in the session's persistent shell (the agent's tools)."""
        ...

    async def run(
        self,
        *,
        argv: list[str] | None = None,
        script: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        max_output_bytes: int | None = None,
    ) -> RunResult:
        """A one-shot run (give `argv` or a bash `script`), its exit status from the kernel: what eval uses."""
        ...

    async def end_processes(self) -> list[str]: ...

    async def wipe(self) -> None: ...

    async def download_archive(self, path: str) -> bytes: ...

    async def upload_archive(self, path: str, archive: bytes) -> int: ...

    async def write_file(self, path: str, data: str | bytes) -> None: ...

    async def read_file(self, path: str) -> bytes: ...


@dataclass(frozen=True)
class Environment:
    """An episode's sandbox on a sandbox runtime (a `SandboxHandle` over the runtime's HTTP API).

    The agent's tools run in the shell session "default"; a handler's init gets `for_task()`, whose commands
    run in a session of their own, so a `cd` in set-up never moves the agent's shell.

    Eval must not trust anything the agent could have planted. Before eval the pipeline ends every process the
    agent started (`end_processes`), and eval runs its checks with `run`: a fresh process whose exit status the
    runtime takes from the kernel, never from terminal output that the agent's code could imitate.
    """

    client: SandboxClient
    sandbox_id: str
    server_url: str
    workdir: str
    session: str = "default"

    def for_task(self) -> Environment:
        return replace(self, session="task")

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None) -> ExecResult:
        return await self.client.exec(
            self.sandbox_id, command, timeout=timeout, session=self.session, max_output_bytes=max_output_bytes
        )

    async def run(
        self,
        *,
        argv: list[str] | None = None,
        script: str | None = None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60.0,
        max_output_bytes: int | None = None,
    ) -> RunResult:
        """A one-shot run in the sandbox (give `argv` or a bash `script`): what eval should use."""
        return await self.client.run(
            self.sandbox_id,
            argv=argv,
            script=script,
            cwd=cwd,
            env=env,
            timeout=timeout,
            max_output_bytes=max_output_bytes,
        )

    async def end_processes(self) -> list[str]:
        """End every process in the sandbox, daemons included; the files stay."""
        return await self.client.end_processes(self.sandbox_id)

    async def wipe(self) -> None:
        """End every process and empty the workspace and /tmp, as in a freshly created sandbox."""
        await self.client.wipe(self.sandbox_id)

    async def download_archive(self, path: str) -> bytes:
        """A tar.gz of `path` read by the runtime itself: links stored as links, never followed."""
        return await self.client.download_archive(self.sandbox_id, path)

    async def upload_archive(self, path: str, archive: bytes) -> int:
        return await self.client.upload_archive(self.sandbox_id, path, archive)

    async def write_file(self, path: str, data: str | bytes) -> None:
        await self.client.write_file(self.sandbox_id, path, data)

    async def read_file(self, path: str) -> bytes:
        return await self.client.read_file(self.sandbox_id, path)


@dataclass
class EpisodeState:
    """What the agent loop learned that a handler's eval may need."""

    answer: str | None = None
    commands: list[str] = field(default_factory=list)
    turns: int = 0
    malformed_calls: int = 0
    response_tokens: int = 0
    # What eval produced besides the reward, for the trainer and for people (swe: "git_patch"); it reaches the
    # trajectory's `artifacts`.
    artifacts: dict[str, str] = field(default_factory=dict)
    # What str_replace_editor's undo_edit restores, by path: the content before each edit, oldest first (None: the
    # edit created the file); bounded by prorl_adapter/editor_tools.py.
    file_history: dict[str, list[bytes | None]] = field(default_factory=dict)
    # Set by a tool when the task's own time for the agent is up (harbor's [agent].timeout_sec): the loop ends the
    # episode there (finish reason agent_timeout) and it goes on to eval.
    time_up: bool = False
    time_limit_s: float | None = None  # that time, for the trajectory's record of what cut it (BudgetCut)


ToolFn = Callable[[SandboxHandle, dict[str, Any], EpisodeState], Awaitable[str]]


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: ToolFn | None  # None for `finish`, which ends the episode instead of running

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def _object(**properties: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {name: {"type": "string", "description": text} for name, text in properties.items()},
        "required": list(properties),
    }


# The artifact that counts an episode's tool commands stopped by a sandbox limit (`note_limits`), as text ("2").
SANDBOX_LIMITS_ARTIFACT = "sandbox_limits"
# 128 + the signal a limit sends: SIGKILL (the memory limit's kill: a cgroup's OOM killer or the runtime's
# watchdog), SIGXCPU (limits.cpu_seconds), SIGXFSZ (limits.file_size_mb).
LIMIT_EXIT_CODES = frozenset({128 + 9, 128 + 24, 128 + 25})


def note_limits(result: ExecResult, state: EpisodeState) -> None:
    """Count a command that a sandbox limit stopped: a signal that a limit sends (LIMIT_EXIT_CODES; an agent's own
    `kill -9` reads the same). Not counted: a tool call's own time limit (an honest test suite meets it), what a
    limit refuses without a signal (a fork past the pids limit, a write past the disk limit: the command's own
    error), and a command whose exit status hides its child's (`cmd; true`, `cmd | tail`)."""
    if result.status != "timeout" and result.exit_code in LIMIT_EXIT_CODES:
        count = int(state.artifacts.get(SANDBOX_LIMITS_ARTIFACT, "0")) + 1
        state.artifacts[SANDBOX_LIMITS_ARTIFACT] = str(count)


def format_result(result: ExecResult) -> str:
    if result.status == "timeout":
        return f"{result.output}\n[the command timed out and was stopped]"
    if result.status == "dead":
        return f"{result.output}\n[the shell exited with status {result.exit_code}; a new shell was started]"
    return f"{result.output}[exit code {result.exit_code}]"


def bash_tool(timeout: float) -> Tool:
    async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        command = str(args.get("command", ""))
        if not command.strip():
            return 'error: the bash tool needs a non-empty "command"'
        state.commands.append(command)
        result = await env.exec(command, timeout=timeout)
        note_limits(result, state)
        return format_result(result)

    return Tool(
        "bash", "Run a bash command in the sandbox; state persists between calls.", _object(command="bash"), run
    )


def python_tool(timeout: float) -> Tool:
    async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        code = str(args.get("code", ""))
        path = f"/tmp/snippet_{uuid.uuid4().hex[:8]}.py"
        await env.write_file(path, code)
        state.commands.append(f"python3 {path}")
        result = await env.exec(f"python3 {shlex.quote(path)}", timeout=timeout)
        note_limits(result, state)
        return format_result(result)

    return Tool("python", "Run a Python 3 program; its stdout is returned.", _object(code="Python source"), run)


FINISH = Tool("finish", "End the episode with your final answer.", _object(answer="the final answer"), None)


class TaskHandler(ABC):
    """A task: set-up, tools and scoring. Subclass, name it, and register it from a plugin."""

    name: ClassVar[str]
    tool_timeout_s: ClassVar[float] = 30.0
    # ProRL Agent's dataset names (`instance.data_source` of its POST /process) that this task serves; their rows
    # become this task's instances through `from_prorl_instance` (docs/compat.md).
    prorl_data_sources: ClassVar[tuple[str, ...]] = ()
    # Whether an agent program of the user's own (JobRequest.agent) can run this task's episodes: False for a task
    # whose eval reads what only the built-in loop records (the `finish` tool's answer), which would score 0.
    supports_agent_programs: ClassVar[bool] = True
    # How the built-in loop reads the policy's actions unless the job says (JobRequest.action_format): "hermes"
    # tool calls, or "fenced" code blocks for a model that writes actions as text (prorl_adapter/service/actions.py).
    action_format: ClassVar[ActionFormatName] = "hermes"

    def from_prorl_instance(self, data_source: str, row: dict[str, Any]) -> dict[str, Any]:
        """This task's instance from a row of ProRL dataset `data_source`; raise TaskConfigError naming what the
        row lacks where this task cannot serve it."""
        return row

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [bash_tool(self.tool_timeout_s), FINISH]

    def sandbox_spec(self, instance: dict[str, Any]) -> dict[str, Any]:
        """Extra fields of the sandbox's spec (limits, image, env); the default asks for nothing special."""
        return {"limits": {"memory_mb": 2048, "pids": 256}}

    def instance_id(self, instance: dict[str, Any]) -> str | None:
        value = instance.get("instance_id", instance.get("id"))
        return None if value is None else str(value)

    @abstractmethod
    def system_prompt(self, instance: dict[str, Any]) -> str: ...

    @abstractmethod
    def user_prompt(self, instance: dict[str, Any]) -> str: ...

    async def init(self, env: SandboxHandle, instance: dict[str, Any]) -> None:
        """Prepare the sandbox for the episode (files, repositories). Runs in the init stage."""
        return None

    @abstractmethod
    async def evaluate(self, env: SandboxHandle, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        """Score the episode: reward components as signed contributions to the reward, at least "outcome"
        (the task's own reward). With no reward plugin, the reward is their sum.

        By the time it is called every process the agent started is gone. Check with `env.run` (exit status
        from the kernel) or the file API, never with `env.exec`'s terminal output, and never run a program
        the agent could have configured (its git config and hooks, its shell files)."""


class TaskConfigError(ProrlError, ValueError):
    """A task instance lacks what its handler needs; the job fails in init with this message."""
