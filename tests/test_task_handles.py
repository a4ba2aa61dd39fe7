"""Tasks talk to their sandbox through `SandboxHandle`: the runtime's `Environment` is one, and the in-process
`ScriptedSandbox` is another, with which a task's own logic is tested without any server (nothing runs: the
test answers each command)."""

from __future__ import annotations

import pytest

from prorl_adapter.tasks import Environment, EpisodeState, SandboxHandle, TaskConfigError
from prorl_adapter.testing import ScriptedSandbox
from prorl_plugins.tasks.shell import ShellTask
from sandbox_runtime.client import SandboxAPIError, SandboxClient

INSTANCE = {"goal": "Create /workspace/done", "check": "test -f /workspace/done", "setup": "mkdir -p src"}


async def test_the_runtime_environment_and_the_scripted_sandbox_are_both_handles():
    async with SandboxClient("http://127.0.0.1:1") as client:  # never called
        runtime = Environment(client, "box", "http://127.0.0.1:1", "/workspace")
        for handle in (runtime, runtime.for_task(), ScriptedSandbox(), ScriptedSandbox().for_task()):
            assert isinstance(handle, SandboxHandle), type(handle).__name__
    assert not isinstance(object(), SandboxHandle)


async def test_the_shell_task_sets_up_in_its_own_session_and_grades_by_a_one_shot_run():
    def answer(call, sandbox):
        if call.kind == "run":  # the check: solved when the agent made the file
            return "", 0 if "/workspace/done" in sandbox.files else 1
        return None

    task, sandbox = ShellTask(), ScriptedSandbox(answer)
    await task.init(sandbox.for_task(), INSTANCE)
    [setup] = sandbox.calls
    assert (setup.kind, setup.session, setup.command) == ("exec", "task", "mkdir -p src")  # never the agent's shell

    assert await task.evaluate(sandbox.for_task(), INSTANCE, EpisodeState()) == {"outcome": 0.0}
    await sandbox.write_file("done", "")  # what the agent's command would have made
    assert await task.evaluate(sandbox.for_task(), INSTANCE, EpisodeState()) == {"outcome": 1.0}
    check = sandbox.calls[-1]
    assert check.kind == "run" and check.command.endswith(INSTANCE["check"]) and check.env["HOME"]


async def test_a_failed_setup_and_a_missing_field_are_init_errors():
    failing = ScriptedSandbox(lambda call, sandbox: ("mkdir: cannot create directory\n", 1))
    with pytest.raises(TaskConfigError, match="setup failed with exit code 1: mkdir: cannot"):
        await ShellTask().init(failing.for_task(), INSTANCE)
    with pytest.raises(TaskConfigError, match="'check'"):
        await ShellTask().init(ScriptedSandbox(), {"goal": "g"})


async def test_the_scripted_sandbox_keeps_files_as_the_runtime_does():
    sandbox = ScriptedSandbox()
    await sandbox.write_file("notes/a.txt", "one")
    await sandbox.write_file("/tmp/scratch", b"two")
    await sandbox.write_file("/etc/motd", b"three")
    assert await sandbox.read_file("/workspace/notes/a.txt") == b"one"
    with pytest.raises(SandboxAPIError) as missing:
        await sandbox.read_file("nowhere")
    assert missing.value.status == 404

    copy = ScriptedSandbox()
    assert await copy.upload_archive("/workspace", await sandbox.download_archive("/workspace")) == 1
    assert copy.files == {"/workspace/notes/a.txt": b"one"}

    await sandbox.wipe()  # the workspace and /tmp emptied; the rest of the image stays
    assert sandbox.files == {"/etc/motd": b"three"}
    assert await sandbox.end_processes() == [] and sandbox.processes_ended == 1
    with pytest.raises(SandboxAPIError, match="argv or script"):
        await sandbox.run()
