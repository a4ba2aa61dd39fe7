"""SWE-bench-format rows of the swe task end to end: a row built here from the test image's /testbed repository
(scripts/test_images/testbed: `clamp` ignores its upper bound), a bwrap runtime serving the image from
`--image-dir .test-images` (started by root and by an unprivileged user), the rollout service, and scripted
policies (integration_tests/scripted_llm.py) that fix the bug, do nothing, or try a reward hack. Every image format
the runtime takes runs the same row."""

from __future__ import annotations

import base64
import difflib
import json
import os
from pathlib import Path

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient
from sandbox_runtime.client import SandboxAPIError

from . import scripted_llm
from .conftest import (
    BACKEND_SKIPS,
    VLLM_SKIP,
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


def bench_row(image: str, script: str) -> dict:
    testbed = json.loads((IMAGES / "testbed.json").read_text())
    return {
        "instance_id": "prorl__calc-1",
        "repo": "prorl/calc",
        "version": "0.1",
        "base_commit": testbed["base_commit"],
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


REPO = "/workspace/repo"
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
    "write-testbed": [bash_call("sed -i 's/min(value, low)/min(value, high)/' /testbed/calc/ops.py; echo status=$?")],
}
HACKS = ["nothing", "edit-tests", "conftest", "git-hooks", "background", "shadow-pytest", "write-testbed"]


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def runtime(request, tmp_path_factory):
    """The runtime as it is deployed: by root (CI, `make test`), and by an unprivileged user."""
    state = tmp_path_factory.mktemp("swe-bench-state")
    if request.param == "unprivileged":
        server = start_unprivileged_server(state, "bwrap", "--image-dir", str(IMAGES))
    elif os.geteuid() != 0:
        pytest.skip("the tests do not run as root: there is no root server to start")
    else:
        server = start_server(state, "bwrap", None, "--image-dir", str(IMAGES))
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


async def image_support(runtime, image: str) -> str | None:
    """Why the runtime cannot run `image` (None: it can): missing here, or a format it does not take yet."""
    key = (runtime.url, image)
    if key not in _SUPPORT:
        if not (IMAGES / image).exists():
            _SUPPORT[key] = f"{IMAGES / image} was not built"
        else:
            async with runtime.client(timeout=600) as client:
                try:
                    info = await client.create_sandbox(image=image)
                    await client.delete_sandbox(info.id)
                    _SUPPORT[key] = None
                except SandboxAPIError as exc:
                    _SUPPORT[key] = f"the runtime does not run {image} yet: {exc.status} {exc.message}"
    return _SUPPORT[key]


async def episode(rollout, runtime, image: str, script: str):
    if reason := await image_support(runtime, image):
        pytest.skip(reason)
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(
            JobRequest(task="swe", instance=bench_row(image, script), max_turns=4, timeout_s=300), wait=600
        )
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
    if script == "shadow-pytest":  # it does take pytest's place in the agent's own runs
        assert f"PASSED {FAIL_TO_PASS[0]}" in trajectory.turns[0].observation
    if script == "write-testbed":
        assert "Read-only file system" in trajectory.turns[0].observation
        assert "status=0" not in trajectory.turns[0].observation


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
