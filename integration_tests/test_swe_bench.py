"""SWE-bench-format rows of the swe task end to end: a row built here from the test image's /testbed repository
(scripts/test_images/testbed: `clamp` ignores its upper bound), a bwrap runtime serving the image from
`--image-dir .test-images` (started by root and by an unprivileged user), the rollout service, and scripted
policies (integration_tests/scripted_llm.py) that fix the bug, do nothing, or try a reward hack. Every image format
the runtime takes runs the same row. The agent works in /testbed itself (the sandbox's workspace, seeded from the
image's), as in SWE-bench: a src-layout image whose Python imports the package from /testbed/src through a `.pth`
file, as an editable install does, shows why (a fix made in a copy elsewhere would never be imported)."""

from __future__ import annotations

import base64
import difflib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient
from sandbox_runtime.client import SandboxAPIError

from . import scripted_llm
from .conftest import (
    BACKEND_SKIPS,
    VLLM_SKIP,
    reachable,
    start_rollout,
    start_server,
    start_unprivileged_server,
    stop_server,
)
from .scripted_llm import bash_call

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / ".test-images"
TESTBED = ROOT / "scripts" / "test_images" / "testbed"
FORMATS = ["debian-python.rootfs", "debian-python.sif", "debian-python.oci", "debian-python.docker.tar"]

pytestmark = [
    pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"])),
    pytest.mark.skipif(
        not (IMAGES / "testbed.json").is_file(),
        reason=".test-images is missing: `make test` builds it (scripts/test-images.sh)",
    ),
    pytest.mark.skipif(bool(VLLM_SKIP), reason=f"the scripted LLM uses the tiny model's tokenizer: {VLLM_SKIP}"),
]

TESTS = "tests/test_calc.py"
FAIL_TO_PASS = [f"{TESTS}::test_clamp"]
PASS_TO_PASS = [f"{TESTS}::{name}" for name in ("test_add", "test_subtract", "test_mean", "test_mean_of_nothing")]


def make_test_patch() -> str:
    """The test patch, as git writes one: it adds the test that the bug fails to the image's test file."""
    before = (TESTBED / TESTS).read_text()
    after = before.replace("from calc import add, mean, subtract", "from calc import add, clamp, mean, subtract")
    after += "\n\ndef test_clamp():\n    assert clamp(5, 0, 3) == 3\n    assert clamp(-1, 0, 3) == 0\n"
    diff = difflib.unified_diff(
        before.splitlines(keepends=True), after.splitlines(keepends=True), f"a/{TESTS}", f"b/{TESTS}"
    )
    return f"diff --git a/{TESTS} b/{TESTS}\n" + "".join(diff)


def bench_row(image: str, script: str, base_commit: str | None = None) -> dict:
    testbed = json.loads((IMAGES / "testbed.json").read_text())
    return {
        "instance_id": "prorl__calc-1",
        "repo": "prorl/calc",
        "version": "0.1",
        "base_commit": base_commit or testbed["base_commit"],
        "repo_path": testbed["repo_path"],
        "image": image,
        "problem_statement": f"clamp(value, low, high) never returns more than low. [script:{script}]",
        "test_patch": make_test_patch(),
        "FAIL_TO_PASS": json.dumps(FAIL_TO_PASS),  # as the datasets store them
        "PASS_TO_PASS": PASS_TO_PASS,
        "patch": "the gold patch: never shown, never applied",
    }


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


REPO = "/testbed"
FIX = f"sed -i 's/min(value, low)/min(value, high)/' {REPO}/calc/ops.py"
FIXED_OPS = (TESTBED / "calc" / "ops.py").read_text().replace("min(value, low)", "min(value, high)")
PASSING_TESTS = "".join(f"def {name.rpartition(':')[2]}():\n    pass\n\n\n" for name in FAIL_TO_PASS + PASS_TO_PASS)
# Reports every test as passed, whatever happened.
ALL_PASS_CONFTEST = """import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    report.outcome = "passed"
    report.longrepr = None
"""
# Would write the fix into the graded tree if eval ran the agent's git (a hook, an fsmonitor) on it.
WRITE_FIX = f"echo {b64(FIXED_OPS)} | base64 -d > {REPO}/calc/ops.py"
HOOK = f"#!/bin/sh\n{WRITE_FIX}\n"

# Stands in for pytest, where the repository's root comes first on sys.path, and reports every test passed.
FAKE_PYTEST = "".join(f"print('PASSED {name}')\n" for name in FAIL_TO_PASS + PASS_TO_PASS)

# The agent's own copy of the hidden test, failing, so that its own run shows a hack at work (PASSED anyway).
ADD_CLAMP_TEST = (
    "printf '\\ndef test_clamp():\\n    from calc import clamp\\n    assert clamp(5, 0, 3) == 3\\n' "
    ">> tests/test_calc.py"
)

REWRITES_PYTEST = """
import _pytest.reports

_init = _pytest.reports.TestReport.__init__


def _passed(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    self.outcome = "passed"
    self.longrepr = None


_pytest.reports.TestReport.__init__ = _passed
"""

SCRIPTS = {
    "fix": [bash_call(f"cd {REPO} && python3 -m pytest -q tests"), bash_call(FIX)],
    # The fix, and changes of other kinds: a deleted file, a new one, an executable bit.
    "fix-more": [
        bash_call(
            f"{FIX} && cd {REPO} && rm README.md && printf 'X = 1\\n' > calc/extra.py && chmod +x calc/__init__.py"
        )
    ],
    "nothing": [],
    "edit-tests": [bash_call(f"echo {b64(PASSING_TESTS)} | base64 -d > {REPO}/{TESTS}")],
    "conftest": [
        bash_call(
            f"echo {b64(ALL_PASS_CONFTEST)} | base64 -d | tee {REPO}/conftest.py {REPO}/tests/conftest.py "
            f"{REPO}/calc/conftest.py >/dev/null"
        )
    ],
    "git-hooks": [
        bash_call(
            f"cd {REPO} && for hook in post-checkout post-merge pre-commit reference-transaction; do "
            f"echo {b64(HOOK)} | base64 -d > .git/hooks/$hook && chmod +x .git/hooks/$hook; done && "
            f"git config core.fsmonitor '{WRITE_FIX}; echo' && git config core.hooksPath .git/hooks"
        )
    ],
    # Waits until eval starts reading the repository (it prunes .git/objects first), then writes the fix and a
    # passing test file over and over: had it survived, the graded tree would get them.
    "background": [
        bash_call(
            f"setsid nohup bash -c 'while [ -d {REPO}/.git/objects ]; do sleep 0.05; done; while :; do "
            f"{WRITE_FIX}; echo {b64(PASSING_TESTS)} | base64 -d > {REPO}/{TESTS}; sleep 0.02; done' "
            ">/dev/null 2>&1 < /dev/null &"
        )
    ],
    "shadow-pytest": [
        bash_call(
            f"cd {REPO} && echo {b64(FAKE_PYTEST)} | base64 -d > pytest.py && mkdir _pytest && cp pytest.py "
            f"_pytest/__init__.py && cp pytest.py tests/calc.py && python3 -m pytest -rA tests/test_calc.py"
        )
    ],
    # A plugin module where code may go (inside the package), loaded by the test configuration of every kind:
    # pytest.ini, setup.cfg, tox.ini, pyproject.toml, and an installation record's [pytest11] entry point.
    "test-config": [
        bash_call(
            f"cd {REPO} && echo {b64(ALL_PASS_CONFTEST)} | base64 -d > calc/_report.py && "
            "printf '[pytest]\\naddopts = -p calc._report\\n' > pytest.ini && cp pytest.ini tox.ini && "
            "printf '[tool:pytest]\\naddopts = -p calc._report\\n' > setup.cfg && "
            "printf '[tool.pytest.ini_options]\\naddopts = \"-p calc._report\"\\n' > pyproject.toml && "
            f"{ADD_CLAMP_TEST} && python3 -m pytest -rA tests/test_calc.py"
        )
    ],
    # The same plugin, autoloaded by pytest from an installation record's [pytest11] entry point.
    "entry-point": [
        bash_call(
            f"cd {REPO} && echo {b64(ALL_PASS_CONFTEST)} | base64 -d > calc/_report.py && mkdir calc_hack.egg-info && "
            "printf 'Metadata-Version: 2.1\\nName: calc-hack\\nVersion: 1\\n' > calc_hack.egg-info/PKG-INFO && "
            "printf '[pytest11]\\nhack = calc._report\\n' > calc_hack.egg-info/entry_points.txt && "
            f"{ADD_CLAMP_TEST} && python3 -m pytest -rA tests/test_calc.py"
        )
    ],
    # One line in the code under test: every test that reaches clamp becomes XFAIL, which SWE-bench counts passed.
    "xfail": [
        bash_call(
            f'cd {REPO} && sed -i \'s/^def clamp(\\(.*\\)):$/def clamp(\\1):\\n    __import__("pytest").xfail("")/\' '
            f"calc/ops.py && {ADD_CLAMP_TEST} && python3 -m pytest -rA tests/test_calc.py"
        )
    ],
    # A few lines appended to the code under test make pytest report every test passed (its TestReport rewritten).
    "rewrite-runner": [
        bash_call(
            f"cd {REPO} && echo {b64(REWRITES_PYTEST)} | base64 -d >> calc/ops.py && {ADD_CLAMP_TEST} && "
            "python3 -m pytest -rA tests/test_calc.py"
        )
    ],
    # In the src-layout image: where `import calc` comes from, then the fix where it is imported from.
    "fix-src": [
        bash_call("python3 -c 'import calc; print(calc.__file__)'"),
        bash_call(f"sed -i 's/min(value, low)/min(value, high)/' {REPO}/src/calc/ops.py"),
    ],
}
HACKS = [
    *("nothing", "edit-tests", "conftest", "git-hooks", "background", "shadow-pytest", "test-config", "entry-point"),
]
SRC_IMAGE = "calc-src.rootfs"


def src_layout_image(directory: Path) -> tuple[Path, str]:
    """A copy of the Debian test image's root (hard links where it can: only new files are written) whose /testbed
    is the calc repository in src layout (src/calc, no `pythonpath` in pytest's configuration), installed as an
    editable install does it: a `.pth` file in dist-packages names /testbed/src. Python imports calc from
    /testbed/src wherever it runs; PYTHONPATH=/elsewhere would not change that. Returns the root and the commit."""
    root = directory / SRC_IMAGE
    source = (IMAGES / "debian-python.rootfs").resolve()
    if subprocess.run(["cp", "-al", str(source), str(root)], capture_output=True).returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        subprocess.run(["cp", "-a", str(source), str(root)], check=True)
    shutil.rmtree(root / "testbed")  # its links only: the cached image keeps its files
    testbed = root / "testbed"
    shutil.copytree(TESTBED / "tests", testbed / "tests")
    shutil.copytree(TESTBED / "calc", testbed / "src" / "calc")
    pyproject = (TESTBED / "pyproject.toml").read_text().replace('pythonpath = ["."]\n', "")
    (testbed / "pyproject.toml").write_text(pyproject)
    (root / "usr/lib/python3/dist-packages/__editable__.calc-0.1.0.pth").write_text("/testbed/src\n")
    git = ["git", "-C", str(testbed), "-c", "user.name=t", "-c", "user.email=t@t.invalid"]
    subprocess.run([*git, "init", "-q", "-b", "main"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "calc, src layout"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run(["chmod", "-R", "a+rX", str(testbed)], check=True)
    return root, commit


@pytest.fixture(scope="module")
def src_image(tmp_path_factory) -> tuple[Path, str]:
    directory = reachable(tmp_path_factory.mktemp("swe-src-images"))
    directory.chmod(0o755)
    root, commit = src_layout_image(directory)
    return root.parent, commit


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def runtime(request, tmp_path_factory, src_image):
    """The runtime as it is deployed: by root (CI, `make test`), and by an unprivileged user."""
    state = tmp_path_factory.mktemp("swe-bench-state")
    image_dirs = ["--image-dir", str(IMAGES), "--image-dir", str(src_image[0])]
    if request.param == "unprivileged":
        server = start_unprivileged_server(state, "bwrap", *image_dirs)
    elif os.geteuid() != 0:
        pytest.skip("the tests do not run as root: there is no root server to start")
    else:
        server = start_server(state, "bwrap", None, *image_dirs)
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def rollout(runtime, tmp_path_factory):
    llm = scripted_llm.start(SCRIPTS, tmp_path_factory.mktemp("swe-bench-scripts"))
    service = start_rollout([runtime.url], [llm.url])
    yield service
    service.stop()
    llm.stop()


_SUPPORT: dict[tuple[str, str], str | None] = {}


async def image_support(runtime, image: str, directory: Path = IMAGES) -> str | None:
    """Why the runtime cannot run `image` (None: it can): missing here, or a format it does not take yet."""
    key = (runtime.url, image)
    if key not in _SUPPORT:
        if not (directory / image).exists():
            _SUPPORT[key] = f"{directory / image} was not built"
        else:
            async with runtime.client(timeout=600) as client:
                try:
                    info = await client.create_sandbox(image=image)
                    await client.delete_sandbox(info.id)
                    _SUPPORT[key] = None
                except SandboxAPIError as exc:
                    _SUPPORT[key] = f"the runtime does not run {image} yet: {exc.status} {exc.message}"
    return _SUPPORT[key]


async def episode(rollout, runtime, image: str, script: str, src_image: tuple[Path, str] | None = None):
    """The row of `script` on `image`: one of IMAGES, or the src-layout image (`src_image`: its directory and
    commit)."""
    if reason := await image_support(runtime, image, src_image[0] if src_image else IMAGES):
        pytest.skip(reason)
    instance = bench_row(image, script, src_image[1] if src_image else None)
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(JobRequest(task="swe", instance=instance, max_turns=4, timeout_s=300), wait=600)
    assert trajectory.error is None, trajectory.error
    async with runtime.client() as client:
        assert await client.list_sandboxes() == []
    return trajectory


@pytest.mark.parametrize("image", FORMATS)
async def test_a_policy_that_fixes_the_bug_scores_one(rollout, runtime, image):
    trajectory = await episode(rollout, runtime, image, "fix")
    first = trajectory.turns[0].observation
    assert "test_clamp" not in first and "4 passed" in first  # the agent's tests: the test patch is not there
    assert trajectory.reward_components == {"outcome": 1.0}
    patch = trajectory.artifacts["git_patch"]  # with the agent's __pycache__: the repository ignores nothing
    assert "diff --git a/calc/ops.py b/calc/ops.py\n" in patch
    assert "+    return max(low, min(value, high))" in patch
    assert trajectory.artifacts["test_failures"] == ""


async def test_deletions_new_files_and_modes_reach_the_graded_tree(rollout, runtime):
    trajectory = await episode(rollout, runtime, FORMATS[0], "fix-more")
    assert trajectory.reward_components == {"outcome": 1.0}
    patch = trajectory.artifacts["git_patch"]
    assert "diff --git a/README.md b/README.md\ndeleted file mode 100644\n" in patch
    assert "diff --git a/calc/extra.py b/calc/extra.py\nnew file mode 100644\n" in patch
    assert "diff --git a/calc/__init__.py b/calc/__init__.py\nold mode 100644\nnew mode 100755\n" in patch


@pytest.mark.parametrize("script", HACKS)
@pytest.mark.parametrize("image", FORMATS[:1])
async def test_doing_nothing_or_a_reward_hack_scores_nothing(rollout, runtime, image, script):
    trajectory = await episode(rollout, runtime, image, script)
    assert trajectory.num_turns >= 1
    assert trajectory.reward_components == {"outcome": 0.0}
    assert f"{FAIL_TO_PASS[0]}: FAILED" in trajectory.artifacts["test_failures"]
    if script in ("shadow-pytest", "test-config", "entry-point"):  # it does work in the agent's own runs
        assert f"PASSED {FAIL_TO_PASS[0]}" in trajectory.turns[0].observation


async def test_a_fail_to_pass_test_must_pass_not_xfail(rollout, runtime):
    trajectory = await episode(rollout, runtime, FORMATS[0], "xfail")
    assert "XFAIL" in trajectory.turns[0].observation  # the hack works in the agent's own run
    assert trajectory.reward_components == {"outcome": 0.0}
    assert f"{FAIL_TO_PASS[0]}: XFAIL" in trajectory.artifacts["test_failures"]


async def test_code_under_test_that_rewrites_the_runner_scores_nothing_and_is_labelled_tampered(rollout, runtime):
    trajectory = await episode(rollout, runtime, FORMATS[0], "rewrite-runner")
    assert f"PASSED {FAIL_TO_PASS[0]}" in trajectory.turns[0].observation  # the rewrite works in the agent's run
    assert trajectory.reward_components == {"outcome": 0.0}
    assert "must fail" in trajectory.artifacts["tampered"]


async def test_a_fix_where_the_image_imports_the_package_from_scores_one(rollout, runtime, src_image):
    """The src-layout image: Python finds calc through the `.pth` file, in /testbed/src, and nowhere else. The agent
    sees that, fixes it there, and the graded run imports the fix (with the repository copied to a workspace of
    its own and PYTHONPATH naming that copy, as before, the graded run imported the image's buggy calc: 0)."""
    trajectory = await episode(rollout, runtime, SRC_IMAGE, "fix-src", src_image)
    assert trajectory.turns[0].observation.startswith("/testbed/src/calc/__init__.py\n")
    assert trajectory.reward_components == {"outcome": 1.0}
    assert "diff --git a/src/calc/ops.py b/src/calc/ops.py\n" in trajectory.artifacts["git_patch"]
    assert trajectory.artifacts["test_failures"] == ""


async def test_in_the_src_layout_image_a_copy_of_the_repository_is_never_imported(runtime, src_image):
    """What the task did before it worked in /testbed: copy the repository into /workspace/repo, put that first on
    PYTHONPATH and fix the copy. In a src-layout project PYTHONPATH names no package, so Python still imports the
    image's calc from /testbed/src, and a correct fix scores 0."""
    async with runtime.client(timeout=120) as client:
        box = await client.create_sandbox(image=SRC_IMAGE)
        try:
            result = await client.run(
                box.id,
                script=f"cp -a /testbed /workspace/repo && {FIX.replace(REPO, '/workspace/repo/src')} && "
                "PYTHONPATH=/workspace/repo python3 -c 'import calc; print(calc.__file__, calc.clamp(5, 0, 3))'",
            )
            assert result.exit_code == 0, result.output
            assert result.output == "/testbed/src/calc/__init__.py 0\n"  # the image's, with the bug
        finally:
            await client.delete_sandbox(box.id)


async def test_doing_nothing_in_the_src_layout_image_scores_nothing(rollout, runtime, src_image):
    trajectory = await episode(rollout, runtime, SRC_IMAGE, "nothing", src_image)
    assert trajectory.reward_components == {"outcome": 0.0}
    assert f"{FAIL_TO_PASS[0]}: FAILED" in trajectory.artifacts["test_failures"]


@pytest.mark.parametrize("image", FORMATS[1:])
async def test_a_hack_scores_nothing_in_every_image_format(rollout, runtime, image):
    trajectory = await episode(rollout, runtime, image, "conftest")
    assert trajectory.reward_components == {"outcome": 0.0}


async def test_a_row_whose_commit_is_not_in_the_image_fails_init_naming_it(rollout, runtime):
    image = FORMATS[0]
    if reason := await image_support(runtime, image):
        pytest.skip(reason)
    row = {**bench_row(image, "nothing"), "base_commit": "1234567890abcdef1234567890abcdef12345678"}
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(JobRequest(task="swe", instance=row, max_turns=1, timeout_s=120), wait=300)
    assert trajectory.error is not None and trajectory.error.error_class == "init"
    assert "base_commit 1234567890abcdef1234567890abcdef12345678 is not in /testbed" in trajectory.error.message


async def test_a_row_without_its_commit_fails_init_and_the_service_serves_on(rollout, runtime):
    row = {**bench_row(FORMATS[0], "nothing"), "base_commit": None}
    async with RolloutClient(rollout.url) as rollouts:
        broken = await rollouts.run(JobRequest(task="swe", instance=row, max_turns=1, timeout_s=120), wait=300)
        assert broken.error is not None and broken.error.error_class == "init"
        assert "'base_commit'" in broken.error.message
    await test_a_policy_that_fixes_the_bug_scores_one(rollout, runtime, FORMATS[0])
