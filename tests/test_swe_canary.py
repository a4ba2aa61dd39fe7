"""Grading that the code under test cannot talk into a pass, on real test runs (unittest and pytest in a subprocess):
the grader's canary tests (swe_canary), the rule of what an own row's changes may touch (swe_protected.outside, the
one SWE-bench rows get), and the bounded patch (swe_grading.unified_patch)."""

from __future__ import annotations

import gzip
import io
import subprocess
import sys
import tarfile
import types
from pathlib import Path

import pytest

from prorl_plugins.tasks.swe import graded_outcome, graded_own_row
from prorl_plugins.tasks.swe_canary import plant, tampering, without_canaries
from prorl_plugins.tasks.swe_grading import (
    DIFF_FILE_BYTES,
    AgentChanges,
    agent_changes,
    bounded_patch,
    parse_test_log,
    unified_patch,
)

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
UNITTESTS = (
    "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n"
    "    def test_add_zero(self):\n        self.assertEqual(add(0, 0), 0)\n"
)
PYTESTS = (
    "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n\n\n"
    "def test_add_zero():\n    assert add(0, 0) == 0\n"
)
# A few lines appended to the code under test: every test reads "passed", whatever happened.
REWRITES_UNITTEST = (
    "\nimport unittest\n\n\ndef _run(self, result=None):\n    result.startTest(self)\n    result.addSuccess(self)\n"
    "    result.stopTest(self)\n\n\nunittest.TestCase.run = _run\n"
)
REWRITES_PYTEST = (
    "\nimport _pytest.reports\n\n_init = _pytest.reports.TestReport.__init__\n\n\n"
    "def _passed(self, *args, **kwargs):\n    _init(self, *args, **kwargs)\n    self.outcome = 'passed'\n"
    "    self.longrepr = None\n\n\n_pytest.reports.TestReport.__init__ = _passed\n"
)
COMMANDS = {
    "unittest": [sys.executable, "-m", "unittest", "-v"],
    "unittest-quiet": [sys.executable, "-m", "unittest", "-q"],
    "pytest": [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider"],
}


def tar_gz(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb") as zipped, tarfile.open(fileobj=zipped, mode="w") as tar:
        for path, content in files.items():
            member = tarfile.TarInfo(path)
            member.size = len(content.encode())
            tar.addfile(member, io.BytesIO(content.encode()))
    return buffer.getvalue()


def graded_run(tmp_path: Path, agent_files: dict[str, str], runner: str, named: list[str] = ()):
    """An own row graded as eval grades it, its tests run for real: (statuses, tampering verdict, the real tests')."""
    framework = "pytest" if runner == "pytest" else "unittest"
    tests = {"test_calc.py": PYTESTS if framework == "pytest" else UNITTESTS}
    instance = {"files": {"calc.py": BUGGY}, "test_files": tests, "test_command": " ".join(COMMANDS[runner][1:])}
    graded = graded_own_row(tar_gz({**instance["files"], **tests, **agent_files}), instance, list(named), framework)
    with tarfile.open(fileobj=io.BytesIO(graded.tree), mode="r:gz") as tar:
        tar.extractall(tmp_path, filter="data")
    run = subprocess.run(COMMANDS[runner], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    statuses = parse_test_log(run.stdout + run.stderr, framework)
    return statuses, tampering(statuses, graded.planted), without_canaries(statuses, graded.planted), graded


@pytest.mark.parametrize("runner", COMMANDS)
def test_an_honest_run_reports_every_canary_as_it_must(tmp_path: Path, runner: str) -> None:
    statuses, tampered, real, graded = graded_run(tmp_path, {"calc.py": FIXED}, runner)
    assert tampered is None
    assert len(graded.planted.canaries) == 4
    assert all(status == "PASSED" for status in real.values())
    if runner != "unittest-quiet":  # a quiet log lists only what failed
        assert len(real) == 2 and len(statuses) == 6


@pytest.mark.parametrize("runner", COMMANDS)
def test_an_unfixed_bug_fails_its_test_and_nothing_is_tampered(tmp_path: Path, runner: str) -> None:
    _, tampered, real, _ = graded_run(tmp_path, {}, runner)
    assert tampered is None
    assert "FAILED" in real.values()


@pytest.mark.parametrize(
    ("runner", "rewrite"),
    [("unittest", REWRITES_UNITTEST), ("unittest-quiet", REWRITES_UNITTEST), ("pytest", REWRITES_PYTEST)],
)
def test_code_under_test_that_rewrites_the_runner_is_caught(tmp_path: Path, runner: str, rewrite: str) -> None:
    _, tampered, real, _ = graded_run(tmp_path, {"calc.py": BUGGY + rewrite}, runner)
    assert tampered is not None and "must fail" in tampered
    assert "FAILED" not in real.values()  # the rewrite works: without canaries this run would pass


def test_canaries_have_fresh_names_at_each_grading_and_read_like_the_files_tests() -> None:
    first, second = (
        plant({"test_calc.py": UNITTESTS}, [], "unittest"),
        plant({"test_calc.py": UNITTESTS}, [], "unittest"),
    )
    assert {c.name for c in first.canaries}.isdisjoint({c.name for c in second.canaries}) or first != second
    for canary in first.canaries:
        assert canary.name.startswith("test_") and canary.name.replace("_", "").isalpha()
    source = first.files["test_calc.py"].decode()
    assert source.count("class ") == 1  # inside the file's own test class
    compile(source, "test_calc.py", "exec")


def test_canaries_go_to_the_files_that_hold_a_named_test() -> None:
    files = {"test_calc.py": PYTESTS, "test_other.py": "def test_other():\n    pass\n", "helpers.py": "X = 1\n"}
    planted = plant(files, ["test_calc.py::test_add"], "pytest")
    assert set(planted.files) == {"test_calc.py"}
    assert set(plant(files, [], "pytest").files) == {"test_calc.py", "test_other.py"}  # no names: every test file


def test_a_canary_missing_from_the_log_is_tampering() -> None:
    planted = plant({"test_calc.py": PYTESTS}, [], "pytest")
    assert "missing" in tampering({"test_calc.py::test_add": "PASSED"}, planted)
    statuses = {f"test_calc.py::{c.name}": "PASSED" if c.must_pass else "FAILED" for c in planted.canaries}
    statuses |= {"test_calc.py::test_add": "PASSED", "test_calc.py::test_add_zero": "PASSED"}
    assert tampering(statuses, planted) is None
    must_fail = next(c for c in planted.canaries if not c.must_pass)
    assert "must fail" in tampering({**statuses, f"test_calc.py::{must_fail.name}": "PASSED"}, planted)


# -- own rows get SWE-bench rows' rule -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "planted",
    [
        {"unittest.py": "import sys\nprint('test_add (test_calc.TestAdd.test_add) ... ok')\nsys.exit(0)\n"},
        {"unittest/__init__.py": "import sys\nsys.exit(0)\n"},
        {"conftest.py": "raise SystemExit(0)\n"},
        {"__pycache__/calc.cpython-311.pyc": "not really bytecode"},
    ],
)
def test_an_own_rows_new_runner_module_and_test_config_are_not_graded(tmp_path: Path, planted: dict) -> None:
    instance = {"files": {"calc.py": BUGGY}, "test_files": {"test_calc.py": UNITTESTS}, "test_command": "x"}
    archive = tar_gz({"calc.py": BUGGY, "test_calc.py": UNITTESTS, "helper.txt": "kept\n", **planted})
    graded = graded_own_row(archive, instance, [], "unittest")
    with tarfile.open(fileobj=io.BytesIO(graded.tree), mode="r:gz") as tar:
        names = set(tar.getnames())
    assert "helper.txt" in names and not names & set(planted)
    assert next(iter(planted)) in graded.patch  # the agent's patch still shows what it did


# -- a bounded patch ---------------------------------------------------------------------------------------------
def test_a_huge_text_file_is_a_binary_change_and_costs_little() -> None:
    huge = ("x = 1\n" * (60_000_000 // 6)).encode()
    patch = unified_patch(AgentChanges(written={"big.txt": (huge, 0o644)}), {})
    assert (
        patch == "diff --git a/big.txt b/big.txt\nnew file mode 100644\nBinary files /dev/null and b/big.txt differ\n"
    )
    assert len(huge) > DIFF_FILE_BYTES


def test_text_that_difflib_is_slow_on_is_one_hunk_that_still_applies(tmp_path: Path) -> None:
    # 150 distinct lines in random orders: difflib took 64 s on a megabyte of this.
    import random

    rng = random.Random(1)
    lines = [f"line {i}\n" for i in range(150)]
    before = "".join(rng.choice(lines) for _ in range(100_000))[: DIFF_FILE_BYTES - 100]
    before = before[: before.rindex("\n") + 1]
    after = "head\n" + "".join(rng.choice(lines) for _ in range(100_000))[: DIFF_FILE_BYTES - 100]
    after = after[: after.rindex("\n") + 1] + "tail"
    patch = unified_patch(agent_changes(tar_gz({"f.txt": after}), {"f.txt": before}), {"f.txt": before})
    assert sum(line.startswith("@@") for line in patch.splitlines()) == 1  # not difflib's search: one hunk
    (tmp_path / "f.txt").write_text(before)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "f.txt").read_text() == after


def test_a_small_change_in_a_big_file_is_diffed_line_by_line(tmp_path: Path) -> None:
    before = "".join(f"line {i}\n" for i in range(50_000))
    after = before.replace("line 25000\n", "changed\n")
    patch = unified_patch(agent_changes(tar_gz({"f.txt": after}), {"f.txt": before}), {"f.txt": before})
    assert "@@ -24998,7 +24998,7 @@\n line 24997\n" in patch and "-line 25000\n+changed\n" in patch
    (tmp_path / "f.txt").write_text(before)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "f.txt").read_text() == after


# -- SWE-bench rows: swebench's own parsers find the canaries in the same log ---------------------------------
@pytest.mark.parametrize(("repo", "runner"), [("django/django", "unittest"), ("astropy/astropy", "pytest")])
@pytest.mark.parametrize("rewritten", [False, True], ids=["honest", "rewritten"])
def test_swebench_parsers_read_the_canaries(tmp_path: Path, repo: str, runner: str, rewritten: bool) -> None:
    from prorl_plugins.tasks import swe_bench

    framework = "pytest" if runner == "pytest" else "unittest"
    tests = PYTESTS if framework == "pytest" else UNITTESTS
    rewrite = (REWRITES_PYTEST if framework == "pytest" else REWRITES_UNITTEST) if rewritten else ""
    planted = plant({"test_calc.py": tests}, ["test_add"], framework)
    (tmp_path / "calc.py").write_text(FIXED + rewrite)
    (tmp_path / "test_calc.py").write_bytes(planted.files["test_calc.py"])
    run = subprocess.run(COMMANDS[runner], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    row = types.SimpleNamespace(instance_id="x", repo=repo, version=None, fail_to_pass=["test_add"], pass_to_pass=[])
    verdict = tampering(swe_bench.parsed_log(row, run.stdout + run.stderr), planted)
    assert (verdict is not None) == rewritten, verdict


def test_a_tab_indented_test_file_gets_canaries_that_run(tmp_path: Path) -> None:
    tests = "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n\tdef test_add(self):\n"
    tests += "\t\tself.assertEqual(add(2, 3), 5)\n"
    planted = plant({"test_calc.py": tests}, [], "unittest")
    (tmp_path / "calc.py").write_text(FIXED)
    (tmp_path / "test_calc.py").write_bytes(planted.files["test_calc.py"])
    run = subprocess.run(COMMANDS["unittest"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert tampering(parse_test_log(run.stdout + run.stderr, "unittest"), planted) is None


# -- review of issue 47 (items 1-5): holes a policy could use, and false alarms on honest runs ----------------------
def own_row(
    tmp_path: Path, calc: str, tests: dict[str, str], argv: list[str], named: list[str] = (), framework: str = ""
) -> tuple[float, dict[str, str], object]:
    """An own row graded end to end in this process, as `SweTask.evaluate` grades it: (outcome, artifacts, graded)."""
    framework = framework or ("pytest" if "pytest" in argv else "unittest")
    instance = {"files": {"calc.py": BUGGY}, "test_files": tests, "test_command": " ".join(argv[1:])}
    graded = graded_own_row(tar_gz({"calc.py": calc, **tests}), instance, list(named), framework)
    with tarfile.open(fileobj=io.BytesIO(graded.tree), mode="r:gz") as tar:
        tar.extractall(tmp_path, filter="data")
    run = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    outcome, artifacts = graded_outcome(graded, run.stdout + run.stderr, run.returncode, list(named), framework)
    return outcome, artifacts, graded


# Turns a failure into a pass only in a test that called into the package; reports every other test truthfully.
SELECTIVE_UNITTEST = (
    "\nimport unittest\n\n_called = [False]\n_add = add\n\n\ndef add(a, b):\n    _called[0] = True\n"
    "    return _add(a, b)\n\n\n_run = unittest.TestCase.run\n\n\ndef _forging_run(self, result=None):\n"
    "    _called[0] = False\n    probe = unittest.TestResult()\n    _run(self, probe)\n"
    "    if (probe.failures or probe.errors) and _called[0]:\n"
    "        result.startTest(self)\n        result.addSuccess(self)\n        result.stopTest(self)\n"
    "    else:\n        _run(self, result)\n\n\nunittest.TestCase.run = _forging_run\n"
)
SELECTIVE_PYTEST = (
    "\nimport _pytest.reports\n\n_called = [False]\n_add = add\n\n\ndef add(a, b):\n    _called[0] = True\n"
    "    return _add(a, b)\n\n\n_init = _pytest.reports.TestReport.__init__\n\n\n"
    "def _forging(self, *args, **kwargs):\n    _init(self, *args, **kwargs)\n"
    "    if self.when == 'setup':\n        _called[0] = False\n"
    "    elif self.when == 'call' and self.outcome == 'failed' and _called[0]:\n"
    "        self.outcome, self.longrepr = 'passed', None\n\n\n_pytest.reports.TestReport.__init__ = _forging\n"
)


@pytest.mark.parametrize("named", [[], ["test_add (test_calc.TestAdd)"]], ids=["unnamed", "named"])
@pytest.mark.parametrize(("runner", "hack"), [("unittest", SELECTIVE_UNITTEST), ("pytest", SELECTIVE_PYTEST)])
def test_a_runner_that_forges_only_tests_calling_the_package_is_caught(tmp_path, runner, hack, named) -> None:
    tests = {"test_calc.py": PYTESTS if runner == "pytest" else UNITTESTS}
    named = ["test_calc.py::test_add"] if named and runner == "pytest" else named
    outcome, artifacts, graded = own_row(tmp_path, BUGGY + hack, tests, COMMANDS[runner], named)
    assert outcome == 0.0 and "must fail" in artifacts.get("tampered", ""), artifacts
    assert all(canary.original in ("test_add", "test_add_zero") for canary in graded.planted.canaries)
    with tarfile.open(fileobj=io.BytesIO(graded.tree), mode="r:gz") as tar:
        source = tar.extractfile("test_calc.py").read().decode()
    assert "a + b ==" not in source  # no fixed body that gives the expected outcome away


def test_a_must_fail_copy_fails_under_python_O(tmp_path: Path) -> None:
    outcome, artifacts, _ = own_row(
        tmp_path, FIXED, {"test_calc.py": UNITTESTS}, [sys.executable, "-O", *COMMANDS["unittest"][1:]]
    )
    assert "tampered" not in artifacts and outcome == 1.0, artifacts


# The package ends the run (exit status 0) when the one test that would fail calls it, after the others reported.
EXITS_ON_THE_FAILING_INPUT = (
    "import os\n\n\ndef add(a, b):\n    if (a, b) == (2, 3):\n        os._exit(0)\n    return a + b\n"
)
LAST_CLASS_TESTS = (
    "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add_zero(self):\n        self.assertEqual(add(0, 0), 0)\n\n\n"
    "@(lambda cls: cls)\nclass TestZ(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)


def test_a_row_without_names_needs_every_test_reported(tmp_path: Path) -> None:
    outcome, artifacts, _ = own_row(
        tmp_path, EXITS_ON_THE_FAILING_INPUT, {"test_calc.py": LAST_CLASS_TESTS}, COMMANDS["unittest"]
    )
    assert outcome == 0.0 and "TestZ::test_add: missing" in artifacts["test_failures"], artifacts
    assert own_row(tmp_path / "fixed", FIXED, {"test_calc.py": LAST_CLASS_TESTS}, COMMANDS["unittest"])[0] == 1.0


ABSTRACT_BASE = (
    "import unittest\nfrom calc import add\n\n\nclass AddBase(unittest.TestCase):\n    def setUp(self):\n"
    "        if type(self) is AddBase:\n            self.skipTest('abstract')\n\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n\n\nclass TestAddInts(AddBase):\n    pass\n"
)
CLASS_PARAMETRIZED = (
    "import pytest\nfrom calc import add\n\n\n@pytest.mark.parametrize('n', [0, 1])\nclass TestAdd:\n"
    "    def test_add(self, n):\n        assert add(n, 3) == n + 3\n"
)


DOCSTRINGS = UNITTESTS.replace("def test_add(self):\n", 'def test_add(self):\n        """Adds."""\n').replace(
    "def test_add_zero(self):\n", 'def test_add_zero(self):\n        """Adds zeros."""\n'
)  # `unittest -v` keys a result by a docstring's first line too: a copy would share it


@pytest.mark.parametrize(
    ("tests", "runner"),
    [(ABSTRACT_BASE, "unittest"), (CLASS_PARAMETRIZED, "pytest"), (DOCSTRINGS, "unittest")],
    ids=["abstract-base", "class-mark", "docstrings"],
)
def test_an_honest_run_of_skipped_or_decorated_classes_is_not_tampered(tmp_path, tests, runner) -> None:
    for attempt in range(3):  # the layout was chosen at random
        outcome, artifacts, _ = own_row(tmp_path / str(attempt), FIXED, {"test_calc.py": tests}, COMMANDS[runner])
        assert "tampered" not in artifacts and outcome == 1.0, artifacts


def test_canaries_go_only_to_the_class_a_named_test_names() -> None:
    tests = UNITTESTS + "\n\nclass Helper:\n    def test_add(self):\n        raise RuntimeError('never collected')\n"
    for _ in range(10):
        planted = plant({"test_calc.py": tests}, ["test_add (test_calc.TestAdd)"], "unittest")
        source = planted.files["test_calc.py"].decode()
        assert source.endswith(tests[tests.index("\n\nclass Helper") :])  # nothing added to Helper
        assert {canary.container for canary in planted.canaries} == {"TestAdd"}


@pytest.mark.parametrize(
    ("command", "config"),
    [
        ("python3 -m pytest -x -rA", {}),
        ("python3 -m pytest -rA --maxfail=1", {}),
        ("python3 -m pytest --sw", {}),
        ("python3 -m pytest -rA", {"setup.cfg": "[tool:pytest]\naddopts = -rA\n    --maxfail 1\n"}),
        ("python3 -m pytest -rA test_calc.py::test_add", {}),
        ("python3 -m unittest -v -f", {}),
        ("python3 -m unittest -fv", {}),
        ("python3 -m unittest -v test_calc.TestAdd", {}),
    ],
)
def test_a_row_whose_command_stops_early_or_selects_tests_is_refused(command: str, config: dict) -> None:
    from prorl_adapter.tasks import TaskConfigError
    from prorl_plugins.tasks.swe import check_row

    row = {"problem_statement": "p", "files": {"calc.py": BUGGY, **config}, "test_files": {"test_calc.py": PYTESTS}}
    with pytest.raises(TaskConfigError, match=r"stops at the first failure|selects tests by name"):
        check_row({**row, "test_command": command})
    check_row({**row, "files": {"calc.py": BUGGY}, "test_command": "python3 -m pytest -rA -p no:cacheprovider"})


def test_canaries_go_only_to_the_files_the_command_runs(tmp_path: Path) -> None:
    tests = {"test_calc.py": PYTESTS, "test_other.py": "def test_other():\n    assert 1 + 1 == 2\n"}
    argv = [*COMMANDS["pytest"], "test_calc.py"]
    for attempt in range(3):
        outcome, artifacts, graded = own_row(tmp_path / str(attempt), FIXED, tests, argv)
        assert "tampered" not in artifacts and outcome == 1.0, artifacts
        assert set(graded.planted.files) == {"test_calc.py"}


# -- a bounded patch that names what it leaves out (item 5) ---------------------------------------------------------
def test_a_small_change_in_a_file_over_the_bound_is_shown(tmp_path: Path) -> None:
    before = "".join(f"line {i}\n" for i in range(200_000))
    assert len(before) > DIFF_FILE_BYTES
    after = before.replace("line 150000\n", "hack()\n")
    patch, truncated = bounded_patch(agent_changes(tar_gz({"f.txt": after}), {"f.txt": before}), {"f.txt": before})
    assert "-line 150000\n+hack()\n" in patch and truncated == []
    (tmp_path / "f.txt").write_text(before)
    (tmp_path / "p.diff").write_text(patch)
    subprocess.run(["git", "apply", "p.diff"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / "f.txt").read_text() == after


def test_a_change_after_padding_that_spends_the_budget_is_named() -> None:
    padding = {f"a{i}.txt": (f"{i}" * 63 + "\n") * 16_384 for i in range(8)}  # 1 MiB each: the 8 MiB budget
    changes = AgentChanges(
        written={**{p: (t.encode(), 0o644) for p, t in padding.items()}, "calc.py": (FIXED.encode(), 0o644)}
    )
    patch, truncated = bounded_patch(changes, {"calc.py": BUGGY})
    assert "calc.py" in truncated and "Binary files a/calc.py and b/calc.py differ" in patch


def test_an_own_row_names_the_files_its_patch_leaves_out() -> None:
    instance = {"files": {"calc.py": BUGGY}, "test_files": {"test_calc.py": UNITTESTS}, "test_command": "x"}
    big = "x = 1\n" * 400_000
    graded = graded_own_row(
        tar_gz({"calc.py": FIXED, "test_calc.py": UNITTESTS, "big.py": big}), instance, [], "unittest"
    )
    assert graded.truncated == ("big.py",) and "-    return a - b\n+    return a + b\n" in graded.patch
