"""The SWE editing tools of the built-in agent loop, for any task to offer beside `bash` and `finish` (`swe_tools`):

- `str_replace_editor`, with the commands and semantics of OpenHands' editor (ProRL Agent's and SWE-Gym's runs):
  `view` (a file's lines numbered as `cat -n` numbers them, optionally a range; a directory's entries two levels
  deep, hidden ones left out), `create` (a new file only), `str_replace` (old_str must occur exactly once),
  `insert` (after line N; 0 is the top) and `undo_edit` (the file's last edit reverted);
- `search`, as R2E-Gym's (DeepSWE's runs): a term, as fixed text, in a directory's files (the files that hold it,
  with counts) or in one file (the lines that hold it).

Where they act, and why it is confined: every edit reads and writes through the runtime's file API, which serves
the sandbox's writable areas only (the workspace and /tmp), refuses '..', a symbolic link anywhere on the path and
anything but a regular file, and never resolves a path on the host (sandbox_runtime/files.py): the editor can
write what the agent's shell can, and nothing more. `view` reads a file the file API does not serve (a library
outside the workspace, a file behind a link) with a one-shot `cat` in the sandbox, and lists a directory with a
one-shot `find`; `search` is a one-shot `grep`: processes of the sandbox, which see the sandbox's files only, as
the agent's own commands do. A failure the agent caused (a missing file, a refused path) is an observation that
says what was wrong, and so is an argument the runtime or its client refuses (a 4xx, a ValueError such as
pydantic's ValidationError or a UnicodeEncodeError); a runtime that fails (5xx, unreachable) raises, as for every
tool.

Outputs are bounded (OUTPUT_CHARS, whole lines, with a note of what was left out), and so are the files the editor
takes (FILE_BYTES) and its undo history (UNDO_DEPTH edits a file, HISTORY_BYTES an episode, in
`EpisodeState.file_history`).

Differences from OpenHands, on purpose: `insert` adds no blank line after a new_str that ends with a newline, and
keeps a last line without one apart from the inserted text; `undo_edit` after `create` removes the file (OpenHands
writes the same content back); tabs are never expanded; no linting, no Markdown conversion of binary documents.
"""

from __future__ import annotations

import contextlib
import functools
import json
import posixpath
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from sandbox_runtime.client import SandboxAPIError
from server_kit.errors import ProrlError

from .tasks import FINISH, EpisodeState, SandboxHandle, TaskConfigError, Tool, ToolFn, bash_tool, python_tool

OUTPUT_CHARS = 7000  # below the agent loop's own cut (agent.MAX_OBSERVATION_CHARS): this tool's note is what shows
FILE_BYTES = 4 << 20  # the largest file the editor views or edits
UNDO_DEPTH = 10  # edits a file that undo_edit can revert
# What an episode's undo history may hold in all; the oldest edits are forgotten first. It lives in the rollout
# service's memory for the whole episode, and a service runs hundreds of episodes at once: 4 MiB each keeps that
# to a few GiB at worst (32 MiB could reach tens), and still holds the last edit of a file as big as FILE_BYTES.
HISTORY_BYTES = 4 << 20
SNIPPET_CONTEXT = 4  # lines shown around an edit
MAX_SEARCH_FILES = 100  # a directory search that finds the term in more files asks for a narrower one
MAX_SEARCH_LINES = 200  # lines a file search shows
MAX_LINE_CHARS = 400  # of one line a search shows
LISTING_BYTES = 1 << 20  # output of a directory listing's `find`
MAX_PATH_CHARS = 4096  # the longest path the runtime's file API takes (sandbox_runtime.models.PathQuery)
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


class _Refused(ProrlError):
    """A command that cannot be done as asked; its message is the observation."""


def _errors_answered(run: ToolFn) -> ToolFn:
    """`run`, with what the agent's arguments caused answered as an "error: ..." observation: a refusal of this
    module, a 4xx of the runtime, a value its client will not send (a ValueError: pydantic's ValidationError,
    UnicodeEncodeError). A runtime failure (5xx, unreachable) raises, as for every tool."""

    @functools.wraps(run)
    async def answered(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        try:
            return await run(env, args, state)
        except _Refused as refused:
            return _bounded(f"error: {refused}")
        except SandboxAPIError as exc:
            if exc.status >= 500:
                raise
            return _bounded(f"error: {exc.message}")
        except ValidationError as exc:
            return _bounded(
                "error: the sandbox cannot take these arguments: " + "; ".join(e["msg"] for e in exc.errors())
            )
        except ValueError as exc:  # UnicodeError included
            return _bounded(f"error: the sandbox cannot take these arguments: {exc}")

    return answered


def _unsendable(value: str, name: str) -> str | None:
    """Why the text `value` (the argument `name`) cannot go to the sandbox, or None: a NUL byte (no argument or
    path of a process can hold one), or a lone surrogate (not UTF-8: neither the wire nor a file can hold it)."""
    if "\0" in value:
        return f"{name} contains a NUL byte"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"{name} is not valid text: it holds {value[exc.start : exc.end]!r}, which UTF-8 cannot encode"
    return None


# --- str_replace_editor ---------------------------------------------------------------------------------------------


def str_replace_editor_tool(timeout: float = 30.0) -> Tool:
    """OpenHands' file editor (module docstring); `timeout` bounds each one-shot run it makes (view's cat and find,
    undo's rm)."""

    @_errors_answered
    async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        command = args.get("command")
        if command not in COMMANDS:
            raise _Refused(f"unknown command {command!r}; the commands: {', '.join(COMMANDS)}")
        path = _absolute(args.get("path"), env.workdir)
        if command == "view":
            return _bounded(await _view(env, path, args.get("view_range"), timeout))
        if command == "create":
            return _bounded(await _create(env, path, args, state))
        if command == "str_replace":
            return _bounded(await _str_replace(env, path, args, state))
        if command == "insert":
            return _bounded(await _insert(env, path, args, state))
        return _bounded(await _undo(env, path, state, timeout))

    return Tool(
        "str_replace_editor",
        "View, create and edit text files in the sandbox. `view` shows a file's lines numbered as `cat -n` does "
        "(optionally only `view_range`), or lists a directory two levels deep without hidden entries. `create` "
        "makes a new file (never over an existing one). `str_replace` replaces `old_str`, which must match exactly "
        "one place in the file, whitespace and indentation included, with `new_str`. `insert` puts `new_str` on "
        "new lines after line `insert_line` (0: at the top). `undo_edit` reverts the last edit of the file. Paths "
        "are absolute. Long outputs are cut, saying what was left out.",
        {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": list(COMMANDS), "description": "what to do"},
                "path": {"type": "string", "description": "absolute path of the file or directory, e.g. /testbed/a.py"},
                "file_text": {"type": "string", "description": "create: the new file's content"},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace (unique)"},
                "new_str": {
                    "type": "string",
                    "description": "str_replace: the text that replaces old_str (none: old_str is deleted); "
                    "insert: the lines to insert",
                },
                "insert_line": {"type": "integer", "description": "insert: new_str goes after this line (0: the top)"},
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "view of a file: [first, last] line, numbered from 1; last -1: to the end",
                },
            },
            "required": ["command", "path"],
        },
        run,
    )


def _absolute(path: Any, workdir: str) -> str:
    """The path checked: absolute, without '..', a NUL byte or a lone surrogate, at most MAX_PATH_CHARS long;
    normalised (one spelling per file for the history)."""
    if not isinstance(path, str) or not path.strip():
        raise _Refused('"path" must be an absolute path, e.g. ' + posixpath.join(workdir, "file.py"))
    if wrong := _unsendable(path, "the path"):
        raise _Refused(wrong)
    if len(path) > MAX_PATH_CHARS:
        raise _Refused(f"the path is {len(path)} characters long, more than the {MAX_PATH_CHARS} a path may have")
    if ".." in path.split("/"):
        raise _Refused(f"the path {path} contains '..': give it without")
    if not path.startswith("/"):
        raise _Refused(f"the path must be absolute (start with /): did you mean {posixpath.join(workdir, path)}?")
    return posixpath.normpath("/" + path.lstrip("/"))


def _file_api_refusal(exc: SandboxAPIError, path: str) -> _Refused:
    """What a refused file API call tells the agent; a runtime failure (5xx but a full disk) is no refusal."""
    if exc.status >= 500 and exc.status != 507:
        raise exc
    if exc.status == 404:
        return _Refused(f"{path} does not exist")
    return _Refused(exc.message)


async def _read_text(env: SandboxHandle, path: str) -> str:
    """A file to edit, through the file API: a regular file in the sandbox's writable areas, as UTF-8 text."""
    try:
        data = await env.read_file(path)
    except SandboxAPIError as exc:
        if exc.status == 409 and "is a directory" in exc.message:
            raise _Refused(f"{path} is a directory: only view works on a directory") from None
        raise _file_api_refusal(exc, path) from None
    return _text(data, path)


def _text(data: bytes, path: str) -> str:
    if len(data) > FILE_BYTES:
        raise _Refused(f"{path} is {len(data)} bytes, more than this tool's {FILE_BYTES}: use search or bash")
    if b"\0" in data:
        raise _Refused(f"{path} looks binary (it holds NUL bytes): this tool handles text files only")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise _Refused(f"{path} is not UTF-8 text: this tool handles text files only") from None


async def _write_text(env: SandboxHandle, path: str, text: str) -> None:
    if wrong := _unsendable(text, "the new content"):
        raise _Refused(f"nothing was written: {wrong}")
    try:
        await env.write_file(path, text.encode("utf-8"))
    except SandboxAPIError as exc:
        raise _file_api_refusal(exc, path) from None


def _remember(state: EpisodeState, path: str, before: str | None) -> None:
    """Keep what `path` held before an edit (None: it did not exist) for undo_edit, within the bounds."""
    history = state.file_history.setdefault(path, [])
    history.append(None if before is None else before.encode("utf-8"))
    del history[:-UNDO_DEPTH]
    total = sum(len(entry or b"") for entries in state.file_history.values() for entry in entries)
    for entries in state.file_history.values():  # the oldest edits first, file by file
        while total > HISTORY_BYTES and entries:
            total -= len(entries.pop(0) or b"")


def _lines(text: str) -> list[str]:
    """A text's lines without their newlines; a last newline ends the last line, it starts none. Only "\\n" ends a
    line, as for `cat -n` and grep (str.splitlines would also split on \\r, \\x0c, \\x85, \\u2028, ...): view,
    insert, the snippets and search all number lines by this."""
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines if text else []


def _numbered(lines: list[str], first: int) -> list[str]:
    """Lines as `cat -n` writes them: the number right-aligned in 6 columns, a tab, the line."""
    return [f"{number:6}\t{line}" for number, line in enumerate(lines, first)]


def _snippet(text: str, first: int, last: int) -> str:
    """Lines first..last (from 1, clamped to the file) of `text`, numbered."""
    lines = _lines(text)
    first, last = max(1, first), min(len(lines), last)
    return "\n".join(_numbered(lines[first - 1 : last], first))


def _bounded(text: str, limit: int = OUTPUT_CHARS) -> str:
    """At most `limit` characters: whole lines from the top, then a note of what was left out."""
    if len(text) <= limit:
        return text
    kept, size = [], 0
    lines = text.split("\n")
    for line in lines:
        if size + len(line) + 1 > limit - 200:
            break
        kept.append(line)
        size += len(line) + 1
    if not kept:  # one long line: its start
        return f"{text[: limit - 200]}\n[... {len(text) - limit + 200} more characters not shown ...]"
    return (
        "\n".join(kept) + f"\n[... {len(lines) - len(kept)} more lines ({len(text) - size} characters) not shown: "
        "view a range of lines (view_range) or search for what you need ...]"
    )


async def _view(env: SandboxHandle, path: str, view_range: Any, timeout: float) -> str:
    try:
        text = _text(await env.read_file(path), path)
    except SandboxAPIError as exc:
        if exc.status == 409 and "is a directory" in exc.message:
            if view_range is not None:
                raise _Refused("view_range applies to a file; this path is a directory") from None
            return await _listing(env, path, timeout)
        if exc.status != 400:
            raise _file_api_refusal(exc, path) from None
        # Not served by the file API (outside the writable areas, or a link on the path): read in the sandbox.
        kind, text = await _read_in_sandbox(env, path, timeout)
        if kind == "directory":
            if view_range is not None:
                raise _Refused("view_range applies to a file; this path is a directory") from None
            return await _listing(env, path, timeout)
    return _view_file(text, path, view_range)


# What view's one-shot run does with a path the file API does not serve: says what it is, and prints a file.
_READ_SCRIPT = """
if [ -d "$1" ]; then echo directory; exit 0; fi
[ -e "$1" ] || exit 3
[ -f "$1" ] || exit 4
[ -r "$1" ] || exit 5
echo file
exec cat -- "$1"
"""
_READ_FAILURES = {
    3: "does not exist",
    4: "is not a regular file or a directory",
    5: "cannot be read (permission denied)",
}


async def _read_in_sandbox(env: SandboxHandle, path: str, timeout: float) -> tuple[str, str]:
    result = await env.run(
        argv=["sh", "-c", _READ_SCRIPT, "view", path], timeout=timeout, max_output_bytes=FILE_BYTES + 64
    )
    if result.status != "completed":
        raise _Refused(f"reading {path} took longer than {timeout:g} s")
    if result.exit_code in _READ_FAILURES:
        raise _Refused(f"{path} {_READ_FAILURES[result.exit_code]}")
    kind, _, text = result.output.partition("\n")
    if result.exit_code != 0 or kind not in ("file", "directory"):
        raise _Refused(f"could not read {path}: {result.output.strip()[:500]}")
    if result.truncated:
        raise _Refused(f"{path} is more than this tool's {FILE_BYTES} bytes: use search or bash")
    if "\0" in text:
        raise _Refused(f"{path} looks binary (it holds NUL bytes): this tool handles text files only")
    return kind, text


def _view_file(text: str, path: str, view_range: Any) -> str:
    lines = _lines(text)
    count = len(lines)
    if isinstance(view_range, str):  # a model that writes the array as JSON text
        with contextlib.suppress(ValueError):
            view_range = json.loads(view_range)
    if view_range is None:
        if not count:
            return f"{path} is empty."
        return f"{path}, numbered as by `cat -n`:\n" + "\n".join(_numbered(lines, 1))
    if (
        not isinstance(view_range, list)
        or len(view_range) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in view_range)
    ):
        raise _Refused(f"view_range must be two integers, [first, last]; got {view_range!r}")
    first, last = view_range
    if not 1 <= first <= count:
        raise _Refused(f"view_range's first line {first} is outside the file's lines, 1 to {count}")
    note = ""
    if last == -1:
        last = count
    elif last > count:
        note = f"\n(the file has {count} lines: shown up to line {count})"
        last = count
    if last < first:
        raise _Refused(f"view_range's last line {last} comes before its first, {first}")
    return f"{path}, lines {first}-{last}, numbered as by `cat -n`:\n" + (
        "\n".join(_numbered(lines[first - 1 : last], first)) + note
    )


async def _listing(env: SandboxHandle, path: str, timeout: float) -> str:
    """A directory's entries two levels deep, hidden ones (and what they hold) left out, each as an absolute
    path; directories end with /, links with @. `path` itself may be a link to a directory (-H: followed)."""
    hidden_pruned = ["-name", ".*", "-printf", "H\t%P\n", "-prune"]
    result = await env.run(
        argv=["find", "-H", path, "-mindepth", "1", "-maxdepth", "2", *hidden_pruned, "-o", "-printf", "%y\t%P\n"],
        timeout=timeout,
        max_output_bytes=LISTING_BYTES,
    )
    if result.status != "completed" or result.exit_code != 0:
        raise _Refused(f"could not list {path}: {result.output.strip()[:500] or 'the listing timed out'}")
    entries, hidden = [], 0
    for line in _lines(result.output):
        kind, _, name = line.partition("\t")
        if kind == "H":
            hidden += "/" not in name
        elif name:
            entries.append(posixpath.join(path, name) + {"d": "/", "l": "@"}.get(kind, ""))
    entries.sort()
    text = f"{path}: files and directories two levels deep, hidden ones left out:\n" + "\n".join(entries)
    if result.truncated:
        text += "\n[... the listing was cut: list a subdirectory ...]"
    if hidden:
        text += f"\n({hidden} hidden entries in {path} not shown: `ls -la {path}` in bash lists them)"
    return text


async def _create(env: SandboxHandle, path: str, args: dict[str, Any], state: EpisodeState) -> str:
    file_text = args.get("file_text")
    if not isinstance(file_text, str):
        raise _Refused("create needs file_text, the new file's content")
    try:
        await env.read_file(path)
    except SandboxAPIError as exc:
        if exc.status != 404:
            if exc.status == 409 and "is a directory" in exc.message:
                raise _Refused(f"{path} is a directory") from None
            raise _file_api_refusal(exc, path) from None
    else:
        raise _Refused(f"{path} already exists: create makes new files only; edit it with str_replace or insert")
    await _write_text(env, path, file_text)
    _remember(state, path, None)
    return f"Created {path} ({len(_lines(file_text))} lines)."


def _occurrences(text: str, needle: str) -> list[int]:
    """Every offset at which `needle` starts, overlapping ones included (so "exactly once" means once)."""
    found, at = [], text.find(needle)
    while at != -1:
        found.append(at)
        at = text.find(needle, at + 1)
    return found


async def _str_replace(env: SandboxHandle, path: str, args: dict[str, Any], state: EpisodeState) -> str:
    old, new = args.get("old_str"), args.get("new_str", "")
    if not isinstance(old, str) or not old:
        raise _Refused("str_replace needs old_str, the exact text to replace")
    new = "" if new is None else new
    if not isinstance(new, str):
        raise _Refused("new_str must be a string")
    if new == old:
        raise _Refused("No replacement was made: new_str is the same as old_str")
    text = await _read_text(env, path)
    found = _occurrences(text, old)
    if not found:
        raise _Refused(f"No replacement was made: old_str `{old}` does not occur verbatim in {path}.")
    if len(found) > 1:
        lines = sorted({text.count("\n", 0, at) + 1 for at in found})
        raise _Refused(
            f"No replacement was made: old_str `{old}` occurs {len(found)} times in {path}, at lines {lines}. "
            "Include more of the surrounding lines so that it is unique."
        )
    at = found[0]
    edited = text[:at] + new + text[at + len(old) :]
    await _write_text(env, path, edited)
    _remember(state, path, text)
    line = text.count("\n", 0, at) + 1
    snippet = _snippet(edited, line - SNIPPET_CONTEXT, line + SNIPPET_CONTEXT + new.count("\n"))
    return f"Edited {path}. Around the change, numbered as by `cat -n`:\n{snippet}\nCheck it; edit again if needed."


def _line_number(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _Refused("insert needs insert_line, an integer (0: at the top)")
    try:
        return int(value)
    except ValueError:
        raise _Refused(f"insert_line must be an integer; got {value!r}") from None


async def _insert(env: SandboxHandle, path: str, args: dict[str, Any], state: EpisodeState) -> str:
    if "insert_line" not in args or args["insert_line"] is None:
        raise _Refused("insert needs insert_line, the line after which new_str goes (0: at the top)")
    after = _line_number(args["insert_line"])
    new = args.get("new_str")
    if not isinstance(new, str):
        raise _Refused("insert needs new_str, the lines to insert")
    text = await _read_text(env, path)
    lines = _lines(text)
    if not 0 <= after <= len(lines):
        raise _Refused(f"insert_line {after} is outside the file: it must be from 0 to {len(lines)}, its line count")
    block = new if new.endswith("\n") else new + "\n"
    # Lines 1..after with their newlines; after a last line that has none of its own, one is added.
    head = "".join(line + "\n" for line in lines[:after])
    edited = head + block + text[len(head) :]
    await _write_text(env, path, edited)
    _remember(state, path, text)
    added = block.count("\n")
    snippet = _snippet(edited, after + 1 - SNIPPET_CONTEXT, after + added + SNIPPET_CONTEXT)
    return (
        f"Inserted {added} lines after line {after} of {path}. Around them, numbered as by `cat -n`:\n{snippet}\n"
        "Check them (indentation, no duplicated lines); edit again if needed."
    )


async def _undo(env: SandboxHandle, path: str, state: EpisodeState, timeout: float) -> str:
    history = state.file_history.get(path)
    if not history:
        raise _Refused(f"there is no edit of {path} to undo")
    before = history.pop()
    if before is None:  # the edit created the file
        result = await env.run(argv=["rm", "-f", "--", path], timeout=timeout)
        if result.status != "completed" or result.exit_code != 0:
            history.append(None)
            raise _Refused(f"could not remove {path}: {result.output.strip()[:500]}")
        return f"Undid the creation of {path}: it is removed."
    try:
        await env.write_file(path, before)
    except SandboxAPIError as exc:
        history.append(before)
        raise _file_api_refusal(exc, path) from None
    shown = "\n".join(_numbered(_lines(before.decode("utf-8")), 1))
    return f"Undid the last edit of {path}. It now reads, numbered as by `cat -n`:\n{shown}"


# --- search ---------------------------------------------------------------------------------------------------------

# The search's one-shot run: $1 the term, $2 the path. In a directory, the files that hold the term (hidden
# directories skipped below it; grep's --exclude-dir='.*' would skip the start '.' too), at most one more than
# MAX_SEARCH_FILES, then their counts; in a file, its matching lines.
_SEARCH_SCRIPT = f"""
if [ -d "$2" ]; then
  cd -- "$2" || exit 5
  echo directory
  grep -rIlFZ --exclude-dir='.[!.]*' --exclude-dir='..?*' -e "$1" . 2>/dev/null |
    head -z -n {MAX_SEARCH_FILES + 1} | xargs -0 -r grep -HcFZ -e "$1" -- 2>/dev/null
elif [ -f "$2" ]; then
  echo file
  grep -nIF -e "$1" -- "$2" 2>/dev/null | head -n {MAX_SEARCH_LINES + 1} | cut -c 1-{MAX_LINE_CHARS}
else
  exit 3
fi
exit 0
"""


def search_tool(timeout: float = 30.0) -> Tool:
    """R2E-Gym's search (module docstring), a one-shot run of `grep` in the sandbox bounded by `timeout`."""

    @_errors_answered
    async def run(env: SandboxHandle, args: dict[str, Any], state: EpisodeState) -> str:
        term, path = args.get("search_term"), args.get("path") or env.workdir
        if not isinstance(term, str) or not term:
            return "error: search needs search_term, the text to look for"
        if "\n" in term:
            return "error: search_term must be one line"
        if wrong := _unsendable(term, "search_term"):
            return f"error: {wrong}"
        if not isinstance(path, str):
            return "error: path must be a file or directory of the sandbox"
        if wrong := _unsendable(path, "path"):
            return f"error: {wrong}"
        if len(path) > MAX_PATH_CHARS:
            return f"error: path is {len(path)} characters long, more than the {MAX_PATH_CHARS} a path may have"
        path = posixpath.normpath(posixpath.join(env.workdir, path))
        result = await env.run(
            argv=["bash", "-c", _SEARCH_SCRIPT, "search", term, path], timeout=timeout, max_output_bytes=256 << 10
        )
        if result.status != "completed":
            return f"error: the search took longer than {timeout:g} s: search a smaller directory"
        if result.exit_code == 3:
            return f"error: {path} does not exist"
        kind, _, found = result.output.partition("\n")
        if result.exit_code != 0 or kind not in ("directory", "file"):
            return _bounded(f"error: could not search {path}: {result.output.strip()[:500]}")
        quoted = f'"{term}"'
        if kind == "file":
            return _bounded(_file_matches(found, quoted, path))
        counts = []
        for line in _lines(found):
            name, _, count = line.partition("\0")
            if count.isdigit():
                counts.append((posixpath.normpath(posixpath.join(path, name)), int(count)))
        if not counts:
            return f"No matches for {quoted} in {path}."
        if len(counts) > MAX_SEARCH_FILES:
            return (
                f"More than {MAX_SEARCH_FILES} files in {path} hold {quoted}: search a narrower directory or a more "
                "specific term."
            )
        counts.sort()
        listed = "\n".join(f"{name} ({count} matches)" for name, count in counts)
        total = sum(count for _, count in counts)
        return _bounded(f"{total} matches for {quoted} in {len(counts)} files under {path}:\n{listed}")

    return Tool(
        "search",
        "Search the sandbox's files for a term (fixed text, not a pattern): in a directory (default: the working "
        "directory; hidden directories skipped) it lists the files that hold it, with counts; in a file, the "
        "lines that hold it, numbered.",
        {
            "type": "object",
            "properties": {
                "search_term": {"type": "string", "description": "the text to look for"},
                "path": {"type": "string", "description": "file or directory to search (default: the workdir)"},
            },
            "required": ["search_term"],
        },
        run,
    )


def _file_matches(found: str, quoted: str, path: str) -> str:
    lines = _lines(found)
    if not lines:
        return f"No matches for {quoted} in {path}."
    shown = []
    for line in lines[:MAX_SEARCH_LINES]:
        number, _, text = line.partition(":")
        shown.append(f"{number:>6}\t{text}" if number.isdigit() else line)
    more = f"\n[more than {MAX_SEARCH_LINES} lines match: only the first {MAX_SEARCH_LINES} are shown]"
    return f"Lines of {path} that hold {quoted}:\n" + "\n".join(shown) + (more if len(lines) > MAX_SEARCH_LINES else "")


# --- choosing a task's tools by name ----------------------------------------------------------------------------------

# Every tool a task can offer by name, each made with the task's tool timeout, in the order a task lists them best.
TOOLS: dict[str, Callable[[float], Tool]] = {
    "bash": bash_tool,
    "python": python_tool,
    "str_replace_editor": str_replace_editor_tool,
    "search": search_tool,
    "finish": lambda _timeout: FINISH,
}
TOOL_NAMES = tuple(TOOLS)
# The tools of a SWE episode with the editor: OpenHands' and R2E-Gym's set.
EDITOR_TOOLS = ("bash", "str_replace_editor", "search", "finish")


def swe_tools(names: Any, timeout: float) -> list[Tool]:
    """The tools named (of TOOLS), in the order given, each command bounded by `timeout` seconds; TaskConfigError
    (a ValueError) naming a name that is not one of them, a repeated one, or a list that is not one."""
    if isinstance(names, str) or not isinstance(names, list | tuple) or not names:
        raise TaskConfigError(f"'tools' must be a non-empty list of tool names, from {', '.join(TOOL_NAMES)}")
    for at, name in enumerate(names):
        if not isinstance(name, str) or name not in TOOLS:
            raise TaskConfigError(f"unknown tool {name!r} in 'tools'; the tools: {', '.join(TOOL_NAMES)}")
        if name in names[:at]:
            raise TaskConfigError(f"tool {name!r} is named twice in 'tools'")
    return [TOOLS[name](timeout) for name in names]
