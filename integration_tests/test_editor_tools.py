"""The SWE editing tools (prorl_adapter/editor_tools.py) in a real bwrap sandbox of a root-run runtime: the
editor's commands change the sandbox's real files (read back by a process in the sandbox, not through the file
API the editor used), `search` and directory views run grep and find there, and hostile paths (relative, '..',
links to the host's files and to /, /proc/self/environ, /etc/shadow) neither read nor write anything of the host
nor make a tool raise; an `swe` row fixed through them is graded as fixed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from prorl_adapter.editor_tools import EDITOR_TOOLS, search_tool, str_replace_editor_tool
from prorl_adapter.tasks import Environment, EpisodeState
from prorl_plugins.tasks.swe import SweTask

EDITOR, SEARCH = str_replace_editor_tool(), search_tool()


@pytest.fixture
async def env(bwrap_runtime) -> AsyncIterator[Environment]:
    async with bwrap_runtime.client() as client:
        box = await client.create_sandbox()
        try:
            yield Environment(client, box.id, bwrap_runtime.url, box.workdir)
        finally:
            await client.delete_sandbox(box.id)


async def edit(env: Environment, state: EpisodeState, **args) -> str:
    return await EDITOR.run(env, args, state)


async def in_sandbox(env: Environment, path: str) -> str:
    """The file as a process in the sandbox reads it."""
    result = await env.run(argv=["cat", "--", path])
    assert result.exit_code == 0, result.output
    return result.output


async def test_the_editors_commands_change_the_sandboxs_real_files(env):
    state, path = EpisodeState(), f"{env.workdir}/pkg/calc.py"
    created = await edit(env, state, command="create", path=path, file_text="def add(a, b):\n    return a - b\n")
    assert created.startswith("Created") and await in_sandbox(env, path) == "def add(a, b):\n    return a - b\n"
    assert "already exists" in await edit(env, state, command="create", path=path, file_text="x")

    twice = "def sub(a, b):\n    return a - b\n"
    await edit(env, state, command="insert", path=path, insert_line=2, new_str="\n\n" + twice.rstrip("\n"))
    assert await in_sandbox(env, path) == "def add(a, b):\n    return a - b\n\n\n" + twice
    refused = await edit(env, state, command="str_replace", path=path, old_str="return a - b", new_str="return a + b")
    assert "occurs 2 times" in refused and "[2, 6]" in refused
    shown = await edit(
        env,
        state,
        command="str_replace",
        path=path,
        old_str="(a, b):\n    return a - b\n\n",
        new_str="(a, b):\n    return a + b\n\n",
    )
    assert "     2\t    return a + b" in shown
    assert (await in_sandbox(env, path)).startswith("def add(a, b):\n    return a + b\n")

    view = await edit(env, state, command="view", path=path, view_range=[5, 6])
    assert view.splitlines()[1:] == ["     5\tdef sub(a, b):", "     6\t    return a - b"]
    await env.exec(f"mkdir -p {env.workdir}/.git/objects && touch {env.workdir}/.hidden")
    listing = await edit(env, state, command="view", path=env.workdir)
    assert f"{env.workdir}/pkg/\n{env.workdir}/pkg/calc.py" in listing and ".git" not in listing.splitlines()[1]
    assert "2 hidden entries" in listing

    await edit(env, state, command="undo_edit", path=path)
    await edit(env, state, command="undo_edit", path=path)
    assert await in_sandbox(env, path) == "def add(a, b):\n    return a - b\n"
    assert "removed" in await edit(env, state, command="undo_edit", path=path)
    assert (await env.run(argv=["test", "-e", path])).exit_code == 1
    assert "no edit" in await edit(env, state, command="undo_edit", path=path)


async def test_search_runs_grep_in_the_sandbox(env):
    await env.write_file("src/a.py", "import os\nos.sep\n")
    await env.write_file("src/b/c.py", "print('os')\n")
    await env.write_file("src/.cache/d.py", "os\n")  # hidden: skipped
    state = EpisodeState()
    found = await SEARCH.run(env, {"search_term": "os", "path": "src"}, state)
    assert found.splitlines() == [
        f'3 matches for "os" in 2 files under {env.workdir}/src:',
        f"{env.workdir}/src/a.py (2 matches)",
        f"{env.workdir}/src/b/c.py (1 matches)",
    ]
    lines = await SEARCH.run(env, {"search_term": "-sep", "path": f"{env.workdir}/src/a.py"}, state)
    assert lines == f'No matches for "-sep" in {env.workdir}/src/a.py.'  # a term that looks like an option is text
    lines = await SEARCH.run(env, {"search_term": ".sep", "path": f"{env.workdir}/src/a.py"}, state)
    assert lines.splitlines()[1:] == ["     2\tos.sep"]
    assert "does not exist" in await SEARCH.run(env, {"search_term": "os", "path": "/nowhere"}, state)


async def test_hostile_paths_neither_reach_the_host_nor_break_the_tools(env, bwrap_runtime, tmp_path):
    host = tmp_path / "host-secret.txt"  # a host file outside everything the sandbox sees
    host.write_text("HOST-SECRET\n")
    await env.exec(f"ln -s {host} {env.workdir}/leak && ln -s / {env.workdir}/root")
    state = EpisodeState()
    answers = [
        await edit(env, state, command="view", path="../../etc/shadow"),
        await edit(env, state, command="view", path=f"{env.workdir}/../../etc/shadow"),
        await edit(env, state, command="view", path=f"{env.workdir}/leak"),
        await edit(env, state, command="view", path=f"{env.workdir}/root{host}"),
        await edit(env, state, command="view", path=str(host)),
        await edit(env, state, command="str_replace", path=f"{env.workdir}/leak", old_str="HOST", new_str="x"),
        await edit(env, state, command="insert", path=f"{env.workdir}/leak", insert_line=0, new_str="x"),
        await edit(env, state, command="create", path=f"{env.workdir}/leak", file_text="x"),
        await edit(env, state, command="create", path=f"{env.workdir}/root{tmp_path}/made", file_text="x"),
        await SEARCH.run(env, {"search_term": "HOST-SECRET", "path": str(tmp_path)}, state),
        await SEARCH.run(env, {"search_term": "HOST-SECRET", "path": f"{env.workdir}/leak"}, state),
    ]
    assert all(answer.startswith(("error:", "No matches")) for answer in answers), answers
    assert not any("HOST-SECRET" in answer for answer in answers[:9])
    # The same path as the host's is the sandbox's own /tmp: the file is made there, not on the host.
    assert (await edit(env, state, command="create", path=f"{tmp_path}/made", file_text="x")).startswith("Created")
    assert await in_sandbox(env, f"{tmp_path}/made") == "x"
    assert host.read_text() == "HOST-SECRET\n" and not (tmp_path / "made").exists()
    assert "does not exist" in answers[2]  # the link's target, as the sandbox sees it: not there
    assert "symbolic link" in answers[5] and "symbolic link" in answers[7]

    # What a link to / reaches is the sandbox's view of the host, read as the sandbox's own unprivileged user.
    shadow = await edit(env, state, command="view", path=f"{env.workdir}/root/etc/shadow")
    assert shadow.startswith("error:") and ("permission denied" in shadow or "does not exist" in shadow)
    secrets = [
        line for line in Path("/etc/shadow").read_text().splitlines() if line.split(":")[1] not in ("*", "!", "")
    ]
    assert not any(line in shadow for line in secrets)

    # /proc/self/environ is the reading process's, in the sandbox: never the runtime server's environment.
    server = Path(f"/proc/{bwrap_runtime.process.pid}/environ").read_bytes().decode(errors="replace").split("\0")
    environ = await edit(env, state, command="view", path="/proc/self/environ")
    assert environ.startswith("error:") and "binary" in environ
    assert not [entry for entry in server if "=" in entry and entry in environ]
    assert (await edit(env, state, command="create", path="/proc/self/x", file_text="x")).startswith("error:")


async def test_a_link_to_a_directory_is_listed_as_the_directory(env):
    await env.write_file("real/pkg/mod.py", "x = 1\n")
    await env.exec(f"ln -s {env.workdir}/real {env.workdir}/alias")
    listing = await edit(env, EpisodeState(), command="view", path=f"{env.workdir}/alias")
    assert listing.splitlines()[1:] == [f"{env.workdir}/alias/pkg/", f"{env.workdir}/alias/pkg/mod.py"]


async def test_arguments_the_runtime_cannot_take_are_observations_not_crashes(env):
    state, long = EpisodeState(), f"{env.workdir}/" + "d/" * 2100 + "f.py"
    answers = [
        await edit(env, state, command="view", path=f"{env.workdir}/\ud800.py"),
        await edit(env, state, command="view", path=long),
        await edit(env, state, command="create", path=long, file_text="x"),
        await edit(env, state, command="create", path=f"{env.workdir}/s.py", file_text="x = '\ud800'\n"),
        await SEARCH.run(env, {"search_term": "a\0b"}, state),
        await SEARCH.run(env, {"search_term": "\ud800"}, state),
        await SEARCH.run(env, {"search_term": "x", "path": f"{env.workdir}/\ud800"}, state),
    ]
    assert all(answer.startswith("error:") for answer in answers), answers
    assert (await env.run(argv=["test", "-e", f"{env.workdir}/s.py"])).exit_code == 1

    await env.write_file("ff.py", "a\x0cb\nc\u2028d\n")
    await edit(env, state, command="insert", path=f"{env.workdir}/ff.py", insert_line=1, new_str="NEW")
    assert await in_sandbox(env, f"{env.workdir}/ff.py") == "a\x0cb\nNEW\nc\u2028d\n"


async def test_an_swe_row_fixed_through_the_editor_is_graded_as_fixed(env):
    row = {
        "problem_statement": "add() subtracts",
        "files": {"calc.py": "def add(a, b):\n    return a - b\n"},
        "test_files": {
            "test_calc.py": "import unittest\nfrom calc import add\n\n\nclass T(unittest.TestCase):\n"
            "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
        },
        "test_command": "python3 -m unittest -v",
        "tools": list(EDITOR_TOOLS),
    }
    task, state = SweTask(), EpisodeState()
    await task.init(env.for_task(), row)
    tools = {tool.name: tool for tool in task.tools(row)}
    path = f"{env.workdir}/repo/calc.py"
    found = await tools["search"].run(env, {"search_term": "a - b", "path": f"{env.workdir}/repo"}, state)
    assert found.splitlines()[1] == f"{path} (1 matches)"  # .git is hidden: not searched
    edited = await tools["str_replace_editor"].run(
        env, {"command": "str_replace", "path": path, "old_str": "a - b", "new_str": "a + b"}, state
    )
    assert edited.startswith("Edited")
    await env.end_processes()
    assert await task.evaluate(env.for_task(), row, state) == {"outcome": 1.0}
    assert "+    return a + b" in state.artifacts["git_patch"]
