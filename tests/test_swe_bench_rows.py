"""SWE-bench-format rows of the swe task (prorl_plugins/tasks/swe_bench.py): row checks, image names, the test
command, the test patch's paths, and grading real pytest logs with swebench's own parsers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from prorl_adapter.tasks import TaskConfigError
from prorl_plugins.tasks import swe_bench
from prorl_plugins.tasks.swe import SweTask
from prorl_plugins.tasks.swe_bench import (
    bench_row,
    grade_log,
    graded_command,
    graded_env,
    graded_script,
    image_name,
    outside,
    patch_paths,
)
from prorl_plugins.tasks.swe_grading import AgentChanges
from sandbox_runtime.models import SandboxSpec

BASE = "0123456789abcdef0123456789abcdef01234567"
TEST_PATCH = """diff --git a/tests/test_calc.py b/tests/test_calc.py
index 1111111..2222222 100644
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -1,3 +1,7 @@
 from calc import add
+
+
+def test_clamp():
+    assert clamp(5, 0, 3) == 3
diff --git a/tests/data/cases.json b/tests/data/cases.json
new file mode 100644
index 0000000..3333333
--- /dev/null
+++ b/tests/data/cases.json
@@ -0,0 +1 @@
+[]
"""


def row(**fields) -> dict:
    base = {
        "instance_id": "calc__calc-1",
        "repo": "calc/calc",
        "base_commit": BASE,
        "problem_statement": "clamp() ignores its upper bound.",
        "test_patch": TEST_PATCH,
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_clamp"]),
        "PASS_TO_PASS": ["tests/test_calc.py::test_add"],
        "version": "0.1",
    }
    return {key: value for key, value in {**base, **fields}.items() if value is not None}


# -- rows ------------------------------------------------------------------------------------------------------------
def test_a_dataset_row_is_read_with_its_json_test_lists():
    checked = bench_row(row(), swe_bench.DEFAULT_IMAGE_TEMPLATE)
    assert checked.fail_to_pass == ["tests/test_calc.py::test_clamp"]
    assert checked.pass_to_pass == ["tests/test_calc.py::test_add"]
    assert checked.test_paths == {"tests/test_calc.py", "tests/data/cases.json"}
    assert checked.repo_path == "/testbed"
    assert swe_bench.is_bench_row(row()) and not swe_bench.is_bench_row({"files": {}, "base_commit": BASE})


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"base_commit": None}, "'base_commit'"),
        ({"base_commit": "not a commit"}, "'base_commit'"),
        ({"FAIL_TO_PASS": "tests/test_calc.py::test_clamp"}, "FAIL_TO_PASS"),  # a string that is no JSON list
        ({"FAIL_TO_PASS": {"a": 1}}, "FAIL_TO_PASS"),
        ({"FAIL_TO_PASS": "[]"}, "'FAIL_TO_PASS'"),
        ({"PASS_TO_PASS": [1, 2]}, "PASS_TO_PASS"),
        ({"problem_statement": None}, "'problem_statement'"),
        ({"repo": ["a/b"]}, "'repo'"),
        ({"test_patch": "just some text"}, "'test_patch'"),
        ({"test_patch": TEST_PATCH.replace("a/tests/test_calc.py", "a/../etc/passwd", 1)}, "'test_patch'"),
        ({"test_patch": "diff --git a/.git/config b/.git/config\n"}, "'test_patch'"),
        ({"repo_path": "testbed"}, "'repo_path'"),
        ({"repo_path": "/usr/src/repo"}, "'repo_path'"),  # the sandbox's workdir may not hide a system directory
        ({"repo_path": "/tmp/repo"}, "'repo_path'"),
        ({"test_cmd": ""}, "'test_cmd'"),
        ({"env": "PATH=/bin"}, "'env'"),
        ({"image": "/abs/x.sif"}, "'image'"),
        ({"image": "../x.sif"}, "'image'"),
        ({"image_template": "sweb.{nope}.sif"}, "'image_template'"),
    ],
)
def test_a_bad_row_is_refused_naming_the_field(fields, named):
    with pytest.raises(TaskConfigError) as error:
        bench_row(row(**fields), swe_bench.DEFAULT_IMAGE_TEMPLATE)
    assert named in str(error.value)


def test_a_row_with_no_image_and_no_template_is_refused():
    with pytest.raises(TaskConfigError, match=r"no .image. and there is no image template"):
        bench_row(row(), None)
    with pytest.raises(TaskConfigError, match="no 'image'"):
        SweTask(image_template="").system_prompt(row())
    assert SweTask(image_template="").system_prompt(row(image="calc.sif"))


# -- images ------------------------------------------------------------------------------------------------------------
def test_the_default_image_is_swebench_s_name_for_the_instance():
    name = image_name({"instance_id": "astropy__astropy-12907"}, swe_bench.DEFAULT_IMAGE_TEMPLATE)
    assert name == "sweb.eval.x86_64.astropy_1776_astropy-12907.sif"
    assert image_name({"instance_id": "Django__Django-1"}, "{image_id}.tar") == "django_1776_django-1.tar"


def test_the_row_s_image_wins_over_templates_and_its_template_over_the_task_s():
    assert image_name({"instance_id": "x__y-1", "image": "mine.sif"}, "{image_id}.sif") == "mine.sif"
    templated = {"instance_id": "x__y-1", "repo": "x/y", "version": "2.0", "image_template": "{repo}/{version}.oci"}
    assert image_name(templated, "{image_id}.sif") == "x/y/2.0.oci"
    assert image_name({"instance_id": "getmoto__moto-7365"}, "swe-gym/{instance_id}.sif") == (
        "swe-gym/getmoto__moto-7365.sif"
    )


def test_the_task_s_template_comes_from_its_argument_or_the_service_s_environment(monkeypatch):
    assert SweTask(image_template="{instance_id}.tar").sandbox_spec(row())["image"] == "calc__calc-1.tar"
    monkeypatch.setenv(swe_bench.IMAGE_TEMPLATE_ENV, "images/{image_id}.oci")
    spec = SweTask().sandbox_spec(row())
    assert spec["image"] == "images/calc_1776_calc-1.oci"
    assert spec["workdir"] == "/testbed" and spec["seed_workdir"] is True  # the agent works in /testbed itself
    assert spec["env"]["PYTHONPATH"] == "/testbed"  # first, also where the image installed a copy of the repository
    assert spec["env"]["PATH"].startswith("/opt/miniconda3/envs/testbed/bin:")
    monkeypatch.delenv(swe_bench.IMAGE_TEMPLATE_ENV)
    assert SweTask().sandbox_spec(row())["image"] == "sweb.eval.x86_64.calc_1776_calc-1.sif"


def test_a_broken_row_gets_a_plain_sandbox_and_its_own_rows_keep_theirs():
    assert SweTask().sandbox_spec(row(base_commit=None)) == {}  # init then fails, naming the field
    own = {"problem_statement": "p", "files": {"a.py": ""}, "test_files": {"t.py": ""}, "test_command": "true"}
    assert SweTask().sandbox_spec(own) == {"limits": {"memory_mb": 2048, "pids": 256}}
    assert SweTask().sandbox_spec(row(env={"A": "1"}, limits={"pids": 64})) == {
        "image": "sweb.eval.x86_64.calc_1776_calc-1.sif",
        "workdir": "/testbed",
        "seed_workdir": True,
        "env": {"A": "1"},
        "limits": {"pids": 64},
    }


def test_prorl_rows_from_swe_bench_are_accepted_now():
    task = SweTask()
    assert task.from_prorl_instance("swebench", row()) == row()
    with pytest.raises(TaskConfigError, match="'base_commit'"):
        task.from_prorl_instance("swebench", row(base_commit=None))
    with pytest.raises(TaskConfigError, match="brings no repository"):
        task.from_prorl_instance("swebench", {"instance_id": "x", "problem_statement": "p"})


# -- the test command --------------------------------------------------------------------------------------------------
def checked(**fields) -> swe_bench.BenchRow:
    return bench_row(row(**fields), swe_bench.DEFAULT_IMAGE_TEMPLATE)


def test_a_row_s_test_command_runs_as_it_is_and_its_test_cmd_gets_the_test_files():
    assert graded_command(checked(test_command="make check")) == "make check"
    assert graded_command(checked(test_cmd="pytest -x -rA")) == "pytest -x -rA tests/test_calc.py"  # .json: no test


def test_swebench_s_test_command_for_a_repository_it_knows():
    astropy = checked(repo="astropy/astropy", version="4.3", test_patch=TEST_PATCH.replace("tests/", "astropy/tests/"))
    assert graded_command(astropy) == "pytest -rA astropy/tests/test_calc.py"
    django = checked(repo="django/django", version="3.0")
    assert graded_command(django) == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 test_calc"
    assert swe_bench.shown_command(django) == "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1"
    assert "export LANG=en_US.UTF-8" in swe_bench.graded_script(django)
    assert swe_bench.graded_script(django).startswith(f'mkdir -p "$HOME"\n{swe_bench.CONDA_ACTIVATE}')
    assert "\ncd /testbed\n./tests/runtests.py " in swe_bench.graded_script(django)


def test_the_sandbox_is_seeded_at_the_row_s_repository_path():
    spec = SweTask().sandbox_spec(row(repo_path="/srv/repo/"))
    assert (spec["workdir"], spec["seed_workdir"]) == ("/srv/repo", True)
    assert SandboxSpec(**spec).seed_workdir  # a spec the runtime takes
    assert swe_bench.graded_script(checked(repo_path="/srv/repo/")).splitlines()[-2] == "cd /srv/repo"


def test_an_unknown_repository_or_version_falls_back_to_pytest_on_the_test_files():
    assert graded_command(checked(repo="getmoto/moto", version="4.1")) == "python3 -m pytest -rA tests/test_calc.py"
    assert graded_command(checked(repo="django/django", version="99.0")).startswith("python3 -m pytest -rA ")
    assert swe_bench.shown_command(checked()) == "python3 -m pytest -rA"


# -- the test patch ----------------------------------------------------------------------------------------------------
def test_the_paths_a_test_patch_touches_old_and_new():
    rename = "diff --git a/tests/old.py b/tests/new.py\nsimilarity index 90%\nrename from tests/old.py\n"
    quoted = 'diff --git "a/tests/t\\303\\251st.py" "b/tests/t\\303\\251st.py"\n'
    assert patch_paths(TEST_PATCH) == ["tests/test_calc.py", "tests/data/cases.json"]
    assert patch_paths(rename) == ["tests/old.py", "tests/new.py"]
    assert patch_paths(quoted) == ["tests/tést.py"]
    with pytest.raises(TaskConfigError, match="no 'diff --git' line"):
        patch_paths("--- a/x\n+++ b/x\n")


def test_the_agent_s_changes_to_tests_and_test_machinery_are_left_out():
    changes = AgentChanges(
        written={
            "calc/ops.py": (b"fix", 0o644),
            "tests/test_calc.py": (b"def test_clamp(): pass", 0o644),
            "conftest.py": (b"evil", 0o644),
            "calc/conftest.py": (b"evil", 0o644),
            "sitecustomize.py": (b"evil", 0o644),
            "tests/data": (b"a file where the test data's directory is", 0o644),
            "tests/test_calc.py/inner": (b"below a test file", 0o644),
            "tests/__pycache__/test_calc.cpython-311-pytest-7.2.1.pyc": (b"compiled", 0o644),
            "calc/ops.pyc": (b"compiled", 0o644),
        },
        symlinks={"tests/data/cases.json": "/etc/passwd", "docs/link": "../README.md"},
        deleted=frozenset({"tests/test_calc.py", "calc/old.py"}),
    )
    kept = outside(changes, {"tests/test_calc.py", "tests/data/cases.json"}, ORIGINAL)
    assert kept.written == {"calc/ops.py": (b"fix", 0o644)}
    assert kept.symlinks == {"docs/link": "../README.md"}
    assert kept.deleted == {"calc/old.py"}


ORIGINAL = ["calc/__init__.py", "calc/ops.py", "calc/old.py", "tests/test_calc.py", "docs/index.rst", "setup.py"]


def test_new_modules_where_they_would_shadow_pytest_or_the_standard_library_are_left_out():
    """The root is first on sys.path and pytest puts a test's directory first on sys.path: a new module there would
    run in place of pytest (or `re`, ...); below the root, and where the repository has it already, it stays."""
    new = {
        "pytest.py": (b"", 0o644),
        "_pytest/__init__.py": (b"", 0o644),
        "re.cpython-311-x86_64-linux-gnu.so": (b"", 0o755),
        "tests/re.py": (b"", 0o644),
        "tests/helpers/__init__.py": (b"", 0o644),
        # kept: inside the package, existing at the root, not a module, in a directory that holds no test
        "calc/extra.py": (b"", 0o644),
        "calc/sub/__init__.py": (b"", 0o644),
        "setup.py": (b"changed", 0o644),
        "CHANGES.rst": (b"", 0o644),
        "docs/conf.py": (b"", 0o644),
    }
    kept = outside(AgentChanges(written=new, symlinks={"json.py": "calc/ops.py"}), {"tests/test_calc.py"}, ORIGINAL)
    assert sorted(kept.written) == ["CHANGES.rst", "calc/extra.py", "calc/sub/__init__.py", "docs/conf.py", "setup.py"]
    assert kept.symlinks == {}


def test_what_configures_how_tests_run_is_the_graders_wherever_it_is():
    """Each of these can load a plugin that reports every test passed, or is the runner itself."""
    planted = {
        path: (b"[pytest]\naddopts = -p calc._report\n", 0o644)
        for path in (
            "pytest.ini", "tox.ini", "setup.cfg", "pyproject.toml", "calc/pytest.ini", ".pytest.ini",
            "calc_hack.egg-info/entry_points.txt", "calc.dist-info/entry_points.txt", "calc/hook.pth",
            ".condarc", ".gitconfig", "tests/__init__.py", "tests/unit/__init__.py",
            "tests/runtests.py", "tests/test_sqlite.py",
        )
    }  # fmt: skip
    kept_too = {"calc/_report.py": (b"a module where code may go", 0o644), "calc/__init__.py": (b"changed", 0o644)}
    original = [*ORIGINAL, "tests/runtests.py", "tests/test_sqlite.py", "tests/unit/test_x.py", "bin/test"]
    changes = AgentChanges(written={**planted, **kept_too})
    kept = outside(
        changes, {"tests/test_calc.py", "tests/unit/test_x.py"}, original, "./tests/runtests.py --parallel 1"
    )
    assert kept.written == kept_too  # the code under test's own package __init__ stays the agent's
    runner = {"bin/test": (b"print('all passed')", 0o755)}
    assert (
        outside(AgentChanges(written=runner), {"sympy/core/tests/test_x.py"}, original, "bin/test -C x").written == {}
    )
    assert outside(AgentChanges(written=runner), {"sympy/core/tests/test_x.py"}, original, "pytest").written == runner


def test_the_graded_run_has_a_home_of_its_own():
    row = checked()
    env = graded_env(row)
    assert env["HOME"].startswith("/tmp/graded-home-") and env["HOME"] != graded_env(row)["HOME"]
    assert env["XDG_CONFIG_HOME"].startswith(env["HOME"]) and env["PYTHONNOUSERSITE"] == "1"
    assert env["PYTHONPATH"] == row.repo_path  # the repository first, also where the image installed a copy
    assert graded_script(row).startswith('mkdir -p "$HOME"\n')


# -- grading real logs with swebench's parsers ----------------------------------------------------------------------
TESTS = """
import pytest

def test_add():
    assert 1 + 1 == 2

def test_clamp():
    assert min(5, 0) == 3

@pytest.mark.xfail(reason="known")
def test_known_bug():
    assert False

@pytest.mark.skip(reason="later")
def test_later():
    pass
"""


@pytest.fixture(scope="module")
def pytest_log(tmp_path_factory) -> str:
    """The log of a real `pytest -rA` run: test_add passes, test_clamp fails, one xfail, one skip."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "tests").mkdir()
    (repo / "tests" / "test_calc.py").write_text(textwrap.dedent(TESTS))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "tests/test_calc.py"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "PASSED tests/test_calc.py::test_add" in run.stdout, run.stdout
    assert "FAILED tests/test_calc.py::test_clamp" in run.stdout
    return run.stdout


def graded(log: str, fail_to_pass: list[str], pass_to_pass: list[str], **fields) -> tuple[bool, list[str]]:
    return grade_log(checked(FAIL_TO_PASS=fail_to_pass, PASS_TO_PASS=pass_to_pass, **fields), log)


def test_a_failing_fail_to_pass_test_fails_the_instance(pytest_log):
    passed, failures = graded(pytest_log, ["tests/test_calc.py::test_clamp"], ["tests/test_calc.py::test_add"])
    assert not passed
    assert failures == ["tests/test_calc.py::test_clamp: FAILED"]


def test_a_fail_to_pass_test_must_pass_outright_and_a_pass_to_pass_one_may_xfail(pytest_log):
    """pytest.xfail() planted in the code under test makes XFAIL of every test that reaches it."""
    passed, failures = graded(pytest_log, ["tests/test_calc.py::test_known_bug"], ["tests/test_calc.py::test_add"])
    assert not passed and failures == ["tests/test_calc.py::test_known_bug: XFAIL"]


def test_passed_and_xfail_count_as_passed_skipped_and_missing_do_not(pytest_log):
    assert graded(pytest_log, ["tests/test_calc.py::test_add"], ["tests/test_calc.py::test_known_bug"]) == (True, [])
    passed, failures = graded(
        pytest_log, ["tests/test_calc.py::test_add"], ["tests/test_calc.py::test_later", "tests/test_calc.py::test_x"]
    )
    assert not passed
    # pytest -rA reports a skip as "SKIPPED [1] tests/test_calc.py:14: later", which swebench reads as no test
    assert failures == ["tests/test_calc.py::test_later: missing", "tests/test_calc.py::test_x: missing"]


def test_a_fake_pass_printed_after_the_summary_does_not_hide_the_failure(pytest_log):
    forged = pytest_log + "PASSED tests/test_calc.py::test_clamp\n"
    # swebench's parser alone keeps the last line it read for a test: the forged one
    parse = swe_bench.swebench().pytest_parser
    assert parse(forged, None)["tests/test_calc.py::test_clamp"] == "PASSED"
    passed, failures = graded(forged, ["tests/test_calc.py::test_clamp"], [])
    assert not passed and failures == ["tests/test_calc.py::test_clamp: FAILED"]


def test_an_empty_or_cut_off_log_passes_nothing():
    assert graded("", ["tests/test_calc.py::test_add"], [])[0] is False
    assert graded("collected 4 items\n\x1b[31mKilled\x1b[0m", ["tests/test_calc.py::test_add"], [])[0] is False


def test_the_repository_s_own_parser_reads_its_log():
    """Django's runner writes `name (module.Class) ... ok`; swebench's django parser names tests so."""
    log = (
        "test_clamp (utils_tests.test_numbers.ClampTests) ... ok\n"
        "test_round (utils_tests.test_numbers.ClampTests) ... FAIL\n"
        "======================================================================\n"
        "FAIL: test_round (utils_tests.test_numbers.ClampTests)\n"
    )
    passed, failures = graded(
        log,
        ["test_clamp (utils_tests.test_numbers.ClampTests)"],
        ["test_round (utils_tests.test_numbers.ClampTests)"],
        repo="django/django",
        version="3.0",
    )
    assert not passed and failures == ["test_round (utils_tests.test_numbers.ClampTests): FAILED"]
    assert graded(log, ["test_clamp (utils_tests.test_numbers.ClampTests)"], [], repo="django/django")[0]


def test_a_forged_ok_does_not_hide_a_failure_in_the_runner_s_summary():
    """The code under test prints `ok` where the runner's `... FAIL` would follow, and the newline before it: the
    result line then reads as a pass, and only the summary says the test failed."""
    log = (
        "test_round (utils_tests.test_numbers.ClampTests) ... ok\n"
        "FAIL\n"
        "======================================================================\n"
        "FAIL: test_round (utils_tests.test_numbers.ClampTests)\n"
        "----------------------------------------------------------------------\n"
    )
    name = "test_round (utils_tests.test_numbers.ClampTests)"
    parse = swe_bench.swebench().parsers["django/django"]
    assert parse(log, None).get(name) == "PASSED"  # swebench's parser alone is fooled
    passed, failures = graded(log, [name], [], repo="django/django", version="3.0")
    assert not passed and failures == [f"{name}: FAILED"]


def test_swebench_is_imported_without_docker_modal_or_its_harness():
    probe = (
        "import sys; from prorl_plugins.tasks import swe_bench; swe_bench.swebench(); "
        "print(sorted(m for m in ('docker', 'modal', 'ghapi', 'swebench.harness.run_evaluation') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_prompts_say_where_the_repository_is_and_never_show_the_test_patch():
    task = SweTask()
    system, user = task.system_prompt(row()), task.user_prompt(row())
    assert "/testbed" in system and "/workspace" not in system and "tests" in system
    assert user.startswith("clamp() ignores its upper bound.")
    assert "cd /testbed && python3 -m pytest -rA" in user
    assert "test_clamp" not in system + user and "test_calc.py" not in system + user
