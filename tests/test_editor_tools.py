"""The SWE editing tools (prorl_adapter/editor_tools.py) against ScriptedSandbox: every command of
`str_replace_editor` with OpenHands' semantics, `search`, the bounds on outputs and on the undo history, and how a
task chooses them by name. What the commands do to real files in a real sandbox, hostile paths included, is
integration_tests/test_editor_tools.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from prorl_adapter import editor_tools
from prorl_adapter.editor_tools import (
    EDITOR_TOOLS,
    OUTPUT_CHARS,
    UNDO_DEPTH,
    search_tool,
    str_replace_editor_tool,
    swe_tools,
)
from prorl_adapter.service.actions import FORMATS
from prorl_adapter.tasks import EpisodeState, TaskConfigError
from prorl_adapter.testing import ScriptedSandbox
from prorl_plugins.tasks.swe import SweTask
from sandbox_runtime.client import SandboxAPIError
from sandbox_runtime.models import PathQuery, RunResult

EDITOR = str_replace_editor_tool()
SEARCH = search_tool()
FILE = "/workspace/repo/calc.py"
SOURCE = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"


def sandbox_with(files: dict[str, str], answer=None) -> ScriptedSandbox:
    sandbox = ScriptedSandbox(answer) if answer else ScriptedSandbox()
    sandbox.files.update({path: text.encode() for path, text in files.items()})
    return sandbox


async def edit(sandbox: ScriptedSandbox, state: EpisodeState | None = None, **args) -> str:
    return await EDITOR.run(sandbox, args, state or EpisodeState())


def text_of(sandbox: ScriptedSandbox, path: str = FILE) -> str:
    return sandbox.files[path].decode()


# --- view -------------------------------------------------------------------------------------------------------------


async def test_view_numbers_a_files_lines_as_cat_n_does_and_shows_a_range():
    sandbox = sandbox_with({FILE: SOURCE})
    whole = await edit(sandbox, command="view", path=FILE)
    assert whole.splitlines()[1:3] == ["     1\tdef add(a, b):", "     2\t    return a - b"]
    assert len(whole.splitlines()) == 1 + 6  # a last newline starts no line
    assert (await edit(sandbox, command="view", path=FILE, view_range=[5, 6])).splitlines()[1:] == [
        "     5\tdef sub(a, b):",
        "     6\t    return a - b",
    ]
    to_end = await edit(sandbox, command="view", path=FILE, view_range=[4, -1])
    assert [line.split("\t")[0].strip() for line in to_end.splitlines()[1:]] == ["4", "5", "6"]
    assert await edit(sandbox, command="view", path=FILE, view_range="[4, -1]") == to_end  # JSON text, as some write
    past_end = await edit(sandbox, command="view", path=FILE, view_range=[6, 60])
    assert "     6\t    return a - b" in past_end and "has 6 lines" in past_end


@pytest.mark.parametrize(
    ("view_range", "fragment"),
    [([0, 2], "outside the file's lines, 1 to 6"), ([7, 8], "1 to 6"), ([4, 2], "comes before"), ([1], "two")],
)
async def test_a_view_range_outside_the_file_or_malformed_is_refused(view_range, fragment):
    answer = await edit(sandbox_with({FILE: SOURCE}), command="view", path=FILE, view_range=view_range)
    assert answer.startswith("error:") and fragment in answer


async def test_view_of_a_directory_lists_two_levels_without_hidden_entries():
    listing = "d\tpkg\nf\tpkg/mod.py\nH\t.git\nH\tpkg/.cache\nf\tsetup.py\nl\tlink\n"

    def answer(call, box):
        return listing if call.argv and call.argv[0] == "find" else None

    sandbox = sandbox_with({FILE: SOURCE}, answer)
    shown = await edit(sandbox, command="view", path="/workspace/repo")
    lines = shown.splitlines()
    assert lines[1:5] == [
        "/workspace/repo/link@",
        "/workspace/repo/pkg/",
        "/workspace/repo/pkg/mod.py",
        "/workspace/repo/setup.py",
    ]
    assert "1 hidden entries" in lines[-1]  # .git; pkg/.cache is below the top
    [find] = sandbox.calls
    assert find.kind == "run" and find.argv[:3] == ["find", "-H", "/workspace/repo"] and "-maxdepth" in find.argv
    refused = await edit(sandbox, command="view", path="/workspace/repo", view_range=[1, 2])
    assert refused.startswith("error:") and "directory" in refused


async def test_view_of_what_is_not_there_binary_or_not_absolute_says_so():
    sandbox = sandbox_with({FILE: SOURCE})
    sandbox.files["/workspace/blob.bin"] = b"\x00\x01\x02"
    assert "does not exist" in await edit(sandbox, command="view", path="/workspace/nothing.py")
    assert "binary" in await edit(sandbox, command="view", path="/workspace/blob.bin")
    relative = await edit(sandbox, command="view", path="repo/calc.py")
    assert relative.startswith("error:") and "did you mean /workspace/repo/calc.py?" in relative
    assert "'..'" in await edit(sandbox, command="view", path="/workspace/../etc/passwd")
    assert "unknown command 'show'" in await edit(sandbox, command="show", path=FILE)


class ConfinedSandbox(ScriptedSandbox):
    """A ScriptedSandbox whose file API serves only the workspace and /tmp, as the runtime's does (400)."""

    async def read_file(self, path: str) -> bytes:
        self._served(path)
        return await super().read_file(path)

    async def write_file(self, path: str, data: str | bytes) -> None:
        self._served(path)
        await super().write_file(path, data)

    def _served(self, path: str) -> None:
        if not path.startswith(("/workspace/", "/tmp/")):
            raise SandboxAPIError(400, f"path {path!r} is outside the sandbox's writable areas: /workspace, /tmp")


async def test_a_file_the_file_api_does_not_serve_is_viewed_by_a_one_shot_run_and_never_edited():
    def answer(call, box):
        path = call.argv[-1]
        if path == "/usr/lib/python3/lib.py":
            return "file\nimport os\nprint(os.sep)\n"
        if path == "/usr/lib/python3":
            return "directory\n"
        if call.argv[0] == "find":
            return "f\tlib.py\n"
        return "", 3  # not there

    sandbox = ConfinedSandbox(answer)
    shown = await edit(sandbox, command="view", path="/usr/lib/python3/lib.py")
    assert shown.splitlines()[1:] == ["     1\timport os", "     2\tprint(os.sep)"]
    assert sandbox.calls[-1].argv[:2] == ["sh", "-c"]  # read inside the sandbox, not on the host
    assert "/usr/lib/python3/lib.py" in await edit(sandbox, command="view", path="/usr/lib/python3")
    assert "does not exist" in await edit(sandbox, command="view", path="/opt/none")
    refused = await edit(sandbox, command="create", path="/usr/lib/python3/new.py", file_text="x")
    assert refused.startswith("error:") and "outside the sandbox's writable areas" in refused
    assert sandbox.files == {}


# --- create -----------------------------------------------------------------------------------------------------------


async def test_create_makes_a_new_file_and_never_replaces_one():
    sandbox = sandbox_with({FILE: SOURCE})
    assert "Created /workspace/repo/new.py (2 lines)" in await edit(
        sandbox, command="create", path="/workspace/repo/new.py", file_text="a = 1\nb = 2\n"
    )
    assert text_of(sandbox, "/workspace/repo/new.py") == "a = 1\nb = 2\n"
    refused = await edit(sandbox, command="create", path=FILE, file_text="oops")
    assert "already exists" in refused and text_of(sandbox) == SOURCE
    assert "is a directory" in await edit(sandbox, command="create", path="/workspace/repo", file_text="x")
    assert "file_text" in await edit(sandbox, command="create", path="/workspace/other.py")


# --- str_replace ------------------------------------------------------------------------------------------------------


async def test_str_replace_replaces_the_one_occurrence_and_shows_the_edited_lines():
    sandbox = sandbox_with({FILE: SOURCE})
    shown = await edit(
        sandbox,
        command="str_replace",
        path=FILE,
        old_str="def add(a, b):\n    return a - b",
        new_str="def add(a, b):\n    return a + b",
    )
    assert text_of(sandbox) == SOURCE.replace("a - b", "a + b", 1)
    assert "     2\t    return a + b" in shown and "     5\tdef sub(a, b):" in shown  # 4 lines of context after
    deleted = await edit(sandbox, command="str_replace", path=FILE, old_str="\n\n\ndef sub(a, b):\n    return a - b")
    assert "Edited" in deleted and text_of(sandbox) == "def add(a, b):\n    return a + b\n"  # no new_str: deleted


async def test_str_replace_refuses_text_that_is_not_there_or_not_unique_and_changes_nothing():
    sandbox = sandbox_with({FILE: SOURCE})
    missing = await edit(sandbox, command="str_replace", path=FILE, old_str="return a * b", new_str="x")
    assert "No replacement was made" in missing and "`return a * b` does not occur verbatim in " + FILE in missing
    twice = await edit(sandbox, command="str_replace", path=FILE, old_str="return a - b", new_str="return a + b")
    assert "occurs 2 times" in twice and "at lines [2, 6]" in twice
    indented = await edit(sandbox, command="str_replace", path=FILE, old_str="  return a - b\n\n", new_str="x")
    assert indented.startswith("Edited")  # whitespace counts: this one is unique (line 6 has one newline after)
    assert text_of(sandbox) == "def add(a, b):\n  x\ndef sub(a, b):\n    return a - b\n"
    sandbox.files[FILE] = b"aaa\n"
    overlapping = await edit(sandbox, command="str_replace", path=FILE, old_str="aa", new_str="b")
    assert "occurs 2 times" in overlapping and text_of(sandbox) == "aaa\n"  # "aa" starts twice in "aaa"
    assert "same as old_str" in await edit(sandbox, command="str_replace", path=FILE, old_str="aaa", new_str="aaa")
    assert "needs old_str" in await edit(sandbox, command="str_replace", path=FILE, old_str="")
    assert "is a directory" in await edit(sandbox, command="str_replace", path="/workspace/repo", old_str="a")


# --- insert -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("after", "new_str", "expected"),
    [
        (0, "# top", "# top\none\ntwo\n"),
        (1, "middle\n", "one\nmiddle\ntwo\n"),  # a last newline adds no blank line
        (2, "end\nmore", "one\ntwo\nend\nmore\n"),
        ("1", "as text", "one\nas text\ntwo\n"),
    ],
)
async def test_insert_puts_new_lines_after_the_line_given(after, new_str, expected):
    sandbox = sandbox_with({FILE: "one\ntwo\n"})
    shown = await edit(sandbox, command="insert", path=FILE, insert_line=after, new_str=new_str)
    assert text_of(sandbox) == expected and shown.startswith("Inserted")
    assert f"{int(after) + 1:6}\t{new_str.splitlines()[0]}" in shown


async def test_insert_after_a_last_line_without_a_newline_keeps_it_apart():
    sandbox = sandbox_with({FILE: "one\ntwo"})
    await edit(sandbox, command="insert", path=FILE, insert_line=2, new_str="three")
    assert text_of(sandbox) == "one\ntwo\nthree\n"


@pytest.mark.parametrize(
    ("text", "after", "expected"),
    [
        ("a\x0cb\nc\n", 1, "a\x0cb\nNEW\nc\n"),  # a form feed is inside a line, as for view and cat -n
        ("a\u2028b\nc\n", 1, "a\u2028b\nNEW\nc\n"),
        ("a\rb\x85c\nd", 2, "a\rb\x85c\nd\nNEW\n"),
    ],
)
async def test_insert_numbers_lines_by_newlines_only_as_view_does(text, after, expected):
    sandbox = sandbox_with({FILE: text})
    view = await edit(sandbox, command="view", path=FILE)
    assert view.split("\n")[1:] == [f"{n:6}\t{line}" for n, line in enumerate(text.rstrip("\n").split("\n"), 1)]
    shown = await edit(sandbox, command="insert", path=FILE, insert_line=after, new_str="NEW")
    assert text_of(sandbox) == expected
    assert f"{after + 1:6}\tNEW\n" in shown and f"{after:6}\t{text.split(chr(10))[after - 1]}\n" in shown
    refused = await edit(sandbox, command="insert", path=FILE, insert_line=9, new_str="x")
    assert "from 0 to 3" in refused  # the file's line count, newlines only


@pytest.mark.parametrize("after", [-1, 3, "x", None, True])
async def test_insert_outside_the_file_or_without_a_line_number_is_refused(after):
    sandbox = sandbox_with({FILE: "one\ntwo\n"})
    refused = await edit(sandbox, command="insert", path=FILE, insert_line=after, new_str="x")
    assert refused.startswith("error:") and "insert_line" in refused and text_of(sandbox) == "one\ntwo\n"
    if after in (-1, 3):
        assert "from 0 to 2" in refused


# --- undo_edit --------------------------------------------------------------------------------------------------------


async def test_undo_edit_reverts_a_files_edits_one_at_a_time():
    sandbox, state = sandbox_with({FILE: SOURCE}), EpisodeState()
    await edit(sandbox, state, command="str_replace", path=FILE, old_str="def add", new_str="def plus")
    await edit(sandbox, state, command="insert", path=FILE, insert_line=0, new_str="import math")
    assert text_of(sandbox).startswith("import math\ndef plus")
    first = await edit(sandbox, state, command="undo_edit", path=FILE)
    assert text_of(sandbox) == SOURCE.replace("def add", "def plus") and "     1\tdef plus(a, b):" in first
    await edit(sandbox, state, command="undo_edit", path=FILE)
    assert text_of(sandbox) == SOURCE
    assert "no edit of " + FILE in await edit(sandbox, state, command="undo_edit", path=FILE)
    assert "no edit" in await edit(sandbox, EpisodeState(), command="undo_edit", path=FILE)  # per episode


async def test_undo_of_a_create_removes_the_file_by_a_one_shot_run():
    def answer(call, box):
        if call.argv and call.argv[0] == "rm":
            del box.files[call.argv[-1]]

    sandbox, state = ScriptedSandbox(answer), EpisodeState()
    await edit(sandbox, state, command="create", path="/workspace/new.py", file_text="x = 1\n")
    assert "removed" in await edit(sandbox, state, command="undo_edit", path="/workspace/new.py")
    assert sandbox.files == {} and sandbox.calls[-1].argv == ["rm", "-f", "--", "/workspace/new.py"]


async def test_the_undo_history_is_bounded_per_file_and_per_episode(monkeypatch):
    sandbox, state = sandbox_with({FILE: "0\n"}), EpisodeState()
    for n in range(UNDO_DEPTH + 2):
        await edit(sandbox, state, command="str_replace", path=FILE, old_str=f"{n}\n", new_str=f"{n + 1}\n")
    assert len(state.file_history[FILE]) == UNDO_DEPTH
    for _ in range(UNDO_DEPTH):
        await edit(sandbox, state, command="undo_edit", path=FILE)
    assert text_of(sandbox) == "2\n" and "no edit" in await edit(sandbox, state, command="undo_edit", path=FILE)

    monkeypatch.setattr(editor_tools, "HISTORY_BYTES", 10)
    other = "/workspace/other.py"
    sandbox.files[other] = b"0123456789\n"
    await edit(sandbox, state, command="str_replace", path=FILE, old_str="2", new_str="3")
    await edit(sandbox, state, command="str_replace", path=other, old_str="0", new_str="x")
    assert state.file_history[FILE] == [] and state.file_history[other] == []  # 11 bytes: over the bound, forgotten


# --- bounds -----------------------------------------------------------------------------------------------------------


async def test_outputs_are_bounded_with_a_note_of_what_was_left_out():
    big = "".join(f"line {n} " + "x" * 60 + "\n" for n in range(1, 2001))
    sandbox = sandbox_with({FILE: big})
    shown = await edit(sandbox, command="view", path=FILE)
    assert len(shown) <= OUTPUT_CHARS and "     1\tline 1 " in shown
    assert "more lines" in shown.splitlines()[-1] and "view_range" in shown.splitlines()[-1]
    missing = await edit(sandbox, command="str_replace", path=FILE, old_str="y" * 20_000, new_str="z")
    assert len(missing) <= OUTPUT_CHARS and "not shown" in missing
    sandbox.files[FILE] = b"x" * (editor_tools.FILE_BYTES + 1)
    assert "more than this tool's" in await edit(sandbox, command="view", path=FILE)


# --- search -----------------------------------------------------------------------------------------------------------


async def test_search_in_a_directory_lists_the_files_that_hold_the_term():
    def answer(call, box):
        return "directory\n./pkg/a.py\x002\n./b.py\x001\n"

    sandbox = ScriptedSandbox(answer)
    found = await SEARCH.run(sandbox, {"search_term": "def add", "path": "repo"}, EpisodeState())
    assert found.splitlines() == [
        '3 matches for "def add" in 2 files under /workspace/repo:',
        "/workspace/repo/b.py (1 matches)",
        "/workspace/repo/pkg/a.py (2 matches)",
    ]
    [call] = sandbox.calls
    assert call.kind == "run" and call.argv[:2] == ["bash", "-c"] and call.argv[-2:] == ["def add", "/workspace/repo"]


async def test_search_in_a_file_shows_the_numbered_lines_and_bounds_what_it_finds():
    sandbox = ScriptedSandbox(lambda call, box: "file\n2:    return a - b\n6:    return a - b\n")
    found = await SEARCH.run(sandbox, {"search_term": "a - b", "path": FILE}, EpisodeState())
    assert found.splitlines()[1:] == ["     2\t    return a - b", "     6\t    return a - b"]

    many = "directory\n" + "".join(f"./f{n}.py\x001\n" for n in range(editor_tools.MAX_SEARCH_FILES + 1))
    narrow = await SEARCH.run(ScriptedSandbox(lambda call, box: many), {"search_term": "x"}, EpisodeState())
    assert narrow.startswith("More than 100 files in /workspace hold")
    lines = "file\n" + "".join(f"{n}:x\n" for n in range(1, editor_tools.MAX_SEARCH_LINES + 2))
    capped = await SEARCH.run(
        ScriptedSandbox(lambda call, box: lines), {"search_term": "x", "path": FILE}, EpisodeState()
    )
    assert "only the first 200" in capped and len(capped) <= OUTPUT_CHARS


async def test_search_says_what_was_wrong():
    sandbox = ScriptedSandbox(lambda call, box: ("", 3))
    assert "does not exist" in await SEARCH.run(sandbox, {"search_term": "x", "path": "/nope"}, EpisodeState())
    assert "needs search_term" in await SEARCH.run(sandbox, {}, EpisodeState())
    assert "one line" in await SEARCH.run(sandbox, {"search_term": "a\nb"}, EpisodeState())
    empty = ScriptedSandbox(lambda call, box: "directory\n")
    assert await SEARCH.run(empty, {"search_term": "zzz"}, EpisodeState()) == 'No matches for "zzz" in /workspace.'


# --- arguments the sandbox cannot take -------------------------------------------------------------------------------


class RefusingSandbox(ScriptedSandbox):
    """A ScriptedSandbox whose every call fails with `error`, as the runtime or its client would fail it."""

    def __init__(self, error: Exception):
        super().__init__()
        self.error = error

    async def read_file(self, path: str) -> bytes:
        raise self.error

    async def write_file(self, path: str, data: str | bytes) -> None:
        raise self.error

    async def run(self, **kwargs) -> RunResult:
        raise self.error


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"command": "view", "path": "/workspace/\ud800.py"}, "'\\ud800', which UTF-8 cannot encode"),
        ({"command": "view", "path": "/workspace/" + "x" * 4096}, "more than the 4096"),
        ({"command": "view", "path": "/workspace/a\0b"}, "NUL byte"),
        ({"command": "create", "path": "/workspace/new.py", "file_text": "x = '\udcff'\n"}, "nothing was written"),
        ({"command": "str_replace", "path": FILE, "old_str": "a - b", "new_str": "\ud800"}, "UTF-8 cannot encode"),
        ({"command": "insert", "path": FILE, "insert_line": 0, "new_str": "\ud800"}, "UTF-8 cannot encode"),
    ],
)
async def test_the_editor_refuses_paths_and_text_the_sandbox_cannot_take(args, fragment):
    sandbox = sandbox_with({FILE: "a - b\n"})
    answer = await edit(sandbox, **args)
    assert answer.startswith("error:") and fragment in answer
    assert sandbox.files == {FILE: b"a - b\n"} and sandbox.calls == []


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ({"search_term": "a\0b"}, "search_term contains a NUL byte"),
        ({"search_term": "\ud800"}, "search_term is not valid text"),
        ({"search_term": "x", "path": "/workspace/\ud800"}, "path is not valid text"),
        ({"search_term": "x", "path": "/workspace/a\0b"}, "path contains a NUL byte"),
        ({"search_term": "x", "path": "/" + "x" * 4096}, "more than the 4096"),
    ],
)
async def test_search_refuses_terms_and_paths_the_sandbox_cannot_take(args, fragment):
    sandbox = ScriptedSandbox()
    answer = await SEARCH.run(sandbox, args, EpisodeState())
    assert answer.startswith("error:") and fragment in answer and sandbox.calls == []


def validation_error() -> ValidationError:
    with pytest.raises(ValidationError) as raised:
        PathQuery(path="x" * 5000)
    return raised.value


@pytest.mark.parametrize(
    ("error", "fragment"),
    [
        (SandboxAPIError(400, "the request is not valid JSON"), "error: the request is not valid JSON"),
        (SandboxAPIError(422, "argv: invalid"), "error: argv: invalid"),
        (validation_error(), "error: the sandbox cannot take these arguments: String should have at most 4096"),
        (UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed"), "surrogates not allowed"),
        (ValueError("argv entries may not contain NUL"), "may not contain NUL"),
    ],
)
async def test_what_the_runtime_or_its_client_refuses_is_an_observation_of_both_tools(error, fragment):
    sandbox = RefusingSandbox(error)
    viewed = await edit(sandbox, command="view", path="/usr/lib/x.py")  # file API, then (a 400) a read in the sandbox
    created = await edit(sandbox, command="create", path="/workspace/new.py", file_text="x")
    removed = await edit(
        sandbox, EpisodeState(file_history={"/workspace/a": [None]}), command="undo_edit", path="/workspace/a"
    )
    searched = await SEARCH.run(sandbox, {"search_term": "x"}, EpisodeState())
    for answer in (viewed, created, removed, searched):
        assert answer.startswith("error:") and fragment in answer, answer


@pytest.mark.parametrize("status", [500, 502, 503])
async def test_a_runtime_failure_still_raises_from_both_tools(status):
    sandbox = RefusingSandbox(SandboxAPIError(status, "the runtime failed"))
    with pytest.raises(SandboxAPIError):
        await edit(sandbox, command="view", path="/usr/lib/x.py")
    with pytest.raises(SandboxAPIError):
        await edit(
            sandbox, EpisodeState(file_history={"/workspace/a": [None]}), command="undo_edit", path="/workspace/a"
        )
    with pytest.raises(SandboxAPIError):
        await SEARCH.run(sandbox, {"search_term": "x"}, EpisodeState())


# --- choosing the tools -----------------------------------------------------------------------------------------------


def test_tools_are_chosen_by_name_and_an_unknown_name_is_refused():
    assert [tool.name for tool in swe_tools(list(EDITOR_TOOLS), 5)] == list(EDITOR_TOOLS)
    with pytest.raises(ValueError, match="unknown tool 'edit'"):
        swe_tools(["bash", "edit"], 5)
    with pytest.raises(TaskConfigError, match="named twice"):
        swe_tools(["bash", "bash"], 5)
    with pytest.raises(TaskConfigError, match="non-empty list"):
        swe_tools("bash", 5)
    with pytest.raises(TaskConfigError, match="unknown tool"):
        swe_tools([{"name": "bash"}], 5)


async def test_the_swe_task_offers_bash_and_finish_unless_the_row_or_the_task_names_others():
    task = SweTask()
    assert [tool.name for tool in task.tools({})] == ["bash", "finish"]
    row = {"problem_statement": "p", "files": {"a.py": ""}, "test_files": {"t.py": ""}, "test_command": "true"}
    editing = {**row, "tools": list(EDITOR_TOOLS)}
    assert [tool.name for tool in task.tools(editing)] == list(EDITOR_TOOLS)
    assert "the bash, str_replace_editor and search tools" in task.system_prompt(editing)
    assert "the bash tool" in task.system_prompt(row)
    assert [tool.name for tool in SweTask(tools=EDITOR_TOOLS).tools(row)] == list(EDITOR_TOOLS)
    with pytest.raises(TaskConfigError, match="unknown tool 'sed'"):
        await task.init(ScriptedSandbox(), {**row, "tools": ["bash", "sed"]})
    with pytest.raises(TaskConfigError, match="unknown tool 'sed'"):
        SweTask(tools=("sed",))


def test_the_fenced_format_offers_search_but_not_the_editor_of_several_arguments():
    tools = swe_tools(list(EDITOR_TOOLS), 5)
    system, schemas = FORMATS["fenced"].offer(SimpleNamespace(takes_tools=False), "Fix it.", tools)
    assert schemas is None and "```search: " in system and "The block holds search_term." in system
    assert "str_replace_editor" not in system and "None" not in system
    parsed = FORMATS["fenced"].parse("```str_replace_editor\nview\n```", {tool.name: tool for tool in tools})
    assert parsed.calls == [] and "several arguments" in parsed.errors[0]
    _, hermes_schemas = FORMATS["hermes"].offer(SimpleNamespace(takes_tools=True), "Fix it.", tools)
    editor = next(s for s in hermes_schemas if s["function"]["name"] == "str_replace_editor")
    assert editor["function"]["parameters"]["required"] == ["command", "path"]
