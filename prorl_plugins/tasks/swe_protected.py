"""What of the agent's changes is applied at grading, for both kinds of `swe` row (SWE-bench rows and the task's own):
`outside` keeps a fix and drops whatever could change how the tests run rather than what they test.

One rule for both kinds, because the attacks are the same: a `unittest.py` or `pytest.py` at the repository's root
replaces the test runner for a command run from there, a `conftest.py` or `setup.cfg` loads a plugin that reports every
test passed, a `.pyc` in `__pycache__` runs in place of the source it names.
"""

from __future__ import annotations

import importlib.machinery
import shlex
from collections.abc import Collection

from .swe_grading import AgentChanges

# Files that configure how the tests are collected and run, wherever they are, rather than what they test: a
# fix does not change them, and each can load a plugin that reports every test passed (`addopts = -p x`).
PROTECTED_NAMES = frozenset(
    {
        *("conftest.py", "sitecustomize.py", "usercustomize.py", "__main__.py"),
        *("pytest.ini", ".pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "noxfile.py", "runtests.py"),
    }
)
# Installation records a test runner reads (entry points such as [pytest11] plugins, path hooks).
PROTECTED_SUFFIXES = (".pth", ".egg-link")
PROTECTED_DIRECTORY_SUFFIXES = (".egg-info", ".dist-info")
_IMPORT_SUFFIXES = tuple(importlib.machinery.all_suffixes())  # .py, .pyc, .so, .cpython-311-x86_64-linux-gnu.so


def outside(
    changes: AgentChanges, protected: Collection[str], original: Collection[str] = (), command: str = ""
) -> AgentChanges:
    """The agent's changes except what could change how the tests run rather than what they test:

    - the protected paths (the test patch's), a directory of one (a file where a test's directory is), anything
      below one (a test file turned into a directory), and every PROTECTED_NAMES file (conftest.py, ...);
    - compiled Python (`__pycache__`, .pyc), which no fix consists of, and which would run in place of a source
      whose size and time it names;
    - a new module (a file with an import suffix, or a new directory, which may be a package) directly in the
      repository's root or in a test's directory: the root is first on sys.path (the tests run from it, as
      `python -m pytest`; a repository's own configuration may put it there), ahead of the standard library and
      of pytest itself, and pytest puts a test's directory first on sys.path, so `pytest.py` or `re.py` there
      would replace the test runner. `original` holds the original files' paths: what is there already stays.
    """
    # A test file the command names (`pytest test_calc.py`) is protected as a test, not as a runner whose neighbours
    # (the code under test, for a test at the root) it imports.
    runners = runner_paths(command, original) - frozenset(protected)
    runner_dirs = {path.rpartition("/")[0] for path in runners}
    protected = frozenset(protected) | runners
    directories = {"/".join(path.split("/")[:depth]) for path in protected for depth in range(1, path.count("/") + 1)}
    existing = {"/".join(path.split("/")[:depth]) for path in original for depth in range(1, path.count("/") + 2)}
    on_sys_path = {""} | {path.rpartition("/")[0] for path in protected}
    # Packages the tests' directories are (pytest imports their __init__.py at collection), and the modules beside
    # a runner script, which it imports by name (Django's tests/runtests.py: --settings=test_sqlite).
    protected |= {f"{directory}/__init__.py" for directory in test_packages(protected)}
    protected |= {
        path for path in original if path.rpartition("/")[0] in runner_dirs and path.endswith(_IMPORT_SUFFIXES)
    }

    def new_module(path: str) -> bool:
        for top in on_sys_path:
            below = path[len(top) + 1 :] if top else path
            if top and not path.startswith(top + "/"):
                continue
            name, _, rest = below.partition("/")
            entry = f"{top}/{name}" if top else name
            if entry not in existing and (rest or name.endswith(_IMPORT_SUFFIXES)):
                return True
        return False

    def allowed(path: str) -> bool:
        parts = path.split("/")
        ancestors = ("/".join(parts[:depth]) for depth in range(1, len(parts)))
        return (
            path not in protected
            and path not in directories
            and parts[-1] not in PROTECTED_NAMES
            and not parts[-1].endswith(PROTECTED_SUFFIXES)
            and not any(part.endswith(PROTECTED_DIRECTORY_SUFFIXES) for part in parts[:-1])
            and not parts[0].startswith(".")  # the root's dotfiles: tool configuration (.coveragerc, .condarc)
            and "__pycache__" not in parts
            and not parts[-1].endswith((".pyc", ".pyo"))
            and not any(a in protected for a in ancestors)
            and not new_module(path)
        )

    return AgentChanges(
        written={path: entry for path, entry in changes.written.items() if allowed(path)},
        symlinks={path: target for path, target in changes.symlinks.items() if allowed(path)},
        deleted=frozenset(path for path in changes.deleted if allowed(path)),
    )


def test_packages(test_paths: Collection[str]) -> set[str]:
    """The directories of the tests from the first one named like a test directory down (`pkg/io/tests`,
    `tests/unit`): their __init__.py are the tests' (the code under test's own packages are the agent's)."""
    found = set()
    for path in test_paths:
        parts = path.split("/")[:-1]
        start = next((i for i, part in enumerate(parts) if "test" in part.lower()), len(parts))
        found |= {"/".join(parts[: depth + 1]) for depth in range(start, len(parts))}
    return found


def runner_paths(command: str, original: Collection[str]) -> frozenset[str]:
    """The repository's files the test command names (`./tests/runtests.py`, `bin/test`): the test runner is
    the graders', as the tests are."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    files = set(original)
    return frozenset(word.removeprefix("./") for word in words if word.removeprefix("./") in files)
