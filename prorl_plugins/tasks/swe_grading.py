"""Grading an `swe` episode without running anything the agent could have touched.

The agent owns its whole working tree, `.git/` included (config, hooks, info/exclude, attributes), so grading never
runs the agent's git. The rollout service downloads a trusted view of the repository directory through the sandbox
runtime's file API, a tar.gz in which symlinks are stored as links and never followed, and this module, in pure
Python with no sandbox and no network, turns it into what to grade:

1. `agent_changes`: what the agent changed relative to the original files, the way `git add -A` would stage it;
2. `graded_tree`: the tree the tests run on, as a tar.gz: the original files with those changes applied, except that
   every test file is restored and nothing the agent put at, above or below a test file's path survives;
3. `parse_test_log` and `tests_verdict`: SWE-bench's FAIL_TO_PASS / PASS_TO_PASS idea over the test run's log.

What this does not defend against:

- The code under test runs with the agent's changes, so it can print fake result lines (`test_x (m.C.test_x) ... ok`,
  `PASSED t.py::test_x`). A fake line cannot hide a real failure line of the same test (a test's worst status wins),
  but it can stand in for a test that never reported. SWE-bench's log parsing has the same bar. What the agent may
  change is limited by swe_protected.py, and a runner it rewrites is caught by swe_canary.py, as far as that goes.
- git configuration is read by nobody, so a file hidden from git only through `core.excludesFile` stays in the
  agent's patch (its own new file: this makes the patch bigger, never smuggles a test file in or out).
- The graded tree can hold the agent's symlinks pointing anywhere. Nothing in it lies below a link, but whoever
  extracts it must still keep links as links, and decide what a link out of the tree means (the sandbox runtime's
  unpack refuses the whole archive).
"""

from __future__ import annotations

import difflib
import gzip
import io
import re
import tarfile
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import pathspec

REGULAR = 0o644
EXECUTABLE = 0o755
_DIRECTORY = 0o755
# git records a file as 100755 when its owner may execute it, and as 100644 otherwise: no other mode bit is tracked.
_OWNER_EXECUTE = 0o100

MAX_MEMBERS = 200_000
"""Archives with more entries are refused: tarfile keeps every header in memory, and a big real repository with its
`.git` objects and an in-tree virtualenv stays well below this."""

# The directory-match marker in pathspec's gitignore regexes, set when a pattern matched one of the path's parent
# directories rather than the path itself (pathspec 0.12 and 1.x both name it so).
_PARENT_MATCH_GROUP = "ps_d"


# --- Reading the agent's tree ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentChanges:
    """What the agent changed relative to the original files, as `git add -A` would stage it."""

    written: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    """path -> (content, REGULAR or EXECUTABLE): files added, or changed in content or in the executable bit."""
    symlinks: dict[str, str] = field(default_factory=dict)
    """path -> target: symlinks that are new or replace an original file."""
    deleted: frozenset[str] = frozenset()
    """Original paths that are neither a file nor a symlink in the agent's tree any more."""


@dataclass(frozen=True)
class _Tree:
    files: dict[str, tuple[bytes, int]]
    symlinks: dict[str, str]


def agent_changes(agent_tree: bytes, original: Mapping[str, str | bytes], max_bytes: int = 64 << 20) -> AgentChanges:
    """The agent's changes, from `agent_tree` (a tar.gz of its repository directory, member names relative to it).

    Everything below `.git` is left out (git cannot track it), except that `.git/info/exclude` is read, with every
    `.gitignore` in the tree, as data: a new file that git would ignore is not part of the agent's patch, exactly as
    `git add -A` would not stage it. That only ever drops the agent's own new files; original (tracked) paths are never
    ignored. Raises ValueError for an unreadable archive, one with an absolute or `..` member name, one with more than
    `max_bytes` of file content or more than MAX_MEMBERS entries.
    """
    originals = {_checked_path(path): _as_bytes(content) for path, content in original.items()}
    tree = _read_tree(agent_tree, max_bytes)
    exclude = tree.files.get(".git/info/exclude", (b"", 0))[0]
    files = {path: entry for path, entry in tree.files.items() if not _git_cannot_track(path)}
    symlinks = {path: target for path, target in tree.symlinks.items() if not _git_cannot_track(path)}
    gitignores = {_parent(path): content for path, (content, _) in files.items() if _name(path) == ".gitignore"}
    rules = _IgnoreRules(gitignores, exclude)

    def staged(path: str) -> bool:
        return path in originals or not rules.ignores(path)

    written = {}
    for path, (content, mode) in files.items():
        mode = _git_mode(mode)
        unchanged = originals.get(path) == content and mode == REGULAR  # the original files are never executable
        if not unchanged and staged(path):
            written[path] = (content, mode)
    return AgentChanges(
        written=written,
        symlinks={path: target for path, target in symlinks.items() if staged(path)},
        deleted=frozenset(path for path in originals if path not in files and path not in symlinks),
    )


def repository_tree(archive: bytes, max_bytes: int = 64 << 20) -> tuple[dict[str, tuple[bytes, int]], dict[str, str]]:
    """A repository's files, path -> (content, REGULAR or EXECUTABLE), and symlinks, path -> target, from a tar.gz
    of its directory, leaving out what git cannot track (everything below `.git`); ValueError as for
    `agent_changes`. For a tree nobody but eval has touched, such as a fresh checkout."""
    tree = _read_tree(archive, max_bytes)
    files = {path: (content, _git_mode(mode)) for path, (content, mode) in tree.files.items()}
    return (
        {path: entry for path, entry in files.items() if not _git_cannot_track(path)},
        {path: target for path, target in tree.symlinks.items() if not _git_cannot_track(path)},
    )


DIFF_FILE_BYTES = 1 << 20
"""A text file over this size, before or after, is shown as a binary change (`Binary files ... differ`): a megabyte
of diff is more than a person or a trainer reads, and the patch travels in every trajectory."""
DIFF_TOTAL_BYTES = 8 << 20
"""Text diffed in one patch, in all (both sides); the files after that budget is spent are shown as binary changes."""
DIFF_EXACT_BYTES = 128 << 10
"""Changed text (a file's lines between its common first and last lines, both sides) that difflib matches line by
line, in all; beyond it a file's changed lines are written as one hunk, all removed then all added: still a patch
that applies, made in linear time. difflib is quadratic in repeated lines (1 MiB of 150 distinct lines took 64 s
here, 128 KiB 1.2 s; one 60 MB file 15.6 s and 4.5 GB): this bounds a patch's time whatever the agent wrote."""
_CONTEXT = 3  # lines of context around a change, as git and difflib write them


def unified_patch(changes: AgentChanges, original: Mapping[str, str | bytes]) -> str:
    """`bounded_patch`'s patch alone."""
    return bounded_patch(changes, original)[0]


def bounded_patch(changes: AgentChanges, original: Mapping[str, str | bytes]) -> tuple[str, list[str]]:
    """The agent's changes as a git-style unified diff (what ProRL's clients read as `git_patch`): text files line
    by line, a binary file as `Binary files ... differ`, a symlink as its target, and the text files left out for
    size (the `patch_truncated` artifact): what hides there is named. For a person or a trainer to read; grading
    never applies it (it writes `changes` itself). A text file's changed lines (between its common first and last
    lines, both sides) over DIFF_FILE_BYTES, or beyond DIFF_TOTAL_BYTES in all, are left out, shown as a binary
    change: a one-line fix in a big file is shown, and a big file put first cannot spend the budget on nothing."""
    originals = {path: _as_bytes(content) for path, content in original.items()}
    parts: list[str] = []
    truncated: list[str] = []
    budget, exact = DIFF_TOTAL_BYTES, [DIFF_EXACT_BYTES]
    for path in sorted({*changes.written, *changes.symlinks, *changes.deleted}):
        before = originals.get(path)
        if path in changes.symlinks:
            after: bytes | None = changes.symlinks[path].encode()
            mode = "120000"
        elif path in changes.written:
            after, file_mode = changes.written[path]
            mode = "100755" if file_mode == EXECUTABLE else "100644"
        else:
            after, mode = None, "100644"
        header = [f"diff --git a/{path} b/{path}"]
        if before is None:
            header.append(f"new file mode {mode}")
        elif after is None:
            header.append(f"deleted file mode {mode}")
        elif mode != "100644":
            header += ["old mode 100644", f"new mode {mode}"]
        old_name = "/dev/null" if before is None else f"a/{path}"
        new_name = "/dev/null" if after is None else f"b/{path}"
        binary = "\n".join([*header, f"Binary files {old_name} and {new_name} differ"]) + "\n"
        before, after_bytes = before or b"", after or b""
        start, tail = _common_ends(before, after_bytes)
        old_changed, new_changed = before[start : len(before) - tail], after_bytes[start : len(after_bytes) - tail]
        if b"\0" in old_changed or b"\0" in new_changed:
            parts.append(binary)  # what git takes for binary: a NUL in the changed part
            continue
        size = len(old_changed) + len(new_changed)
        if max(len(old_changed), len(new_changed)) > DIFF_FILE_BYTES or size > budget:
            parts.append(binary)
            truncated.append(path)
            continue
        budget -= size
        # Only the changed lines and their context are split into lines: a one-line fix in a 60 MB file is cheap.
        first = start
        for _ in range(_CONTEXT):
            first = before.rfind(b"\n", 0, max(0, first - 1)) + 1 if first else 0
        common_tail = before[len(before) - tail :] if tail else b""
        extra = 0
        for _ in range(_CONTEXT + 1):
            found = common_tail.find(b"\n", extra)
            extra = len(common_tail) if found < 0 else found + 1
        try:
            old_lines = before[first : len(before) - tail + extra].decode().splitlines(keepends=True)
            new_lines = after_bytes[first : len(after_bytes) - tail + extra].decode().splitlines(keepends=True)
        except UnicodeDecodeError:
            parts.append(binary)
            continue
        offset = before.count(b"\n", 0, first)
        diff = _unified_diff(old_lines, new_lines, old_name, new_name, exact, offset)
        body = "".join(_ended(line) for line in diff)
        parts.append("\n".join(header) + "\n" + body)
    return "".join(parts), truncated


def _common_ends(before: bytes, after: bytes) -> tuple[int, int]:
    """The byte where both sides' first difference's line starts, and how many bytes both end with (not reaching
    back past that line's start): what lies between is what a diff shows, less its context. Linear time."""
    limit = min(len(before), len(after))
    start = 0
    step = 1 << 16
    while start < limit:  # in blocks, then byte by byte in the block that differs
        end = min(start + step, limit)
        if before[start:end] == after[start:end]:
            start = end
            continue
        while before[start] == after[start]:
            start += 1
        break
    start = before.rfind(b"\n", 0, start) + 1  # back to the start of the line
    tail = 0
    while tail < limit - start:
        size = min(step, limit - start - tail)
        if (
            before[len(before) - tail - size : len(before) - tail]
            == after[len(after) - tail - size : len(after) - tail]
        ):
            tail += size
            continue
        while before[len(before) - tail - 1] == after[len(after) - tail - 1]:
            tail += 1
        break
    return start, tail


def _unified_diff(
    old: list[str], new: list[str], old_name: str, new_name: str, exact: list[int], offset: int = 0
) -> list[str]:
    """difflib's unified diff of two texts' lines, computed on what lies between their common first and last lines
    (a fix in a big file is a small change), and matched line by line only while `exact[0]` bytes of such changed
    text are left; else the changed lines as one hunk."""
    if old == new:
        return []
    prefix = 0
    while prefix < min(len(old), len(new)) and old[prefix] == new[prefix]:
        prefix += 1
    suffix = 0
    while suffix < min(len(old), len(new)) - prefix and old[-1 - suffix] == new[-1 - suffix]:
        suffix += 1
    start = max(0, prefix - _CONTEXT)
    old_window, new_window = (
        old[start : len(old) - max(0, suffix - _CONTEXT)],
        new[start : len(new) - max(0, suffix - _CONTEXT)],
    )
    changed = sum(map(len, old[prefix : len(old) - suffix])) + sum(map(len, new[prefix : len(new) - suffix]))
    header = [f"--- {old_name}\n", f"+++ {new_name}\n"]
    if changed <= exact[0]:
        exact[0] -= changed
        lines = list(difflib.unified_diff(old_window, new_window, old_name, new_name))
        return header + [_shifted(line, start + offset) if line.startswith("@@") else line for line in lines[2:]]
    lead, trail = prefix - start, len(old_window) - (len(old) - suffix - start)
    hunk = f"@@ -{_range(start + offset, len(old_window))} +{_range(start + offset, len(new_window))} @@\n"
    return [
        *header,
        hunk,
        *(" " + line for line in old_window[:lead]),
        *("-" + line for line in old_window[lead : len(old_window) - trail]),
        *("+" + line for line in new_window[lead : len(new_window) - trail]),
        *(" " + line for line in old_window[len(old_window) - trail :]),
    ]


def _range(start: int, length: int) -> str:
    """A hunk's range as difflib and git write it: `first,length`, `first` for one line, the line before for none."""
    if length == 1:
        return str(start + 1)
    return f"{start + 1 if length else start},{length}"


def _shifted(hunk_header: str, offset: int) -> str:
    """`@@ -a,b +c,d @@` of a window that starts `offset` lines into the file, as the whole file's."""
    return re.sub(r"([-+])(\d+)", lambda m: f"{m[1]}{int(m[2]) + offset}", hunk_header, count=2)


def _ended(line: str) -> str:
    """A diff line as git writes it: a last line without its newline is marked so."""
    return line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"


def _read_tree(archive: bytes, max_bytes: int) -> _Tree:
    """Every regular file (hard links resolved) and symlink in the archive, `.git` included; other entries skipped."""
    files: dict[str, tuple[bytes, int]] = {}
    symlinks: dict[str, str] = {}
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            for count, member in enumerate(tar, start=1):
                if count > MAX_MEMBERS:
                    raise ValueError(f"the repository archive has more than {MAX_MEMBERS} entries")
                path = _member_path(member.name)
                if path is None:
                    continue  # the repository directory itself
                # A later entry of the same name replaces an earlier one, as it would on extraction.
                files.pop(path, None)
                symlinks.pop(path, None)
                if member.isreg():
                    total += member.size
                    _check_size(total, max_bytes)  # before reading, so an oversized file is never decompressed
                    files[path] = (tar.extractfile(member).read(), member.mode)
                elif member.islnk():
                    # A hard link names an earlier entry (possibly below .git) and shares its content and mode.
                    linked = files.get(_member_path(member.linkname) or "")
                    if linked is not None:
                        total += len(linked[0])
                        _check_size(total, max_bytes)
                        files[path] = linked
                elif member.issym():
                    symlinks[path] = member.linkname
                # Directories are implied by their contents; FIFOs and devices have nothing to grade.
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"the repository archive is not a readable tar.gz: {exc}") from exc
    return _Tree(files, symlinks)


def _check_size(total: int, max_bytes: int) -> None:
    if total > max_bytes:
        raise ValueError(f"the repository archive holds more than {max_bytes} bytes of file content")


def _member_path(name: str) -> str | None:
    """An archive member's path relative to the repository directory ('./a' and 'a' alike), None for the directory."""
    if name.startswith("/"):
        raise ValueError(f"the repository archive has a member with an absolute name: {name!r}")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"the repository archive has a member name with '..': {name!r}")
    return "/".join(parts) or None


def _git_cannot_track(path: str) -> bool:
    # git refuses to track any path with a `.git` component, in any letter case (verify_path in git's read-cache.c).
    return any(part.lower() == ".git" for part in path.split("/"))


def _git_mode(mode: int) -> int:
    return EXECUTABLE if mode & _OWNER_EXECUTE else REGULAR


# --- git's ignore rules, read as data ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _IgnorePattern:
    """One line of an ignore file."""

    matcher: pathspec.Pattern
    ignores: bool  # False for a "!" line, which re-includes what an earlier line ignored
    directories_only: bool  # written with a trailing "/"

    def verdict(self, path: str, is_dir: bool) -> bool | None:
        """True (ignore) or False (re-include) when this pattern matches `path` itself, else None."""
        if self.directories_only and not is_dir:
            return None
        match = self.matcher.match_file(path)
        # pathspec also matches every path below a matching directory, marking those matches; git matches a pattern
        # against the path itself and deals with directories by not looking inside ignored ones, which
        # `_IgnoreRules` does. A match through a parent is therefore not a match of this path.
        if match is None or match.match.groupdict().get(_PARENT_MATCH_GROUP) is not None:
            return None
        return self.ignores


def _ignore_patterns(text: bytes) -> tuple[_IgnorePattern, ...]:
    """The patterns of one ignore file, parsed as git does (dir.c: add_patterns_from_buffer, add_pattern)."""
    patterns = []
    for raw_line in text.decode("utf-8", "surrogateescape").removeprefix("\ufeff").split("\n"):
        line = _strip_trailing_spaces(raw_line.removesuffix("\r"))
        if not line or line.startswith("#"):
            continue
        ignores = not line.startswith("!")
        body = line if ignores else line[1:]
        # The trailing "/" and the leading "!" are taken off here, so that pathspec only sees the glob: the glob's
        # match is then exact, and "directories only" is applied by `_IgnorePattern.verdict`.
        directories_only = body.endswith("/")
        body = body.removesuffix("/")
        if body.startswith(("!", "#")):
            body = "\\" + body  # literal now that it no longer starts the line
        if not body:
            continue
        try:
            compiled = pathspec.GitIgnoreSpec.from_lines([body]).patterns
        except (ValueError, re.error):  # a glob pathspec cannot compile: the agent's own file, so skip the line
            continue
        if compiled and compiled[0].include is not None:
            patterns.append(_IgnorePattern(compiled[0], ignores, directories_only))
    return tuple(patterns)


def _strip_trailing_spaces(line: str) -> str:
    """Trailing spaces are dropped unless the first of them is escaped with a backslash (git: trim_trailing_spaces)."""
    end = len(line.rstrip(" "))
    backslashes = end - len(line[:end].rstrip("\\"))
    if backslashes % 2 and end < len(line):
        end += 1
    return line[:end]


_Scope = tuple[tuple[str, tuple[_IgnorePattern, ...]], ...]
"""The ignore files in force inside one directory: (the directory each applies to, its patterns), lowest precedence
first."""


class _IgnoreRules:
    """Which untracked paths `git add -A` would skip, from a tree's `.gitignore` files and `.git/info/exclude`.

    As in git: `.git/info/exclude` applies everywhere, below every `.gitignore`; a `.gitignore` applies to the paths
    below its own directory, a deeper one taking precedence; within one file the last matching line decides; and
    inside an ignored directory everything is ignored (nothing there can be re-included, and its `.gitignore` files
    are not read).
    """

    def __init__(self, gitignores: Mapping[str, bytes], info_exclude: bytes) -> None:
        self._gitignores = {directory: _ignore_patterns(text) for directory, text in gitignores.items()}
        root: _Scope = (("", _ignore_patterns(info_exclude)),)
        if "" in self._gitignores:
            root += (("", self._gitignores[""]),)
        self._scopes: dict[str, _Scope | None] = {"": root}

    def ignores(self, path: str) -> bool:
        scope = self._scope(_parent(path))
        return scope is None or _decide(scope, path, is_dir=False)

    def _scope(self, directory: str) -> _Scope | None:
        """The ignore files in force inside `directory`, or None when git would not look inside it."""
        scope = self._scopes[""]
        parts = directory.split("/") if directory else []
        for depth in range(1, len(parts) + 1):
            sub = "/".join(parts[:depth])
            if sub not in self._scopes:
                if scope is not None and _decide(scope, sub, is_dir=True):
                    scope = None
                elif scope is not None and sub in self._gitignores:
                    scope = (*scope, (sub, self._gitignores[sub]))
                self._scopes[sub] = scope
            scope = self._scopes[sub]
        return scope


def _decide(scope: _Scope, path: str, is_dir: bool) -> bool:
    for base, patterns in reversed(scope):
        relative = path[len(base) + 1 :] if base else path
        for pattern in reversed(patterns):
            verdict = pattern.verdict(relative, is_dir)
            if verdict is not None:
                return verdict
    return False


# --- The tree to grade -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _File:
    content: bytes
    mode: int


@dataclass(frozen=True)
class _Link:
    target: str


def graded_tree(
    original: Mapping[str, str | bytes], test_files: Mapping[str, str | bytes], changes: AgentChanges
) -> bytes:
    """The tree to run the tests on, as a tar.gz with member names relative to the repository directory.

    It is `original` with the agent's changes applied, then every path in `test_files` restored to its content there;
    whatever the agent put where a test file's directory should be, or below a test file's path, is dropped, as is
    anything of the agent's below a symlink (extracting it would write through the link).
    """
    for path in (*original, *test_files, *changes.written, *changes.symlinks, *changes.deleted):
        _checked_path(path)
    tree: dict[str, _File | _Link] = {path: _File(_as_bytes(content), REGULAR) for path, content in original.items()}
    for path in changes.deleted:
        tree.pop(path, None)
    tree.update({path: _File(content, _git_mode(mode)) for path, (content, mode) in changes.written.items()})
    tree.update({path: _Link(target) for path, target in changes.symlinks.items()})

    tests = {path: _File(_as_bytes(content), REGULAR) for path, content in test_files.items()}
    test_dirs = {directory for path in tests for directory in _ancestors(path)}
    tree = {
        path: entry
        for path, entry in tree.items()
        if path not in test_dirs and not any(directory in tests for directory in _ancestors(path))
    }
    tree.update(tests)
    # Nothing can live below a file or a link; a test file's directories were cleared above, so tests all stay.
    tree = {path: entry for path, entry in tree.items() if not any(d in tree for d in _ancestors(path))}
    return _tar_gz(tree)


def _tar_gz(tree: Mapping[str, _File | _Link]) -> bytes:
    """A deterministic tar.gz of `tree`: sorted members, explicit directories, no times, owners or host names."""
    buffer = io.BytesIO()
    with (
        gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped,
        tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar,
    ):
        for directory in sorted({d for path in tree for d in _ancestors(path)}):
            tar.addfile(_member(directory, tarfile.DIRTYPE, _DIRECTORY))
        for path, entry in sorted(tree.items()):
            if isinstance(entry, _Link):
                member = _member(path, tarfile.SYMTYPE, 0o777)
                member.linkname = entry.target
                tar.addfile(member)
            else:
                member = _member(path, tarfile.REGTYPE, entry.mode)
                member.size = len(entry.content)
                tar.addfile(member, io.BytesIO(entry.content))
    return buffer.getvalue()


def _member(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    member = tarfile.TarInfo(name)
    member.type = kind
    member.mode = mode
    return member


def _checked_path(path: str) -> str:
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", ".", "..") for part in parts) or _git_cannot_track(path):
        raise ValueError(f"not a plain relative path inside the repository: {path!r}")
    return path


def _as_bytes(content: str | bytes) -> bytes:
    return content.encode() if isinstance(content, str) else content


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _name(path: str) -> str:
    return path.rpartition("/")[2]


def _ancestors(path: str) -> list[str]:
    """'a/b/c' -> ['a', 'a/b']."""
    parts = path.split("/")
    return ["/".join(parts[:depth]) for depth in range(1, len(parts))]


# --- The test log ------------------------------------------------------------------------------------------------
# Why not swebench's own parsers: `swebench.harness` imports its docker and modal modules at import time, and the
# package pulls datasets, docker, modal and ghapi into a service that needs none of them. The formats follow its
# `parse_log_pytest` (pytest -rA) and `parse_log_django` (unittest -v), with test names normalised so that both
# Python's pre-3.11 and 3.11+ spellings of a unittest name match.

PASSED, FAILED, ERROR, SKIPPED = "PASSED", "FAILED", "ERROR", "SKIPPED"
# A test reported more than once keeps its worst status: a teardown error after a pass is an error, and a printed
# fake "ok" cannot hide a real failure line of the same test.
_SEVERITY = {PASSED: 0, SKIPPED: 1, FAILED: 2, ERROR: 3}
FRAMEWORKS = ("unittest", "pytest")

_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def parse_test_log(log: str, framework: str) -> dict[str, str]:
    """Test name -> PASSED, FAILED, ERROR or SKIPPED, from the merged stdout and stderr of a test run.

    framework "unittest" reads `python -m unittest -v` (and Django's runner at verbosity 2), keyed as
    `module.Class.test_name`; "pytest" reads `pytest -rA` summary lines and `-v` progress lines, keyed by node id.
    """
    _check_framework(framework)
    log = _ANSI_COLOUR.sub("", log)
    return _parse_unittest(log) if framework == "unittest" else _parse_pytest(log)


def normalise_test_name(name: str, framework: str) -> str:
    """The key `parse_test_log` uses for `name`: for unittest, 'test_x (m.C)' and 'test_x (m.C.test_x)' both become
    'm.C.test_x', and 'm.C.test_x' stays as it is; pytest node ids are kept as they are."""
    _check_framework(framework)
    name = name.strip()
    if framework == "unittest" and (test := _UNITTEST_TEST.fullmatch(name)):
        return _unittest_key(test)
    return name


def tests_verdict(statuses: Mapping[str, str], must_pass: list[str], framework: str) -> tuple[bool, list[str]]:
    """Whether every test in `must_pass` appears in `statuses` as PASSED, and 'name: STATUS' for each that did not.

    A test the log never mentions is 'missing' and fails: a run that stopped early or never started does not pass.
    An empty `must_pass` passes, so the caller makes sure an instance names at least one FAIL_TO_PASS test.
    """
    seen: dict[str, str] = {}
    for name, status in statuses.items():
        _record(seen, normalise_test_name(name, framework), status)
    failures = []
    for name in dict.fromkeys(must_pass):
        status = seen.get(normalise_test_name(name, framework), "missing")
        if status != PASSED:
            failures.append(f"{name}: {status}")
    return not failures, failures


def _check_framework(framework: str) -> None:
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown test framework {framework!r}; known: {', '.join(FRAMEWORKS)}")


def _record(statuses: dict[str, str], name: str, status: str) -> None:
    worst = len(_SEVERITY)  # a status this module does not know counts as worse than any
    if name not in statuses or _SEVERITY.get(status, worst) > _SEVERITY.get(statuses[name], worst):
        statuses[name] = status


# "test_x (m.C)" before Python 3.11, "test_x (m.C.test_x)" since; a subtest adds " (i=1)".
_UNITTEST_TEST = re.compile(r"(?P<method>test\w*) \((?P<where>[\w.]+)\)")
_UNITTEST_HEADER = re.compile(rf"{_UNITTEST_TEST.pattern}(?: \(.*\))?")
_UNITTEST_REPORT = re.compile(rf"(?P<kind>FAIL|ERROR|UNEXPECTED SUCCESS): {_UNITTEST_TEST.pattern}")
_UNITTEST_REPORT_STATUS = {"FAIL": FAILED, "ERROR": ERROR, "UNEXPECTED SUCCESS": FAILED}
_UNITTEST_RESULTS = {
    "ok": PASSED,
    "FAIL": FAILED,
    "ERROR": ERROR,
    "expected failure": PASSED,
    "unexpected success": FAILED,  # unittest counts it as a failure of the run
}
_UNITTEST_DIVIDERS = ("=" * 10, "-" * 10, "Ran ")  # the failure reports and the totals after the verbose lines


def _unittest_key(test: re.Match[str]) -> str:
    method, where = test["method"], test["where"]
    return where if where.endswith(f".{method}") else f"{where}.{method}"


def _unittest_result(text: str) -> str | None:
    text = text.strip()
    if text == "skipped" or text.startswith("skipped "):
        return SKIPPED
    return _UNITTEST_RESULTS.get(text)


def _parse_unittest(log: str) -> dict[str, str]:
    """unittest -v writes `description ... result`, where the description is `test_x (m.C.test_x)`, or that line
    followed by the docstring's first line on the next, and the result may come lines later when the test's own
    output got in between. Python before 3.11 can even put the next test's description right after a subtest's
    ` ... `."""
    statuses: dict[str, str] = {}
    waiting: str | None = None  # the test whose result has not been seen yet
    for line in log.splitlines():
        if report := _UNITTEST_REPORT.match(line):
            _record(statuses, _unittest_key(report), _UNITTEST_REPORT_STATUS[report["kind"]])
            waiting = None
            continue
        if line.startswith(_UNITTEST_DIVIDERS):
            waiting = None
            continue
        segments = line.split(" ... ")
        for index, segment in enumerate(segments):
            if header := _UNITTEST_HEADER.fullmatch(segment.strip()):
                waiting = _unittest_key(header)
                continue
            # A result follows a " ... ", or is a line of its own after the test's output.
            status = _unittest_result(segment) if index > 0 or len(segments) == 1 else None
            if waiting is None or status is None:
                continue
            _record(statuses, waiting, status)
            if index > 0 and not _UNITTEST_HEADER.fullmatch(segments[index - 1].strip()):
                # "Docstring line ... ok": SWE-bench's Django instances name such a test by its docstring line.
                _record(statuses, segments[index - 1].strip(), status)
            waiting = None
    return statuses


_PYTEST_STATUSES = {
    "PASSED": PASSED,
    "FAILED": FAILED,
    "ERROR": ERROR,
    "SKIPPED": SKIPPED,
    "XFAIL": PASSED,  # as SWE-bench counts it, and as unittest's "expected failure"
    "XPASS": PASSED,  # a non-strict xfail that passed; a strict one is reported as FAILED
}
_PYTEST_WORD = "|".join(_PYTEST_STATUSES)
_PYTEST_SUMMARY = re.compile(rf"(?P<status>{_PYTEST_WORD}) (?P<rest>\S.*)")  # -rA: "FAILED t.py::test_x - message"
_PYTEST_PROGRESS = re.compile(rf"(?P<name>\S+::.+?) (?P<status>{_PYTEST_WORD})(?:\s.*)?")  # -v: "t.py::x PASSED [50%]"


def _parse_pytest(log: str) -> dict[str, str]:
    statuses: dict[str, str] = {}
    for line in log.splitlines():
        line = line.rstrip()
        if summary := _PYTEST_SUMMARY.fullmatch(line):
            name = summary["rest"]
            if summary["status"] != "PASSED":
                name = name.split(" - ", 1)[0]  # the message after the node id
            if name.startswith("["):
                continue  # "SKIPPED [1] t.py:12: reason" names a place, not a test
            _record(statuses, name.strip(), _PYTEST_STATUSES[summary["status"]])
        elif progress := _PYTEST_PROGRESS.fullmatch(line):
            _record(statuses, progress["name"], _PYTEST_STATUSES[progress["status"]])
    return statuses
