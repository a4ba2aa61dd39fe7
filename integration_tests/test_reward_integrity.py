"""Grading that the code under test cannot talk into a pass (issue 47, items 1-4), end to end: scripted policies
(integration_tests/scripted_llm.py) plant each hack through the rollout service, against a bwrap runtime started by
root and by an unprivileged user (test_security's `server` fixture). Each test is a hole that was open before: an own
row's `unittest.py`, a runner rewritten by the code under test, a shell check that imported the agent's `json.py`, a
grading that froze the service on a big file."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from pathlib import Path

import httpx
import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient
from tests.test_swe_canary import SELECTIVE_UNITTEST

from . import scripted_llm
from .conftest import BACKEND_SKIPS, start_rollout
from .scripted_llm import bash_call
from .test_security import server, swe_job  # noqa: F401 - `server`: the runtime, as root and unprivileged

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


FIX = "cd repo && sed -i 's/a - b/a + b/' calc.py"
FAKE_UNITTEST = "import sys\nprint('test_add (test_calc.TestAdd.test_add) ... ok')\nsys.exit(0)\n"
# Appended to the code under test: unittest's TestCase.run reports every test passed.
REWRITES_UNITTEST = (
    "\nimport unittest\n\n\ndef _run(self, result=None):\n    result.startTest(self)\n    result.addSuccess(self)\n"
    "    result.stopTest(self)\n\n\nunittest.TestCase.run = _run\n"
)
CHECK = (
    'test -f out.json && python3 -c \'import json, sys; sys.exit(0 if json.load(open("out.json"))["ok"] is True '
    "else 1)'"
)
NOT_OK = "echo '{\"ok\": false}' > out.json"
JSON_OK = "def load(f):\n    return {'ok': True}\n"
BIG_FILE_BYTES = 60_000_000
# Reported truthfully but for the tests that called into the package, whose failures it turns into passes.
FORGES_ONLY_PACKAGE_TESTS = SELECTIVE_UNITTEST
# Fixes one case and ends the run, exit status 0, on the input of the test it does not fix.
EXITS_ON_THE_FAILING_INPUT = (
    "import os\n\n\ndef add(a, b):\n    if (a, b) == (2, 3):\n        os._exit(0)\n    return a + b\n"
)
TWO_CLASSES = (
    "import unittest\nfrom calc import add\n\n\nclass TestAdd(unittest.TestCase):\n"
    "    def test_add_zero(self):\n        self.assertEqual(add(0, 0), 0)\n\n\n"
    "@(lambda cls: cls)\nclass TestZ(unittest.TestCase):\n"
    "    def test_add(self):\n        self.assertEqual(add(2, 3), 5)\n"
)
# A git-based check, and a ~/.gitconfig in the workspace (the sandbox's HOME) whose fsmonitor writes the answer.
GIT_CHECK = "git -C proj status --porcelain >/dev/null 2>&1; test -s proj/answer.txt"
FSMONITOR = "mkdir proj && git -C proj init -q && git config --global core.fsmonitor 'echo 42 > answer.txt; false'"

SCRIPTS = {
    "honest": [bash_call(FIX)],
    "unittest-module": [bash_call(f"cd repo && echo {b64(FAKE_UNITTEST)} | base64 -d > unittest.py && git add -A")],
    "unittest-package": [
        bash_call(f"cd repo && mkdir unittest && echo {b64(FAKE_UNITTEST)} | base64 -d > unittest/__init__.py")
    ],
    "rewrite-unittest": [
        bash_call(f"cd repo && echo {b64(REWRITES_UNITTEST)} | base64 -d >> calc.py && python3 -m unittest -v")
    ],
    "big-file": [bash_call(f"{FIX} && yes 'x = 1' | head -c {BIG_FILE_BYTES} > big.txt")],
    "forge-package-tests": [
        bash_call(f"cd repo && echo {b64(FORGES_ONLY_PACKAGE_TESTS)} | base64 -d >> calc.py && python3 -m unittest -v")
    ],
    "exit-on-failing-input": [bash_call(f"cd repo && echo {b64(EXITS_ON_THE_FAILING_INPUT)} | base64 -d > calc.py")],
    "fix-two-classes": [bash_call(FIX)],
    "shell-gitconfig": [bash_call(FSMONITOR)],
    "shell-git-honest": [bash_call("mkdir proj && git -C proj init -q && echo 42 > proj/answer.txt")],
    "shell-honest": [bash_call("echo '{\"ok\": true}' > out.json")],
    "shell-json-module": [bash_call(f"{NOT_OK} && echo {b64(JSON_OK)} | base64 -d > json.py")],
    "shell-user-site": [
        bash_call(
            f'{NOT_OK} && d=$(python3 -m site --user-site) && mkdir -p "$d" && '
            'echo \'import json; json.load = lambda f: {"ok": True}\' > "$d/planted.pth"'
        )
    ],
    "shell-exported-path": [
        bash_call(f"{NOT_OK} && mkdir -p /tmp/p && echo {b64(JSON_OK)} | base64 -d > /tmp/p/json.py"),
        bash_call("export PYTHONPATH=/tmp/p"),
    ],
}


@pytest.fixture(scope="module")
def rollout(server, tmp_path_factory):  # noqa: F811 - the imported fixture
    llm = scripted_llm.start(SCRIPTS, tmp_path_factory.mktemp("integrity-scripts"))
    service = start_rollout([server.url], [llm.url])
    yield service
    service.stop()
    llm.stop()


NAMED = {"FAIL_TO_PASS": ["test_add (test_calc.TestAdd)"], "PASS_TO_PASS": []}


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
@pytest.mark.parametrize(
    ("script", "reward"),
    [("honest", 1.0), ("unittest-module", 0.0), ("unittest-package", 0.0), ("rewrite-unittest", 0.0)],
)
async def test_an_own_row_cannot_be_talked_into_a_pass(rollout, script, reward, named):
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(swe_job(script, **(NAMED if named else {})), wait=300)
    assert trajectory.error is None, trajectory.error
    assert trajectory.reward_components == {"outcome": reward}
    if script == "rewrite-unittest":
        assert "OK" in trajectory.turns[0].observation  # the rewrite works in the agent's own run
        assert "must fail" in trajectory.artifacts["tampered"]
    else:
        assert "tampered" not in trajectory.artifacts


@pytest.mark.parametrize("named", [False, True], ids=["unnamed", "named"])
async def test_a_runner_that_forges_only_the_packages_tests_is_caught(rollout, named):
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(swe_job("forge-package-tests", **(NAMED if named else {})), wait=300)
    assert trajectory.error is None, trajectory.error
    assert "OK" in trajectory.turns[0].observation  # the forging works in the agent's own run
    assert trajectory.reward_components == {"outcome": 0.0}
    assert "must fail" in trajectory.artifacts["tampered"]


@pytest.mark.parametrize(("script", "reward"), [("fix-two-classes", 1.0), ("exit-on-failing-input", 0.0)])
async def test_a_row_without_names_needs_every_test_it_runs_reported(rollout, script, reward):
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(swe_job(script, test_files={"test_calc.py": TWO_CLASSES}), wait=300)
    assert trajectory.error is None, trajectory.error
    assert trajectory.reward_components == {"outcome": reward}, trajectory.artifacts
    assert "tampered" not in trajectory.artifacts
    if reward == 0.0:
        assert "TestZ::test_add: missing" in trajectory.artifacts["test_failures"]


async def test_tampered_gradings_are_counted(rollout):
    async with RolloutClient(rollout.url) as rollouts:
        await rollouts.run(swe_job("rewrite-unittest"), wait=300)
    async with httpx.AsyncClient(base_url=rollout.url) as http:
        text = (await http.get("/metrics")).text
    found = re.search(r'^prorl_rollout_tampered_gradings_total\{task="swe"\} (\S+)$', text, re.MULTILINE)
    assert found and float(found[1]) >= 1


async def test_a_shell_check_reads_no_git_configuration_from_the_workspace(rollout):
    rewards = []
    for script in ("shell-git-honest", "shell-gitconfig"):
        job = JobRequest(
            task="shell",
            instance={"goal": f"Write proj/answer.txt. [script:{script}]", "check": GIT_CHECK},
            max_turns=3,
        )
        async with RolloutClient(rollout.url) as rollouts:
            trajectory = await rollouts.run(job, wait=300)
        assert trajectory.error is None, trajectory.error
        rewards.append(trajectory.reward_components["outcome"])
    assert rewards == [1.0, 0.0]


@pytest.mark.parametrize(
    ("script", "reward"),
    [("shell-honest", 1.0), ("shell-json-module", 0.0), ("shell-user-site", 0.0), ("shell-exported-path", 0.0)],
)
async def test_a_shell_check_imports_nothing_from_the_workspace(rollout, script, reward):
    job = JobRequest(task="shell", instance={"goal": f"Write out.json. [script:{script}]", "check": CHECK}, max_turns=3)
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(job, wait=300)
    assert trajectory.error is None, trajectory.error
    assert trajectory.reward_components == {"outcome": reward}


def peak_rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmHWM:\s+(\d+) kB$", status, re.MULTILINE)[1]) * 1024


async def test_grading_a_big_file_keeps_the_service_responsive_and_bounded(rollout):
    peak_before = peak_rss_bytes(rollout.process.pid)
    slowest = 0.0
    async with RolloutClient(rollout.url) as rollouts, httpx.AsyncClient(base_url=rollout.url, timeout=60) as http:
        episode = asyncio.ensure_future(rollouts.run(swe_job("big-file"), wait=300))
        while not episode.done():  # /healthz asked one after another for the whole episode, its grading included
            started = time.monotonic()
            assert (await http.get("/healthz")).status_code == 200
            slowest = max(slowest, time.monotonic() - started)
            await asyncio.wait([episode], timeout=0.05)
        trajectory = episode.result()
    grown = peak_rss_bytes(rollout.process.pid) - peak_before
    print(f"/healthz slowest {slowest:.3f} s; peak memory grown by {grown >> 20} MiB")
    assert trajectory.error is None, trajectory.error
    assert slowest < 2.0, f"/healthz took {slowest:.1f} s while a big file was graded"
    assert grown < 1 << 30, f"the service's peak memory grew by {grown >> 20} MiB grading one episode"
    assert trajectory.reward_components == {"outcome": 1.0}
    assert "Binary files /dev/null and b/big.txt differ" in trajectory.artifacts["git_patch"]
    assert trajectory.artifacts["patch_truncated"] == "big.txt"  # named: what the patch cannot show
    assert len(json.dumps(trajectory.artifacts)) < 1 << 20
