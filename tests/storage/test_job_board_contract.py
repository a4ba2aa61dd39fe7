"""The job board's contract (`storage/job_board.py`), over `MemoryJobBoard` and `RedisJobBoard`, each on the real
`RolloutPipeline` with tests/test_pipeline_faults.py's stand-ins for the sandbox pool, the LLM pool and the tokenizer
(no fault injected): submit (every sample or none, idempotent by job id), status, result, cancel, and a 404 for an id
never seen. A dead replica's jobs handed to another is Redis's alone (integration_tests/test_scale_out.py).

A job can be held in init, its sandbox in hand, until the test opens `rig.gate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import pytest

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import JobRequest, JobState, JobStatus, Trajectory
from prorl_adapter.service.job_runner import JobConflict, UnknownTask
from prorl_adapter.service.pipeline import PipelineConfig, RolloutPipeline
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.storage.job_board import JobBoard, MemoryJobBoard, UnknownJob
from prorl_adapter.tasks import Environment
from tests.test_pipeline_faults import EchoTask, FakeChat, Faults, FaultyLLM, FaultySandboxes

from . import until


class HealthyLLM(FaultyLLM):
    """test_pipeline_faults' LLM stand-in, healthy: a replica takes shared jobs only while an LLM server is."""

    def any_healthy(self) -> bool:
        return True


class GatedTask(EchoTask):
    """The echo task, whose set-up waits for `gate` with its sandbox acquired."""

    def __init__(self, faults: Faults, gate: asyncio.Event) -> None:
        super().__init__(faults)
        self.gate = gate

    async def init(self, env: Environment, instance: dict[str, Any]) -> None:
        await self.gate.wait()
        await super().init(env, instance)


@dataclass
class Rig:
    board: JobBoard
    sandboxes: FaultySandboxes
    gate: asyncio.Event


@pytest.fixture
async def rig(kind, prefix, request) -> AsyncIterator[Rig]:
    faults, gate = Faults(), asyncio.Event()
    gate.set()
    sandboxes = FaultySandboxes(faults)
    config = PipelineConfig(max_init_workers=1, max_run_workers=1, max_eval_workers=1, max_init_attempts=1)
    async with AsyncExitStack() as started:  # stopped as the service stops them: board, pipeline, coordination
        if kind == "memory":
            coordination = MemoryCoordination("r0")
        else:
            from prorl_adapter.service.storage.redis_coordination import RedisCoordination

            coordination = RedisCoordination(request.getfixturevalue("redis_url"), "r0", prefix=prefix)
        await coordination.start()
        started.push_async_callback(coordination.close)
        plugins = PluginSet.load(entry_points=False)
        tasks = {"echo": GatedTask(faults, gate)}
        pipeline = RolloutPipeline(plugins, tasks, sandboxes, HealthyLLM(faults), FakeChat(), config)  # type: ignore[arg-type]
        await pipeline.start()
        started.push_async_callback(pipeline.stop)
        if kind == "memory":
            board: JobBoard = MemoryJobBoard(pipeline)
        else:
            from prorl_adapter.service.storage.redis_job_board import RedisJobBoard

            board = RedisJobBoard(pipeline, coordination, prefix=f"{prefix}:jobs")  # type: ignore[arg-type]
        await board.start()
        started.push_async_callback(board.stop)
        yield Rig(board, sandboxes, gate)


def echo(job_id: str, **fields: Any) -> JobRequest:
    return JobRequest(task="echo", job_id=job_id, max_turns=4, **fields)


async def test_a_job_runs_and_its_status_and_result_follow(rig):
    board = rig.board
    statuses, created = await board.submit(echo("j"))
    assert created and [(s.job_id, s.task, s.state) for s in statuses] == [("j", "echo", JobState.queued)]
    result = await board.result("j", wait=10)
    assert isinstance(result, Trajectory)
    assert (result.job_id, result.reward, result.filter) == ("j", 1.0, False)
    assert (await board.status("j")).state is JobState.done
    assert (await board.cancel("j")).state is JobState.done  # finished: left as it is
    assert rig.sandboxes.acquired == set()


async def test_every_sample_is_queued_and_a_submission_again_is_the_same_jobs(rig):
    board, request = rig.board, echo("g", num_samples=2)
    statuses, created = await board.submit(request)
    assert created and [s.job_id for s in statuses] == ["g.0", "g.1"]
    statuses, created = await board.submit(request)  # a retry whose answer was lost
    assert not created and [s.job_id for s in statuses] == ["g.0", "g.1"]
    for job_id in ("g.0", "g.1"):
        result = await board.result(job_id, wait=10)
        assert isinstance(result, Trajectory) and result.job_id == job_id
    statuses, created = await board.submit(request)
    assert not created and [s.state for s in statuses] == [JobState.done, JobState.done]


async def test_a_submission_with_a_conflicting_or_unknown_sample_queues_none(rig):
    board = rig.board
    await board.submit(echo("g.1"))
    with pytest.raises(JobConflict) as conflict:  # g.1 holds another request: g.0 is refused with it
        await board.submit(echo("g", num_samples=2))
    assert conflict.value.status == 409
    with pytest.raises(UnknownJob):
        await board.status("g.0")
    with pytest.raises(UnknownTask) as unknown:
        await board.submit(JobRequest(task="no-such-task", job_id="u", num_samples=2))
    assert unknown.value.status == 400
    for job_id in ("u", "u.0", "u.1"):
        with pytest.raises(UnknownJob):
            await board.status(job_id)


async def test_an_id_never_seen_is_a_404(rig):
    board = rig.board
    for call in (lambda: board.status("never"), lambda: board.result("never", 0), lambda: board.cancel("never")):
        with pytest.raises(UnknownJob, match="no job 'never'") as unknown:
            await call()
        assert unknown.value.status == 404
    assert await board.take_over("nobody") == 0


async def test_a_result_asked_for_before_the_job_finishes_is_its_status(rig):
    board = rig.board
    rig.gate.clear()
    await board.submit(echo("slow"))
    await until(lambda: bool(rig.sandboxes.acquired))  # in init, held at the gate
    for wait in (0.0, 0.2):
        status = await board.result("slow", wait)
        assert isinstance(status, JobStatus) and status.job_id == "slow" and not status.state.finished
    rig.gate.set()
    assert isinstance(await board.result("slow", 10), Trajectory)


async def test_cancel_stops_a_running_job_and_one_queued_behind_it(rig):
    board = rig.board
    rig.gate.clear()
    await board.submit(echo("held"))
    await until(lambda: bool(rig.sandboxes.acquired))  # in init, its sandbox in hand
    await board.submit(echo("behind"))  # behind it: one init worker
    assert (await board.cancel("behind")).state is JobState.cancelled
    cancelled = await board.cancel("held")
    assert (cancelled.job_id, cancelled.state) == ("held", JobState.cancelled)
    assert rig.sandboxes.acquired == set()  # its sandbox is released
    result = await board.result("held", 10)
    assert isinstance(result, Trajectory) and result.error.error_class == "cancelled" and result.filter
    assert (await board.cancel("held")).state is JobState.cancelled  # final: cancelled again, nothing changes
    rig.gate.set()
    await board.submit(echo("after"))
    assert isinstance(await board.result("after", 10), Trajectory)
    assert (await board.status("behind")).state is JobState.cancelled
    assert rig.sandboxes.created == 2  # held's and after's: the cancelled one never got a sandbox
