"""Tests for prorl_plugins.tasks.swe_grading: the agent's changes from a trusted archive of its repository, the tree
to grade, and the test-log verdict.

Archives are built in memory with tarfile, shaped like the sandbox runtime's `pack` (names relative to the repository,
symlinks stored as links). Where git is installed, the ignore rules are also checked against real `git add -A`.
"""

from __future__ import annotations

import gzip
import io
import os
import random
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest

from prorl_plugins.tasks import swe_grading
from prorl_plugins.tasks.swe_grading import (
    AgentChanges,
    agent_changes,
    graded_tree,
    normalise_test_name,
    parse_test_log,
    unified_patch,
)

# Imported under another name: pytest would collect a module-level `tests_verdict` as a test.
from prorl_plugins.tasks.swe_grading import tests_verdict as verdict

ORIGINAL = {
    "pkg/__init__.py": "",
    "pkg/calc.py": "def add(a, b):\n    return a - b\n",
    "README.md": "calc\n",
}
TESTS = {"tests/test_calc.py": "from pkg.calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n"}
ORIGINAL_WITH_TESTS = {**ORIGINAL, **TESTS}  # everything the repository's first commit tracks
GIT_DIR = {".git/HEAD": "ref: refs/heads/main\n", ".git/config": "[core]\n", ".git/info/exclude": "# nothing\n"}


def archive(
    files: dict[str, str | bytes],
    *,
    modes: dict[str, int] | None = None,
    symlinks: dict[str, str] | None = None,
    prefix: str = "",
    fifos: tuple[str, ...] = (),
    hardlinks: dict[str, str] | None = None,
) -> bytes:
    """A tar.gz of a repository directory: explicit parent directories, then files, links and FIFOs."""
    modes, symlinks, hardlinks = modes or {}, symlinks or {}, hardlinks or {}
    paths = [*files, *symlinks, *fifos, *hardlinks]
    directories = sorted({"/".join(p.split("/")[:i]) for p in paths for i in range(1, len(p.split("/")))})
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        if prefix:
            tar.addfile(_info(".", tarfile.DIRTYPE, 0o755))
        for directory in directories:
            tar.addfile(_info(prefix + directory, tarfile.DIRTYPE, 0o755))
        for path, content in files.items():
            data = content.encode() if isinstance(content, str) else content
            info = _info(prefix + path, tarfile.REGTYPE, modes.get(path, 0o644))
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for path, target in symlinks.items():
            info = _info(prefix + path, tarfile.SYMTYPE, 0o777)
            info.linkname = target
            tar.addfile(info)
        for path in fifos:
            tar.addfile(_info(prefix + path, tarfile.FIFOTYPE, 0o644))
        for path, target in hardlinks.items():
            info = _info(prefix + path, tarfile.LNKTYPE, 0o644)
            info.linkname = prefix + target
            tar.addfile(info)
    return buffer.getvalue()


def _info(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.mode = kind, mode
    return info


def repo(changes: dict[str, str | bytes | None] | None = None) -> dict[str, str | bytes]:
    """The agent's tree: the original repository with its tests and .git, then `changes` (None deletes a path)."""
    files: dict[str, str | bytes] = {**ORIGINAL, **TESTS, **GIT_DIR}
    for path, content in (changes or {}).items():
        if content is None:
            files.pop(path)
        else:
            files[path] = content
    return files


def read_tree(data: bytes) -> dict[str, tuple[str, int, bytes | str]]:
    """name -> (kind, mode, content or link target) of a graded tree."""
    out = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar:
            if member.isdir():
                out[member.name] = ("dir", member.mode, b"")
            elif member.issym():
                out[member.name] = ("link", member.mode, member.linkname)
            else:
                out[member.name] = ("file", member.mode, tar.extractfile(member).read())
    return out


def files_of(data: bytes) -> dict[str, bytes | str]:
    return {name: content for name, (kind, _, content) in read_tree(data).items() if kind != "dir"}


# --- agent_changes --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix", ["", "./"])
def test_unchanged_tree_has_no_changes(prefix: str) -> None:
    changes = agent_changes(archive(repo(), prefix=prefix), ORIGINAL_WITH_TESTS)
    assert changes == AgentChanges()


def test_modified_new_and_deleted_files() -> None:
    tree = repo({"pkg/calc.py": "def add(a, b):\n    return a + b\n", "pkg/util.py": b"X = 1\n", "README.md": None})
    changes = agent_changes(archive(tree, prefix="./"), ORIGINAL_WITH_TESTS)
    assert changes.written == {
        "pkg/calc.py": (b"def add(a, b):\n    return a + b\n", 0o644),
        "pkg/util.py": (b"X = 1\n", 0o644),
    }
    assert changes.symlinks == {}
    assert changes.deleted == {"README.md"}


def test_original_given_as_bytes_or_str_compares_the_same() -> None:
    as_bytes = {path: content.encode() for path, content in ORIGINAL_WITH_TESTS.items()}
    assert agent_changes(archive(repo()), as_bytes) == AgentChanges()
    unicode = {"naïve.txt": "café ☕\n"}
    assert agent_changes(archive({"naïve.txt": "café ☕\n"}), unicode) == AgentChanges()


def test_only_the_executable_bit_of_a_mode_counts() -> None:
    modes = {"pkg/calc.py": 0o755, "README.md": 0o600, "pkg/__init__.py": 0o664}
    changes = agent_changes(archive(repo(), modes=modes), ORIGINAL_WITH_TESTS)
    assert changes.written == {"pkg/calc.py": (ORIGINAL["pkg/calc.py"].encode(), 0o755)}
    new_script = agent_changes(archive(repo({"run.sh": "#!/bin/sh\n"}), modes={"run.sh": 0o700}), ORIGINAL_WITH_TESTS)
    assert new_script.written == {"run.sh": (b"#!/bin/sh\n", 0o755)}


def test_everything_under_git_is_ignored() -> None:
    tree = repo(
        {
            ".git/hooks/pre-commit": "#!/bin/sh\nevil\n",
            ".git/config": "[core]\n\thooksPath = /tmp\n",
            ".git/objects/ab/cdef": b"\x00\x01",
            "vendor/ext/.git": "gitdir: ../../.git/modules/ext\n",
            "vendor/x/.GIT/config": "[core]\n",
        }
    )
    changes = agent_changes(archive(tree, symlinks={".git/evil": "/etc/passwd"}), ORIGINAL_WITH_TESTS)
    assert changes == AgentChanges()


def test_new_file_hidden_by_info_exclude_is_not_a_change() -> None:
    # A planted module that would shadow the standard library for the tests, hidden from `git status`.
    tree = repo({"unittest.py": "raise SystemExit(0)\n", ".git/info/exclude": "unittest.py\n", "keep.py": "ok\n"})
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    assert changes.written == {"keep.py": (b"ok\n", 0o644)}


def test_new_file_hidden_by_a_nested_gitignore_is_not_a_change() -> None:
    tree = repo(
        {
            "pkg/.gitignore": "*.log\n/local.py\n",
            "pkg/a.log": "x",
            "pkg/sub/c.log": "x",
            "b.log": "x",
            "pkg/local.py": "x",
            "pkg/sub/local.py": "x",
        }
    )
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    # pkg/.gitignore applies below pkg only, and "/local.py" is anchored to pkg.
    assert set(changes.written) == {"pkg/.gitignore", "b.log", "pkg/sub/local.py"}


def test_ignored_directory_hides_everything_below_it() -> None:
    tree = repo(
        {
            ".gitignore": "build/\n!build/keep.py\n",
            "build/keep.py": "1",
            "build/.gitignore": "!*\n",
            "build/deep/x.py": "2",
        }
    )
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    assert set(changes.written) == {".gitignore"}


def test_negation_and_deeper_gitignore_take_precedence() -> None:
    tree = repo(
        {
            ".gitignore": "*.py\n!pkg/*.py\n",
            "new.py": "1",
            "pkg/new.py": "2",
            "pkg/sub/.gitignore": "!*.py\n",
            "pkg/sub/deeper.py": "3",
            "other/x.py": "4",
        }
    )
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    assert set(changes.written) == {".gitignore", "pkg/new.py", "pkg/sub/.gitignore", "pkg/sub/deeper.py"}


def test_tracked_file_matching_an_ignore_pattern_is_still_a_change() -> None:
    tree = repo(
        {"pkg/calc.py": "fixed\n", "README.md": None, ".git/info/exclude": "*.py\n*.md\n", ".gitignore": "pkg/\n"}
    )
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    assert changes.written == {"pkg/calc.py": (b"fixed\n", 0o644), ".gitignore": (b"pkg/\n", 0o644)}
    assert changes.deleted == {"README.md"}


def test_ignore_rules_also_hide_new_symlinks() -> None:
    tree = repo({".gitignore": "link*\n"})
    symlinks = {"link_a": "pkg/calc.py", "pkg/alias.py": "calc.py"}
    changes = agent_changes(archive(tree, symlinks=symlinks), ORIGINAL_WITH_TESTS)
    assert changes.symlinks == {"pkg/alias.py": "calc.py"}


def test_a_symlinked_gitignore_is_not_read() -> None:
    # git (2.32+) does not follow a symlinked .gitignore; the target is the agent's own file anyway.
    tree = repo({"rules.txt": "secret.py\n", "secret.py": "1"})
    changes = agent_changes(archive(tree, symlinks={".gitignore": "rules.txt"}), ORIGINAL_WITH_TESTS)
    assert "secret.py" in changes.written
    assert changes.symlinks == {".gitignore": "rules.txt"}


def test_a_malformed_gitignore_line_is_skipped_not_fatal() -> None:
    tree = repo({".gitignore": "/[-\r^[{-#]?x\n[\n*.log\n", "a.log": "1", "a.py": "2"})
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    assert set(changes.written) == {".gitignore", "a.py"}


def test_symlink_replacing_an_original_file_is_a_change_not_a_deletion() -> None:
    tree = repo({"pkg/calc.py": None})
    changes = agent_changes(archive(tree, symlinks={"pkg/calc.py": "/etc/passwd"}), ORIGINAL_WITH_TESTS)
    assert changes.symlinks == {"pkg/calc.py": "/etc/passwd"}
    assert changes.deleted == frozenset()


def test_fifos_and_devices_are_skipped() -> None:
    changes = agent_changes(archive(repo(), fifos=("pipe",)), ORIGINAL_WITH_TESTS)
    assert changes == AgentChanges()


def test_hard_links_read_as_the_file_they_share() -> None:
    tree = repo({"pkg/calc.py": None, ".git/stash": "fixed\n"})
    changes = agent_changes(archive(tree, hardlinks={"pkg/calc.py": ".git/stash"}), ORIGINAL_WITH_TESTS)
    assert changes.written == {"pkg/calc.py": (b"fixed\n", 0o644)}
    assert changes.deleted == frozenset()


def test_oversized_archive_is_refused() -> None:
    tree = {"big.bin": b"\0" * 1000, "small": b"x" * 24}
    assert set(agent_changes(archive(tree), {}, max_bytes=1024).written) == {"big.bin", "small"}
    with pytest.raises(ValueError, match="more than 1023 bytes"):
        agent_changes(archive(tree), {}, max_bytes=1023)
    # .git content counts too: it is part of what had to be decompressed.
    with pytest.raises(ValueError, match="bytes of file content"):
        agent_changes(archive({".git/objects/pack/p": b"\0" * 2048}), {}, max_bytes=1024)


def test_archive_with_too_many_entries_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swe_grading, "MAX_MEMBERS", 5)
    assert agent_changes(archive({"a": "1", "b": "2", "c": "3"}), {}).written.keys() == {"a", "b", "c"}
    with pytest.raises(ValueError, match="more than 5 entries"):
        agent_changes(archive({"d/a": "1", "d/b": "2", "d/c": "3", "e/f": "4"}), {})


@pytest.mark.parametrize("name", ["/etc/passwd", "../outside", "a/../../b", "./../x"])
def test_unsafe_member_names_are_refused(name: str) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = _info(name, tarfile.REGTYPE, 0o644)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(ValueError, match=r"absolute|'\.\.'"):
        agent_changes(buffer.getvalue(), {})


@pytest.mark.parametrize("data", [b"", b"not a tarball", gzip.compress(b"not a tar either" * 100)])
def test_unreadable_archive_is_refused(data: bytes) -> None:
    with pytest.raises(ValueError, match=r"not a readable tar\.gz"):
        agent_changes(data, {})


def test_truncated_archive_is_refused() -> None:
    data = archive({"a.txt": os.urandom(4096)})
    with pytest.raises(ValueError, match=r"not a readable tar\.gz"):
        agent_changes(data[: len(data) // 2], {})


# --- agent_changes against real git ---------------------------------------------------------------------------------

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git_staged(root: Path, original: dict[str, str], agent_files: dict[str, str]) -> set[str]:
    """The paths `git add -A` stages as changed, in a real repository (our own files, never the agent's .git)."""
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(root),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
    }

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(root), *args], env=env, check=True, capture_output=True, text=True
        ).stdout

    git("init", "-q")
    for path, content in original.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(content)
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base", "--allow-empty")
    for path in original:
        (root / path).unlink()
    for path, content in agent_files.items():
        target = root / ".git/info/exclude" if path == ".git/info/exclude" else root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(content)
    git("add", "-A")
    return set(git("diff", "--cached", "--name-only", "--no-renames").splitlines())


def ours_staged(original: dict[str, str], agent_files: dict[str, str]) -> set[str]:
    changes = agent_changes(archive(agent_files), original)
    return set(changes.written) | set(changes.symlinks) | set(changes.deleted)


GIT_CASES = [
    {".git/info/exclude": "unittest.py\n", "unittest.py": "x", "a.py": "1"},
    {".gitignore": "*.log\n!keep.log\n", "a.log": "1", "keep.log": "2", "d/b.log": "3"},
    {".gitignore": "d/\n!d/x.py\n", "d/x.py": "1", "d/y.py": "2", "x.py": "3"},
    {".gitignore": "d/*\n!d/x.py\n", "d/x.py": "1", "d/y.py": "2"},
    {".gitignore": "*\n!*/\n!*.py\n", "a/b.py": "1", "a/c.txt": "2", "top.py": "3"},
    {".gitignore": "/a\n", "a": "1", "d/a": "2"},
    {".gitignore": "d/**\n!d/**/\n!d/**/*.py\n", "d/e/f.py": "1", "d/e/g.txt": "2", "d/h.txt": "3"},
    {"d/.gitignore": "/x\n*.tmp\n", "d/x": "1", "d/e/x": "2", "x": "3", "d/e/y.tmp": "4"},
    {".gitignore": "d\n", "d/.gitignore": "!x\n", "d/x": "1"},
    {".gitignore": "# comment\n\\#hash\n\\!bang\nspace\\ \ntrail   \n", "#hash": "1", "!bang": "2", "space ": "3"},
    {".gitignore": "trail   \r\nd/  \r\n", "trail": "1", "other": "2", "d/x": "3"},
    {".gitignore": "a/**/b\n", "a/b": "1", "a/x/y/b": "2", "a/x/c": "3"},
    {"src/.gitignore": "*.py\n", "src/pkg/.gitignore": "!mod.py\n", "src/pkg/mod.py": "1", "src/pkg/o.py": "2"},
    {".gitignore": "pkg/\n", "pkg/calc.py": "changed", "pkg/new.py": "new"},
]


@needs_git
@pytest.mark.parametrize("agent_files", GIT_CASES, ids=range(len(GIT_CASES)))
def test_ignore_rules_match_git(tmp_path: Path, agent_files: dict[str, str]) -> None:
    original = {"pkg/calc.py": "base\n", "keep.txt": "same\n"}
    agent_files = {"keep.txt": "same\n", **agent_files}
    if "pkg/calc.py" not in agent_files:
        agent_files["pkg/calc.py"] = "base\n"
    assert ours_staged(original, agent_files) == git_staged(tmp_path, original, agent_files)


@needs_git
def test_ignore_rules_match_git_on_random_trees(tmp_path: Path) -> None:
    patterns = [
        "*", "!*/", "*.py", "!*.py", "b/", "!b/", "b", "/b", "a/b", "b/*", "!b/c.py", "c.py", "**/c.py", "a/**",
        "!a/**/", "*.txt", "!k.txt", "d/", "a/b/", "**/b", "b/**", "!b/**", "a/**/", "b/**/", "[ab]", "?", "*/",
    ]  # fmt: skip
    rng = random.Random(20240601)
    for case in range(40):
        files: dict[str, str] = {}
        for _ in range(rng.randint(1, 8)):
            parts = [rng.choice("abd") for _ in range(rng.randint(0, 3))] + [rng.choice(["c.py", "x.txt", "k.txt"])]
            files["/".join(parts)] = "x"
        files = {f: c for f, c in files.items() if not any(g.startswith(f + "/") for g in files)}
        directories = sorted({""} | {f.rpartition("/")[0] for f in files})
        for directory in rng.sample(directories, k=min(len(directories), rng.randint(1, 3))):
            lines = [rng.choice(patterns) for _ in range(rng.randint(1, 4))]
            files[f"{directory}/.gitignore".lstrip("/")] = "\n".join(lines) + "\n"
        if rng.random() < 0.4:
            files[".git/info/exclude"] = "\n".join(rng.choice(patterns) for _ in range(2)) + "\n"
        root = tmp_path / str(case)
        root.mkdir()
        assert ours_staged({}, files) == git_staged(root, {}, files), files


# --- graded_tree ----------------------------------------------------------------------------------------------------


def test_graded_tree_applies_the_agent_changes() -> None:
    changes = AgentChanges(
        written={"pkg/calc.py": (b"fixed\n", 0o644), "tools/run.sh": (b"#!/bin/sh\n", 0o100755)},
        symlinks={"pkg/alias.py": "calc.py"},
        deleted=frozenset({"README.md"}),
    )
    tree = read_tree(graded_tree(ORIGINAL, TESTS, changes))
    assert tree == {
        "pkg": ("dir", 0o755, b""),
        "tests": ("dir", 0o755, b""),
        "tools": ("dir", 0o755, b""),
        "pkg/__init__.py": ("file", 0o644, b""),
        "pkg/alias.py": ("link", 0o777, "calc.py"),
        "pkg/calc.py": ("file", 0o644, b"fixed\n"),
        "tests/test_calc.py": ("file", 0o644, TESTS["tests/test_calc.py"].encode()),
        "tools/run.sh": ("file", 0o755, b"#!/bin/sh\n"),
    }


def test_graded_tree_is_deterministic() -> None:
    changes = AgentChanges(written={"b.py": (b"1", 0o644), "a/c.py": (b"2", 0o755)})
    assert graded_tree(ORIGINAL, TESTS, changes) == graded_tree(ORIGINAL, TESTS, changes)


def test_agent_edit_and_deletion_of_test_files_are_dropped() -> None:
    tests = {**TESTS, "tests/test_more.py": "def test_more():\n    assert False\n"}
    tree = repo({"tests/test_calc.py": "def test_add():\n    pass\n", "pkg/calc.py": "fixed\n"})
    changes = agent_changes(archive(tree), {**ORIGINAL, **tests})
    assert "tests/test_calc.py" in changes.written and changes.deleted == {"tests/test_more.py"}
    graded = files_of(graded_tree(ORIGINAL, tests, changes))
    assert graded["tests/test_calc.py"] == TESTS["tests/test_calc.py"].encode()
    assert graded["tests/test_more.py"] == tests["tests/test_more.py"].encode()
    assert graded["pkg/calc.py"] == b"fixed\n"


def test_symlink_over_a_test_file_is_dropped() -> None:
    tree = repo({"tests/test_calc.py": None, "tests/fake.py": "def test_add():\n    pass\n"})
    changes = agent_changes(archive(tree, symlinks={"tests/test_calc.py": "fake.py"}), ORIGINAL_WITH_TESTS)
    assert changes.symlinks == {"tests/test_calc.py": "fake.py"}
    graded = read_tree(graded_tree(ORIGINAL, TESTS, changes))
    assert graded["tests/test_calc.py"] == ("file", 0o644, TESTS["tests/test_calc.py"].encode())
    assert graded["tests/fake.py"][0] == "file"  # the agent's own new file stays; nothing imports it


@pytest.mark.parametrize(
    "changes",
    [
        AgentChanges(symlinks={"tests": "/tmp/mine"}, deleted=frozenset(TESTS)),
        AgentChanges(written={"tests": (b"x", 0o644)}, deleted=frozenset(TESTS)),
    ],
    ids=["symlink", "file"],
)
def test_symlink_or_file_over_a_test_directory_is_dropped(changes: AgentChanges) -> None:
    graded = read_tree(graded_tree(ORIGINAL, TESTS, changes))
    assert graded["tests"] == ("dir", 0o755, b"")
    assert graded["tests/test_calc.py"] == ("file", 0o644, TESTS["tests/test_calc.py"].encode())


def test_agent_change_below_a_test_file_path_is_dropped() -> None:
    changes = AgentChanges(
        written={"tests/test_calc.py/evil.py": (b"x", 0o644), "tests/conftest.py": (b"ok", 0o644)},
        deleted=frozenset(TESTS),
    )
    graded = files_of(graded_tree(ORIGINAL, TESTS, changes))
    assert "tests/test_calc.py/evil.py" not in graded
    assert graded["tests/test_calc.py"] == TESTS["tests/test_calc.py"].encode()
    assert graded["tests/conftest.py"] == b"ok"  # a new file beside the tests is the agent's patch (see module doc)


def test_a_file_under_a_symlinked_directory_is_dropped() -> None:
    changes = AgentChanges(
        written={"out/passwd": (b"root::0:0::/:/bin/sh\n", 0o644), "out/deep/x": (b"x", 0o644)},
        symlinks={"out": "/etc", "pkg/link": "..", "pkg/link/y": "z"},
    )
    graded = read_tree(graded_tree(ORIGINAL, TESTS, changes))
    assert graded["out"] == ("link", 0o777, "/etc")
    assert graded["pkg/link"] == ("link", 0o777, "..")
    assert not [name for name in graded if name.startswith(("out/", "pkg/link/"))]


def test_graded_tree_from_agent_changes_end_to_end() -> None:
    tree = repo(
        {
            "pkg/calc.py": "def add(a, b):\n    return a + b\n",
            "tests/test_calc.py": "def test_add():\n    pass\n",
            "unittest.py": "hidden\n",
            ".git/info/exclude": "unittest.py\n",
        }
    )
    changes = agent_changes(archive(tree), ORIGINAL_WITH_TESTS)
    graded = files_of(graded_tree(ORIGINAL, TESTS, changes))
    assert graded == {
        "pkg/__init__.py": b"",
        "pkg/calc.py": b"def add(a, b):\n    return a + b\n",
        "README.md": b"calc\n",
        "tests/test_calc.py": TESTS["tests/test_calc.py"].encode(),
    }


@pytest.mark.parametrize("path", ["/abs", "../up", "a/../b", "./a", "a//b", ".git/hooks/x", "x/.GIT/y", ""])
def test_graded_tree_refuses_paths_that_are_not_plain(path: str) -> None:
    with pytest.raises(ValueError, match="not a plain relative path"):
        graded_tree(ORIGINAL, TESTS, AgentChanges(written={path: (b"x", 0o644)}))


# --- parse_test_log: unittest ---------------------------------------------------------------------------------------

UNITTEST_311 = """\
test_a (test_m.C.test_a) ... hello from a
ok
test_doc (test_m.C.test_doc)
First docstring line. ... ok
test_err (test_m.C.test_err) ... ERROR
test_fail (test_m.C.test_fail) ... FAIL
test_skip (test_m.C.test_skip) ... skipped 'why not'
test_sub (test_m.C.test_sub) ...
  test_sub (test_m.C.test_sub) (i=1) ... FAIL
test_us (test_m.C.test_us) ... unexpected success
test_xf (test_m.C.test_xf) ... expected failure
ERROR

======================================================================
ERROR: setUpClass (test_m.D)
----------------------------------------------------------------------
Traceback (most recent call last):
RuntimeError: boom

======================================================================
FAIL: test_sub (test_m.C.test_sub) (i=1)
----------------------------------------------------------------------
ok
----------------------------------------------------------------------
Ran 9 tests in 0.001s

FAILED (failures=2, errors=2, skipped=1, expected failures=1, unexpected successes=1)
"""

EXPECTED_UNITTEST = {
    "test_m.C.test_a": "PASSED",
    "test_m.C.test_doc": "PASSED",
    "test_m.C.test_err": "ERROR",
    "test_m.C.test_fail": "FAILED",
    "test_m.C.test_skip": "SKIPPED",
    "test_m.C.test_sub": "FAILED",
    "test_m.C.test_us": "FAILED",
    "test_m.C.test_xf": "PASSED",
}


def test_unittest_log_python_311_style() -> None:
    statuses = parse_test_log(UNITTEST_311, "unittest")
    # The lone ERROR after test_xf is D's setUpClass: it must not be pinned on the test before it.
    assert statuses == {**EXPECTED_UNITTEST, "First docstring line.": "PASSED"}


def test_unittest_log_python_310_style() -> None:
    log = """\
test_a (test_m.C) ... hello from a
ok
test_doc (test_m.C)
First docstring line. ... ok
test_err (test_m.C) ... ERROR
test_fail (test_m.C) ... FAIL
test_skip (test_m.C) ... skipped 'why not'
test_sub (test_m.C) ... test_us (test_m.C) ... unexpected success
test_xf (test_m.C) ... expected failure

======================================================================
FAIL: test_sub (test_m.C) (i=1)
----------------------------------------------------------------------
"""
    statuses = parse_test_log(log, "unittest")
    assert statuses == {**EXPECTED_UNITTEST, "First docstring line.": "PASSED"}


def test_unittest_result_after_interleaved_output() -> None:
    log = "test_x (m.C.test_x) ... \nprinted by the test\nmore output ... still output\nok\ntest_y (m.C) ... FAIL\n"
    assert parse_test_log(log, "unittest") == {"m.C.test_x": "PASSED", "m.C.test_y": "FAILED"}


def test_unittest_output_glued_to_the_result_is_missing_not_passed() -> None:
    log = "test_x (m.C.test_x) ... partialok\n"
    assert parse_test_log(log, "unittest") == {}


def test_unittest_fake_ok_cannot_hide_a_reported_failure() -> None:
    log = "test_x (m.C.test_x) ... ok\n======\nFAIL: test_x (m.C.test_x)\n------\ntest_x (m.C.test_x) ... ok\n"
    assert parse_test_log(log, "unittest") == {"m.C.test_x": "FAILED"}


def test_unittest_log_of_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "test_real.py").write_text(
        textwrap.dedent(
            """
            import unittest

            class T(unittest.TestCase):
                def test_pass(self):
                    print("noise")

                def test_doc(self):
                    '''Has a docstring.'''

                def test_fail(self):
                    self.assertEqual(1, 2)

                @unittest.skip("no")
                def test_skip(self):
                    pass

                def test_sub(self):
                    for i in range(2):
                        with self.subTest(i=i):
                            self.assertEqual(i, 0)
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "unittest", "-v", "test_real"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    statuses = parse_test_log(run.stdout + run.stderr, "unittest")
    assert {name: statuses.get(name) for name in statuses if name.startswith("test_real.")} == {
        "test_real.T.test_pass": "PASSED",
        "test_real.T.test_doc": "PASSED",
        "test_real.T.test_fail": "FAILED",
        "test_real.T.test_skip": "SKIPPED",
        "test_real.T.test_sub": "FAILED",
    }


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("test_x (m.C)", "m.C.test_x"),
        ("test_x (m.C.test_x)", "m.C.test_x"),
        ("m.C.test_x", "m.C.test_x"),
        ("  test_x (pkg.mod.C)  ", "pkg.mod.C.test_x"),
        ("A docstring line.", "A docstring line."),
    ],
)
def test_normalise_unittest_names(name: str, key: str) -> None:
    assert normalise_test_name(name, "unittest") == key


def test_pytest_names_are_kept() -> None:
    assert normalise_test_name("t.py::test_x[a b]", "pytest") == "t.py::test_x[a b]"


# --- parse_test_log: pytest -----------------------------------------------------------------------------------------

PYTEST_LOG = """\
============================= test session starts ==============================
t.py::test_ok PASSED                                                     [ 12%]
t.py::test_fail FAILED                                                   [ 25%]
t.py::test_skip SKIPPED (why)                                            [ 37%]
t.py::test_xf XFAIL (known)                                              [ 50%]
t.py::test_param[a b] PASSED                                             [ 75%]
t.py::TestC::test_m PASSED                                               [ 87%]
t.py::test_td PASSED                                                     [100%]
t.py::test_td ERROR                                                      [100%]
=========================== short test summary info ============================
PASSED t.py::test_ok
PASSED t.py::test_param[a b]
PASSED t.py::TestC::test_m
PASSED t.py::test_td
SKIPPED [1] t.py:4: why
XFAIL t.py::test_xf - known
XPASS t.py::test_xp - meh
ERROR t.py::test_td - RuntimeError: teardown
FAILED t.py::test_fail - AssertionError: boom - bad
ERROR broken.py - ImportError: no module
==== 1 failed, 4 passed, 1 skipped, 1 xfailed, 1 xpassed, 1 error in 0.61s =====
"""


def test_pytest_summary_and_verbose_lines() -> None:
    assert parse_test_log(PYTEST_LOG, "pytest") == {
        "t.py::test_ok": "PASSED",
        "t.py::test_fail": "FAILED",
        "t.py::test_skip": "SKIPPED",
        "t.py::test_xf": "PASSED",
        "t.py::test_xp": "PASSED",
        "t.py::test_param[a b]": "PASSED",
        "t.py::TestC::test_m": "PASSED",
        "t.py::test_td": "ERROR",  # the teardown error outranks the pass
        "broken.py": "ERROR",
    }


def test_pytest_summary_only_and_colour() -> None:
    log = "\x1b[32mPASSED\x1b[0m a.py::test_1\n\x1b[31mFAILED\x1b[0m a.py::test_2 - assert 0\n"
    assert parse_test_log(log, "pytest") == {"a.py::test_1": "PASSED", "a.py::test_2": "FAILED"}


def test_pytest_log_of_a_real_run(tmp_path: Path) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_real.py").write_text(
        textwrap.dedent(
            """
            import pytest

            def test_pass():
                print("noise")

            def test_fail():
                assert 0

            @pytest.mark.parametrize("v", ["a b", "c"])
            def test_param(v):
                pass
            """
        )
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-v", "-p", "no:cacheprovider", "test_real.py"],
        cwd=tmp_path,
        env={name: value for name, value in os.environ.items() if name != "PYTEST_ADDOPTS"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert parse_test_log(run.stdout + run.stderr, "pytest") == {
        "test_real.py::test_pass": "PASSED",
        "test_real.py::test_fail": "FAILED",
        "test_real.py::test_param[a b]": "PASSED",
        "test_real.py::test_param[c]": "PASSED",
    }


def test_unknown_framework_is_refused() -> None:
    for call in (
        lambda: parse_test_log("", "nose"),
        lambda: normalise_test_name("x", "nose"),
        lambda: verdict({}, ["x"], "nose"),
    ):
        with pytest.raises(ValueError, match="unknown test framework 'nose'"):
            call()


# --- tests_verdict --------------------------------------------------------------------------------------------------


def test_verdict_passes_only_when_every_named_test_passed() -> None:
    statuses = parse_test_log(UNITTEST_311, "unittest")
    named = ["test_a (test_m.C)", "test_m.C.test_doc", "test_xf (test_m.C.test_xf)", "First docstring line."]
    assert verdict(statuses, named, "unittest") == (True, [])
    assert verdict(statuses, ["test_m.C.test_a"], "unittest") == (True, [])


def test_verdict_lists_failed_and_missing_tests() -> None:
    statuses = parse_test_log(UNITTEST_311, "unittest")
    must_pass = ["test_a (test_m.C)", "test_fail (test_m.C)", "test_m.C.test_skip", "test_gone (test_m.C)"]
    assert verdict(statuses, must_pass, "unittest") == (
        False,
        ["test_fail (test_m.C): FAILED", "test_m.C.test_skip: SKIPPED", "test_gone (test_m.C): missing"],
    )


def test_verdict_of_a_run_that_never_ran_a_test() -> None:
    log = "Traceback (most recent call last):\nImportError: cannot import name 'add'\n"
    assert verdict(parse_test_log(log, "unittest"), ["m.C.test_x"], "unittest") == (
        False,
        ["m.C.test_x: missing"],
    )
    assert verdict(parse_test_log(log, "pytest"), ["t.py::test_x"], "pytest") == (
        False,
        ["t.py::test_x: missing"],
    )


def test_verdict_normalises_the_status_keys_too() -> None:
    statuses = {"test_x (m.C)": "PASSED", "m.C.test_x": "FAILED", "test_y (m.C.test_y)": "PASSED"}
    assert verdict(statuses, ["m.C.test_x", "m.C.test_y"], "unittest") == (False, ["m.C.test_x: FAILED"])
    assert verdict(statuses, ["test_y (m.C)", "test_y (m.C)"], "unittest") == (True, [])


def test_verdict_on_pytest_statuses() -> None:
    statuses = parse_test_log(PYTEST_LOG, "pytest")
    assert verdict(statuses, ["t.py::test_ok", "t.py::test_param[a b]"], "pytest") == (True, [])
    assert verdict(statuses, ["t.py::test_ok", "t.py::test_td"], "pytest") == (False, ["t.py::test_td: ERROR"])


# --- the patch people and ProRL's clients read -----------------------------------------------------------------------


def test_the_unified_patch_applies_with_git_to_the_agents_tree(tmp_path: Path) -> None:
    """git apply turns the original files into the agent's: changed, new (executable), deleted, no final newline."""
    agent = repo(
        {
            "pkg/calc.py": "def add(a, b):\n    return a + b\n",
            "pkg/run.sh": "#!/bin/sh\necho run",
            "README.md": None,
        }
    )
    changes = agent_changes(archive(agent, modes={"pkg/run.sh": 0o755}), ORIGINAL_WITH_TESTS)
    patch = unified_patch(changes, ORIGINAL_WITH_TESTS)
    for path, content in ORIGINAL_WITH_TESTS.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(content)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "apply", "-"], cwd=tmp_path, input=patch.encode(), check=True)
    assert (tmp_path / "pkg/calc.py").read_text() == "def add(a, b):\n    return a + b\n"
    assert (tmp_path / "pkg/run.sh").read_text() == "#!/bin/sh\necho run"
    assert os.access(tmp_path / "pkg/run.sh", os.X_OK)
    assert not (tmp_path / "README.md").exists()
    assert (tmp_path / "tests/test_calc.py").read_text() == TESTS["tests/test_calc.py"]


def test_a_binary_file_is_named_in_the_patch_not_spelled_out() -> None:
    changes = agent_changes(archive(repo({"data.bin": b"\xff\x00\xfe"})), ORIGINAL_WITH_TESTS)
    assert unified_patch(changes, ORIGINAL_WITH_TESTS) == (
        "diff --git a/data.bin b/data.bin\nnew file mode 100644\nBinary files /dev/null and b/data.bin differ\n"
    )
    assert unified_patch(AgentChanges(), ORIGINAL_WITH_TESTS) == ""
