"""Harbor tasks end to end (issue 44): task directories made here (tests/harbor_tasks.py) on the Debian test image,
a bwrap runtime serving `--image-dir .test-images` (started by root and by an unprivileged user), the rollout
service with the directory allowed (PRORL_HARBOR_DATASETS), and scripted policies (integration_tests/scripted_llm.py)
that solve a task, do nothing, or go after the tests and the reward file before eval. Then `prorl-harbor check` on a
dataset with a task whose oracle fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.trainer.client import RolloutClient
from tests.harbor_tasks import SECRET, calc_task, dataset, hello_task, pytest_task

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
IMAGE = "debian-python.rootfs"

pytestmark = [
    pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"])),
    pytest.mark.skipif(
        not (IMAGES / IMAGE).is_dir(), reason=".test-images is missing: `make test` builds it (scripts/test-images.sh)"
    ),
    pytest.mark.skipif(bool(VLLM_SKIP), reason=f"the scripted LLM uses the tiny model's tokenizer: {VLLM_SKIP}"),
]

CALC = '"""Arithmetic."""\n\n\ndef add(a, b):\n    return a + b\n'
# A conftest.py that makes every pytest session pass, whatever its tests found.
CONFTEST = "def pytest_sessionfinish(session, exitstatus):\n    session.exitstatus = 0\n"
# What an agent would try, before eval, to see or steer the verifier.
READS = (
    "ls -la /tests /solution /logs /logs/verifier 2>&1; "
    "cat /tests/test.sh /tests/expected.txt /solution/solve.sh 2>&1; "
    f"grep -rs {SECRET} /tmp /app /tests /logs /solution /root /home 2>&1 | head; ls -la /tmp"
)
WRITES = (
    "mkdir -p /tests /logs/verifier 2>&1; echo 1 > /logs/verifier/reward.txt; "
    "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh; "
    "echo 1 > /tmp/reward.txt; mkdir -p /app/logs/verifier /app/tests && echo 1 > /app/logs/verifier/reward.txt && "
    "cp /app/logs/verifier/reward.txt /app/tests/expected.txt; echo tried"
)
# A process left behind that writes reward 1 into every verifier directory it finds, and replaces test.sh.
PLANTS = (
    "setsid bash -c 'while true; do for d in /tmp/harbor-*; do mkdir -p $d/logs/verifier; "
    'echo 1 > $d/logs/verifier/reward.txt; printf "echo 1 > $d/logs/verifier/reward.txt" > $d/tests/test.sh; '
    "done 2>/dev/null; sleep 0.01; done' > /dev/null 2>&1 < /dev/null & echo planted"
)


def editor_call(**arguments: object) -> str:
    return "<tool_call>" + json.dumps({"name": "str_replace_editor", "arguments": arguments}) + "</tool_call>"


PYTEST_ATTACKS = ("pytest-conftest", "pytest-ini", "pytest-shadow")
SCRIPTS = {
    "hello-honest": [bash_call("echo hello > /app/hello.txt")],
    # Through the SWE editing tools: a file made, then fixed by an exact-once replacement.
    "hello-editor": [
        editor_call(command="create", path="/app/hello.txt", file_text="helo\n"),
        editor_call(command="str_replace", path="/app/hello.txt", old_str="helo", new_str="hello"),
    ],
    "hello-nothing": [],
    "hello-reads": [bash_call(READS)],
    "hello-writes": [bash_call(WRITES)],
    "hello-plants": [bash_call(PLANTS)],
    "calc-honest": [bash_call(f"printf '%s' '{CALC}' > /app/calc.py && cat /app/calc.py")],
    "calc-no-docstring": [bash_call("printf 'def add(a, b):\\n    return a + b\\n' > /app/calc.py")],
    # A pytest-run task, and what an agent leaves for pytest to find at eval instead of the answer.
    "pytest-honest": [bash_call("echo hello > /app/hello.txt")],
    "pytest-conftest": [bash_call(f"printf '%s' '{CONFTEST}' > /tmp/conftest.py && echo left")],
    "pytest-ini": [bash_call("printf '[pytest]\\naddopts = --co\\n' > /tmp/pytest.ini && echo left")],
    "pytest-shadow": [bash_call("printf 'import sys\\nsys.exit(0)\\n' > /app/pytest.py && echo left")],
}


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """A directory of tasks, one per script (the script's name in its prompt, which picks what the policy does)."""
    root = reachable(tmp_path_factory.mktemp("harbor-tasks"))
    for script in SCRIPTS:
        make = {"calc": calc_task, "pytest": pytest_task}.get(script.split("-")[0], hello_task)
        make(root, script, prompt_suffix=f"[script:{script}]")
    return root


@pytest.fixture(scope="module", params=["root", "unprivileged"])
def runtime(request, tmp_path_factory):
    """The runtime as it is deployed: by root (CI, `make test`), and by an unprivileged user."""
    state = tmp_path_factory.mktemp("harbor-state")
    if request.param == "unprivileged":
        server = start_unprivileged_server(state, "bwrap", "--image-dir", str(IMAGES))
    elif os.geteuid() != 0:
        pytest.skip("the tests do not run as root: there is no root server to start")
    else:
        server = start_server(state, "bwrap", None, "--image-dir", str(IMAGES))
    yield server
    stop_server(server)


@pytest.fixture(scope="module")
def rollout(runtime, tasks, tmp_path_factory):
    llm = scripted_llm.start(SCRIPTS, tmp_path_factory.mktemp("harbor-scripts"))
    with mock.patch.dict(os.environ, {"PRORL_HARBOR_DATASETS": str(tasks)}):
        service = start_rollout([runtime.url], [llm.url])
    yield service
    service.stop()
    llm.stop()


async def episode(rollout, runtime, tasks: Path, script: str, **fields):
    instance = {"path": str(tasks / script), "image": IMAGE, **fields}
    async with RolloutClient(rollout.url) as rollouts:
        trajectory = await rollouts.run(
            JobRequest(task="harbor", instance=instance, max_turns=3, timeout_s=300), wait=600
        )
    assert trajectory.error is None, trajectory.error
    async with runtime.client() as client:
        assert await client.list_sandboxes() == []
    return trajectory


@pytest.mark.parametrize(("script", "reward"), [("hello-honest", 1.0), ("hello-nothing", 0.0)])
async def test_a_task_scored_by_reward_txt(rollout, runtime, tasks, script, reward):
    trajectory = await episode(rollout, runtime, tasks, script)
    assert trajectory.reward_components == {"outcome": reward}
    assert trajectory.artifacts["verifier_rewards"].strip() == str(int(reward))
    assert "verifier_error" not in trajectory.artifacts


async def test_a_task_solved_through_the_editor_tools(rollout, runtime, tasks):
    tools = ["bash", "str_replace_editor", "search", "finish"]
    trajectory = await episode(rollout, runtime, tasks, "hello-editor", tools=tools)
    assert [call.name for turn in trajectory.turns for call in turn.tool_calls] == ["str_replace_editor"] * 2 + [
        "finish"
    ]
    assert "hello" in trajectory.turns[1].observation  # the edited lines, shown back
    assert trajectory.reward_components == {"outcome": 1.0}


@pytest.mark.parametrize(("script", "style"), [("calc-honest", 0.2), ("calc-no-docstring", 0.0)])
async def test_reward_json_gives_its_reward_and_keeps_the_other_entries_beside_it(
    rollout, runtime, tasks, script, style
):
    """{"reward": 1, "style": 0.2}: the reward is 1 (Harbor's primary entry); `style` is a metric, kept in the
    artifact, never added to the reward."""
    trajectory = await episode(rollout, runtime, tasks, script)
    assert trajectory.reward_components == {"outcome": 1.0} and trajectory.reward == 1.0
    assert json.loads(trajectory.artifacts["verifier_rewards"]) == {"reward": 1.0, "style": style}


async def test_before_eval_the_agent_finds_no_test_and_no_solution(rollout, runtime, tasks):
    trajectory = await episode(rollout, runtime, tasks, "hello-reads")
    observation = trajectory.turns[0].observation
    assert "No such file or directory" in observation  # /tests, /solution, /logs are not there
    assert SECRET not in observation
    assert trajectory.reward_components == {"outcome": 0.0}


@pytest.mark.parametrize("script", ["hello-writes", "hello-plants"])
async def test_what_the_agent_writes_or_leaves_running_before_eval_counts_for_nothing(rollout, runtime, tasks, script):
    trajectory = await episode(rollout, runtime, tasks, script)
    said = "tried" if script == "hello-writes" else "planted"
    assert trajectory.turns[0].observation.endswith(f"{said}\n[exit code 0]")
    assert trajectory.reward_components == {"outcome": 0.0}
    assert trajectory.artifacts["verifier_rewards"].strip() == "0"


@pytest.mark.parametrize(("script", "reward"), [("pytest-honest", 1.0), *((a, 0.0) for a in PYTEST_ATTACKS)])
async def test_what_the_agent_leaves_for_pytest_to_find_counts_for_nothing(rollout, runtime, tasks, script, reward):
    """A conftest.py or pytest.ini in /tmp (above the tests, which eval places in /tmp), a pytest.py in the working
    directory (where `python3 -m pytest` would import it from): each would pass a failing test."""
    trajectory = await episode(rollout, runtime, tasks, script)
    assert trajectory.reward_components == {"outcome": reward}, trajectory.artifacts.get("verifier_log")


async def test_the_oracle_check_flags_the_task_whose_solution_fails(runtime, tmp_path_factory):
    tasks = dataset(reachable(tmp_path_factory.mktemp("harbor-dataset")) / "tasks")
    command = [sys.executable, "-m", "prorl_plugins.tasks.harbor_check", "check", str(tasks)]
    command += ["--sandbox-url", runtime.url, "--image-template", IMAGE]
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:-1]}
    assert lines["hello-txt"].split()[1:] == ["1", "0", "ok"]
    assert lines["calc-json"].split()[1:] == ["1", "0", "ok"]
    assert "BROKEN: the oracle (solution/solve.sh) scores 0, not 1" in lines["broken-oracle"]
    assert result.stdout.splitlines()[-1] == "3 tasks, 1 broken"
    async with runtime.client() as client:
        assert await client.list_sandboxes() == []
