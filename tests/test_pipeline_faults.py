"""Every job reaches a final state, whatever fails: faults injected at each step of a job's path through the
real RolloutPipeline (sandbox create, set-up, each LLM call, each tool call, eval, reward hooks, release,
finish). The sandbox pool, the LLM pool and the tokenizer are fault injectors written for this test (they
fail on cue; a run with real servers is in integration_tests/test_rollout_failures.py). After each faulty job
a healthy one must still complete, so the stage workers are alive, and no sandbox is left acquired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from prorl_adapter.hooks import PluginSet, hookimpl
from prorl_adapter.models import JobRequest, JobState
from prorl_adapter.service.llm import Generation, LLMUnavailable
from prorl_adapter.service.pipeline import PipelineConfig, RolloutPipeline
from prorl_adapter.tasks import FINISH, Environment, EpisodeState, TaskHandler, Tool, bash_tool
from sandbox_runtime.models import ExecResult, RunResult

BASH = '<tool_call>{"name": "bash", "arguments": {"command": "echo hi"}}</tool_call>'
DONE = '<tool_call>{"name": "finish", "arguments": {"answer": "42"}}</tool_call>'


class Boom(RuntimeError):
    """The injected fault."""


@dataclass
class Faults:
    """Where the next job fails: a step name, and for LLM calls and tool calls which one (0-based)."""

    step: str | None = None
    index: int = 0


@dataclass
class FaultyClient:
    faults: Faults
    tool_calls: int = 0

    async def exec(self, sandbox_id: str, command: str, **_: Any) -> ExecResult:
        if self.faults.step == "tool" and self.tool_calls == self.faults.index:
            raise Boom("tool call")
        self.tool_calls += 1
        return ExecResult(output="hi\n", exit_code=0, status="completed", truncated=False, duration_s=0.0, cwd="/")

    async def run(self, sandbox_id: str, **_: Any) -> RunResult:
        return RunResult(output="", exit_code=0, status="completed", truncated=False, duration_s=0.0)

    async def end_processes(self, sandbox_id: str) -> list[str]:
        if self.faults.step == "end_processes":
            raise Boom("end processes")
        return []


@dataclass
class FaultySandboxes:
    faults: Faults
    acquired: set[str] = field(default_factory=set)
    created: int = 0

    async def acquire(self, spec: dict[str, Any], exclude: set[str], timeout_s: float | None = None) -> Environment:
        if self.faults.step == "create":
            raise Boom("sandbox create")
        self.created += 1
        sandbox_id = f"box-{self.created}"
        self.acquired.add(sandbox_id)
        return Environment(FaultyClient(self.faults), sandbox_id, "http://runtime", "/workspace")  # type: ignore[arg-type]

    async def release(self, env: Environment) -> None:
        self.acquired.discard(env.sandbox_id)
        if self.faults.step == "release":
            raise Boom("sandbox release")


@dataclass
class FaultyLLM:
    faults: Faults
    calls: int = 0

    async def generate(self, prompt_ids: list[int], sampling: Any, pin: Any, progress: Any = None) -> Generation:
        index, self.calls = self.calls, self.calls + 1
        if self.faults.step == "llm" and index == self.faults.index:
            raise Boom("LLM call")
        if self.faults.step == "llm-unavailable" and index == self.faults.index:
            raise LLMUnavailable("no healthy LLM server")
        text = BASH if index == 0 else DONE
        ids: list[Any] = ["not", "ids"] if self.faults.step == "bad-ids" else [7, 8]
        return Generation(ids, [0.0, 0.0], text, "stop", "http://llm", 0.0)


class FakeChat:
    """Token ids without a tokenizer: the prompt is one id per message."""

    eos_id = 8
    takes_tools = True

    async def off_loop(self, work: Any, *args: Any, size: int | None = None) -> Any:
        return work(*args)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        return [1] * len(messages)

    def tool_turn_ids(self, messages: list[dict[str, Any]], closed_by_eos: bool) -> list[int]:
        return [2] * len(messages)


class EchoTask(TaskHandler):
    name = "echo"

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    def tools(self, instance: dict[str, Any]) -> list[Tool]:
        return [bash_tool(5.0), FINISH]

    def system_prompt(self, instance: dict[str, Any]) -> str:
        return "s"

    def user_prompt(self, instance: dict[str, Any]) -> str:
        return "u"

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        if self.faults.step == "set-up":
            raise Boom("set-up")

    async def evaluate(self, env: Environment, instance: dict[str, Any], state: EpisodeState) -> dict[str, float]:
        if self.faults.step == "eval":
            raise Boom("eval")
        return {"outcome": 1.0}


class FaultyRewardPlugin:
    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    @hookimpl
    def prorl_reward_components(self) -> dict[str, float] | None:
        if self.faults.step == "reward":
            raise Boom("reward hook")
        return None


class FaultyObserver:
    """A plugin observing stage events that fails on every event of the faulty job."""

    def __init__(self, faults: Faults) -> None:
        self.faults = faults

    @hookimpl
    def prorl_stage_event(self, event: str) -> None:
        if self.faults.step == "observer":
            raise Boom(f"observer on {event}")


@pytest.fixture
async def rig():
    faults = Faults()
    sandboxes, llm = FaultySandboxes(faults), FaultyLLM(faults)
    plugins = PluginSet.load(objects=[FaultyRewardPlugin(faults), FaultyObserver(faults)], entry_points=False)
    config = PipelineConfig(max_init_workers=1, max_run_workers=1, max_eval_workers=1, max_init_attempts=1)
    pipeline = RolloutPipeline(plugins, {"echo": EchoTask(faults)}, sandboxes, llm, FakeChat(), config)  # type: ignore[arg-type]
    await pipeline.start()
    yield pipeline, faults, sandboxes, llm
    await pipeline.stop()


async def run_job(pipeline: RolloutPipeline) -> Any:
    job, _ = pipeline.submit(JobRequest(task="echo", max_turns=4))
    job = await pipeline.wait(job.id, timeout=10)
    assert job.state.finished, f"job stuck in {job.state}"
    assert job.result is not None
    return job


@pytest.mark.parametrize(
    ("step", "index", "error_class"),
    [
        ("create", 0, "init"),
        ("set-up", 0, "init"),
        ("llm", 0, "run"),
        ("llm", 1, "run"),
        ("llm-unavailable", 1, "run"),
        ("tool", 0, "run"),
        ("end_processes", 0, "eval"),
        ("eval", 0, "eval"),
        ("reward", 0, "eval"),
        ("bad-ids", 0, "eval"),  # the finish step cannot build the trajectory from what the LLM returned
    ],
)
async def test_a_fault_at_any_step_fails_that_job_cleanly_and_the_next_job_completes(rig, step, index, error_class):
    pipeline, faults, sandboxes, llm = rig
    faults.step, faults.index = step, index
    failed = await run_job(pipeline)
    assert failed.state is JobState.failed
    assert failed.result.filter and failed.result.error.error_class == error_class
    assert failed.result.error.message
    assert sandboxes.acquired == set()

    faults.step = None
    llm.calls = 0
    healthy = await run_job(pipeline)
    assert (healthy.state, healthy.result.reward, healthy.result.filter) == (JobState.done, 1.0, False)
    assert sandboxes.acquired == set()


@pytest.mark.parametrize("step", ["release", "observer"])
async def test_a_failing_release_or_observer_never_holds_a_result_back(rig, step):
    pipeline, faults, _, _ = rig
    faults.step = step
    job = await run_job(pipeline)
    assert job.state is JobState.done and job.result.reward == 1.0
    faults.step = None
    assert (await run_job(pipeline)).state is JobState.done


async def test_a_prompt_longer_than_the_context_fails_the_job_with_filter(rig):
    pipeline, _, sandboxes, _ = rig
    job, _ = pipeline.submit(JobRequest(task="echo", max_context_tokens=2))
    job = await pipeline.wait(job.id, timeout=10)
    assert job.state is JobState.failed and job.result.filter
    assert "max_context_tokens is 2" in job.result.error.message
    assert sandboxes.acquired == set()
