"""relay's slow-tool workload (`tool_latency_s`): the n-th bash call sleeps the n-th latency first, in the
sandbox, and the instance's latencies are drawn, bounded and checked as documented. The environment here is a
recording stand-in (NOT a sandbox): what is tested is which commands the task sends, and in what order."""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.tasks import EpisodeState, TaskConfigError
from prorl_plugins.tasks.relay import MAX_LATENCY_S, TURNS, RelayTask, relay_instances, tool_latencies
from sandbox_runtime.models import ExecResult


class RecordingEnv:
    """Answers every exec with success and records (command, timeout)."""

    def __init__(self) -> None:
        self.execs: list[tuple[str, float | None]] = []

    async def exec(self, command: str, timeout: float | None = None) -> ExecResult:
        self.execs.append((command, timeout))
        return ExecResult(output="", exit_code=0, status="completed", truncated=False, duration_s=0.0, cwd="/work")


def run_calls(instance: dict, commands: list[str]) -> list[tuple[str, float | None]]:
    (bash,) = RelayTask().tools(instance)
    env, state = RecordingEnv(), EpisodeState()

    async def calls() -> None:
        for command in commands:
            await bash.run(env, {"command": command}, state)

    asyncio.run(calls())
    return env.execs


def test_each_call_sleeps_its_own_latency_first_and_none_past_the_list() -> None:
    instance = {"word": "fix", "tool_latency_s": [2.1, 0.0]}
    execs = run_calls(instance, ["tar -xf box.tar", "cp note.txt answer.txt", "ls"])
    assert [command for command, _ in execs] == ["sleep 2.100", "tar -xf box.tar", "cp note.txt answer.txt", "ls"]
    assert execs[0][1] == pytest.approx(12.1)  # the sleep's own timeout covers it


def test_without_latencies_the_tool_is_the_plain_bash_tool() -> None:
    execs = run_calls({"word": "fix"}, ["tar -xf box.tar", "ls"])
    assert [command for command, _ in execs] == ["tar -xf box.tar", "ls"]


def test_drawn_latencies_are_one_per_turn_bounded_and_fixed_by_the_seed() -> None:
    rows = relay_instances(64, seed=3, tool_latency_median_s=1.5)
    assert rows == relay_instances(64, seed=3, tool_latency_median_s=1.5)
    assert rows != relay_instances(64, seed=4, tool_latency_median_s=1.5)
    latencies = [s for row in rows for s in row["tool_latency_s"]]
    assert all(len(row["tool_latency_s"]) == TURNS for row in rows)
    assert all(0 < s <= 6.0 for s in latencies)
    assert min(latencies) < 1.5 < max(latencies)  # spread about the median, not a constant
    assert "tool_latency_s" not in relay_instances(4, seed=3)[0]


@pytest.mark.parametrize("bad", ["2", [True], ["1"], {"a": 1}])
def test_malformed_latencies_are_a_task_config_error_at_set_up(bad: object) -> None:
    instance = {"word": "fix", "tool_latency_s": bad}
    with pytest.raises(TaskConfigError, match="tool_latency_s"):
        asyncio.run(RelayTask().init(RecordingEnv(), instance))


def test_latencies_are_clipped_to_what_a_sandbox_should_sleep() -> None:
    assert tool_latencies({"tool_latency_s": [-3, 1e9, 0.25]}) == [0.0, MAX_LATENCY_S, 0.25]
