"""The example third-party plugin (examples/custom_plugin) taken the way a user takes it: installed with
`pip install -e`, listed by `prorl-rollout plugins`, its hooks called through plugin sets built from the entry
points (two configurations in one process), and real countdown episodes through the rollout service (vLLM's
tiny model, bwrap sandboxes).

An installed package's entry points and import hook are seen by new processes, so everything that needs the
installed plugin runs in a subprocess; the package is uninstalled at the end of the module.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.models import JobRequest, SamplingParams
from prorl_adapter.service.chat import tool_call_regex
from prorl_adapter.trainer.client import RolloutClient

from .conftest import start_rollout

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_plugin"
DISTRIBUTION = "prorl-plugin-countdown"
PUZZLE = {"numbers": [25, 3, 7], "target": 46, "id": "cd-46"}


def pip(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=600)


def python(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120)


def is_installed() -> bool:
    try:
        importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(scope="module")
def installed(request) -> None:
    """`pip install -e examples/custom_plugin` into this environment; uninstalled at the end unless it was
    installed before. Offline: no dependencies (prorl-adapter is here), and no build isolation where `wheel`
    is present (older setuptools need it for an editable install); otherwise the isolated build gets its
    setuptools from the configured index, as `make` does for the project itself."""
    egg_info = EXAMPLE / "prorl_plugin_countdown.egg-info"
    had_egg_info, was_installed = egg_info.exists(), is_installed()

    def uninstall() -> None:
        if not was_installed:
            pip("uninstall", "--yes", DISTRIBUTION)
        if not had_egg_info:
            shutil.rmtree(egg_info, ignore_errors=True)

    request.addfinalizer(uninstall)
    isolation = ["--no-build-isolation"] if importlib.util.find_spec("wheel") else []
    result = pip("install", "--quiet", "--no-deps", *isolation, "--editable", str(EXAMPLE))
    assert result.returncode == 0, f"pip install -e {EXAMPLE} failed:\n{result.stdout}\n{result.stderr}"


def test_prorl_rollout_plugins_lists_the_plugin_and_its_task(installed):
    listed = python("-m", "prorl_adapter", "plugins")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    hooks = "prorl_register_tasks,prorl_reward_components,prorl_stage_event"
    assert f"countdown: CountdownPlugin hooks={hooks}" in lines
    assert "task countdown: prorl_plugin_countdown.task.CountdownTask" in lines
    assert "task shell: prorl_plugins.tasks.shell.ShellTask" in lines  # beside the built-in ones

    blocked = python("-m", "prorl_adapter", "plugins", "--block-plugin", "countdown")
    assert blocked.returncode == 0, blocked.stderr
    assert "CountdownPlugin" not in blocked.stdout and "task countdown" not in blocked.stdout
    assert "task shell:" in blocked.stdout


# Runs in a fresh interpreter, which sees the installed entry point; prints what the test checks.
HOOKS_SCRIPT = textwrap.dedent(
    """
    import json
    from prorl_adapter.hooks import PluginSet
    from prorl_adapter.models import StageTimings, ToolCall, Trajectory, Turn

    def trajectory(task, *commands):
        turns = [
            Turn(index=i, policy_version=0, llm_server="http://llm", response_start=0, response_tokens=1,
                 finish_reason="stop", text="", tool_calls=[ToolCall(name="bash", arguments={"command": c})])
            for i, c in enumerate(commands)
        ]
        return Trajectory(
            job_id="j", task=task, prompt_ids=[1], response_ids=[2], response_mask=[1], response_logprobs=[0.0],
            turns=turns, num_turns=len(turns), finish_reason="max_turns", reward_components={"outcome": 0.0},
            policy_version_min=0, policy_version_max=0, timings=StageTimings(),
        )

    def shaped(plugins, t, instance):
        components, reward = plugins.shaped_reward(t, instance, t.reward_components)
        return {"components": components, "reward": reward}

    # The entry points, as `prorl-rollout serve` loads them: one plugin set without configuration, one with.
    default = PluginSet.load()
    configured = PluginSet.load({"countdown": {"repeat_penalty": 0.5}})
    looping = trajectory("countdown", "cat puzzle.txt", "ls", "cat puzzle.txt", "cat puzzle.txt")
    results = {
        "plugins": {d["name"]: d["plugin"] for d in default.describe()},
        "task": type(default.tasks()["countdown"]).__name__,
        "configured": shaped(configured, looping, PUZZLE),
        "default": shaped(default, looping, PUZZLE),  # the other set's configuration does not reach this one
        "shell": shaped(default, trajectory("shell", "ls", "ls"), {}),
    }
    try:
        PluginSet.load({"countdown": {"repeat_penalty": -1}})
    except Exception as exc:
        results["bad_config"] = f"{type(exc).__name__}: {exc}"
    print(json.dumps(results))
    """
)


def test_plugin_sets_load_its_task_and_reward_rule_each_with_its_own_configuration(installed):
    ran = python("-c", f"PUZZLE = {PUZZLE!r}\n{HOOKS_SCRIPT}")
    assert ran.returncode == 0, ran.stderr
    results = json.loads(ran.stdout)
    assert results["plugins"]["countdown"] == "CountdownPlugin" and results["task"] == "CountdownTask"
    # Two of the four calls repeat an earlier one; the built-in plugins are inert without configuration.
    assert results["default"] == {
        "components": {"outcome": 0.0, "repeats": pytest.approx(-0.1)},
        "reward": pytest.approx(-0.1),
    }
    assert results["configured"] == {"components": {"outcome": 0.0, "repeats": -1.0}, "reward": -1.0}
    assert results["shell"] == {"components": {"outcome": 0.0}, "reward": 0.0}  # no opinion on other tasks
    assert results["bad_config"] == (
        "PluginConfigError: countdown: countdown.repeat_penalty must be a number >= 0, got -1"
    )


def test_a_bad_plugin_config_stops_the_service_at_start_up(installed, tmp_path):
    config = tmp_path / "plugins.json"
    config.write_text(json.dumps({"countdown": {"repeat_penalty": "lots"}}))
    log = tmp_path / "rollout.log"
    with pytest.raises(RuntimeError, match="exited with status"):
        unreachable = ["http://127.0.0.1:9"]  # never reached: configuration comes first
        localstack.start_rollout_service(unreachable, unreachable, "--plugin-config", str(config), log=log)
    assert "countdown.repeat_penalty must be a number >= 0, got 'lots'" in log.read_text()


# -- real episodes ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rollout(installed, vllm, bwrap_runtime, tmp_path_factory):
    config = tmp_path_factory.mktemp("countdown") / "plugins.json"
    config.write_text(json.dumps({"countdown": {"repeat_penalty": 0.25}}))
    server = start_rollout([bwrap_runtime.url], [vllm.url], "--plugin-config", str(config))
    yield server
    server.stop()


def countdown_job(tool: str, argument: str, value: str, max_turns: int) -> JobRequest:
    """A countdown job whose turns the random tiny model must spend on one fixed tool call."""
    regex = tool_call_regex(tool, argument, [value])
    sampling = SamplingParams(max_tokens=64, temperature=1.0, regex=regex)
    return JobRequest(task="countdown", instance=PUZZLE, sampling=sampling, max_turns=max_turns)


async def test_a_countdown_episode_reads_the_puzzle_in_the_sandbox_and_is_penalised_for_repeating(rollout):
    async with RolloutClient(rollout.url) as client:
        trajectory = await client.run(countdown_job("bash", "command", "cat puzzle.txt", max_turns=2), wait=300)
    assert trajectory.error is None and trajectory.finish_reason == "max_turns"
    for turn in trajectory.turns:  # init wrote the puzzle into the sandbox the agent's bash runs in
        assert turn.observation == "numbers: 25 3 7\ntarget: 46\n[exit code 0]"
    assert trajectory.reward_components == {"outcome": 0.0, "repeats": -0.25}  # configured: 0.25 per repeat
    assert trajectory.reward == pytest.approx(-0.25)


async def test_a_countdown_episode_that_finishes_with_a_solution_scores_one(rollout):
    async with RolloutClient(rollout.url) as client:
        trajectory = await client.run(countdown_job("finish", "answer", "25 + 3 * 7", max_turns=2), wait=300)
    assert trajectory.error is None and trajectory.finish_reason == "finish"
    assert trajectory.reward_components == {"outcome": 1.0, "repeats": 0.0}
    assert trajectory.reward == 1.0
