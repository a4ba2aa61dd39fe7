"""RedisJobBoard's submission against a real redis-server, where Redis fails in the middle of it: every sample of a
multi-sample submission is queued, or none, and a retry gives back the jobs made. What every job board promises
(idempotency, a 409 before anything is queued) is the contract suite's: tests/storage/test_job_board_contract.py.

The board is not started: no replica takes jobs from the queue, so the queue shows what a submission left."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import JobRequest, JobState
from prorl_adapter.service.job_runner import JobConflict
from prorl_adapter.testing import SimulatedRunner, sim_trajectory

from .redis_server import REDIS_SKIP, CommandFault, RedisServer

if REDIS_SKIP:
    pytest.skip(REDIS_SKIP, allow_module_level=True)
pytest.importorskip("redis", reason="the redis Python package is missing (make test installs it)")

from prorl_adapter.service.storage.buffer import BufferUnavailable, ExperienceBufferError
from prorl_adapter.service.storage.redis_coordination import RedisCoordination
from prorl_adapter.service.storage.redis_job_board import RedisJobBoard

GROUP = JobRequest(task="t", job_id="g", num_samples=4)
IDS = [f"g.{i}" for i in range(4)]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-job-board")).start()
    yield server.url
    server.kill()


@pytest.fixture
async def coordination(redis_url) -> AsyncIterator[RedisCoordination]:
    coordination = RedisCoordination(redis_url, "r0", prefix="jb")
    try:
        yield coordination
    finally:
        await coordination.close()


def new_board(coordination: RedisCoordination) -> RedisJobBoard:
    """A board with keys of its own (a fresh prefix)."""
    runner = SimulatedRunner(PluginSet.load(entry_points=False))
    return RedisJobBoard(runner, coordination, prefix=f"jb:{uuid.uuid4().hex[:12]}")  # type: ignore[arg-type]


@pytest.fixture
def board(coordination) -> RedisJobBoard:
    return new_board(coordination)


async def left(board: RedisJobBoard) -> tuple[list[str], list[str]]:
    """(the ids queued, in order; the ids with a record)."""
    redis = board.coordination.redis
    queued = await redis.lrange(f"{board.prefix}:queue", 0, -1)
    return queued, [job_id for job_id in IDS if await redis.exists(board._key(job_id))]


@pytest.mark.parametrize("lost", ["request", "reply"])
async def test_a_submission_redis_fails_midway_queues_every_sample_or_none_and_a_retry_gives_all(coordination, lost):
    """The fault at each command of the submission in turn, until one runs past its last command."""
    for at in range(50):
        board = new_board(coordination)
        fault = CommandFault(coordination.redis, at, lost)
        try:
            await board.submit(GROUP)
        except BufferUnavailable:
            assert fault.hit
        finally:
            fault.remove()
        queued, recorded = await left(board)
        assert (queued, recorded) in (([], []), (IDS, IDS)), f"a fault at command {at} left {queued} queued"
        statuses, created = await board.submit(GROUP)  # the client's retry
        assert [s.job_id for s in statuses] == IDS and {s.state for s in statuses} == {JobState.queued}
        assert created == (queued == [])
        assert await left(board) == (IDS, IDS)  # each once
        if not fault.hit:
            return
    pytest.fail("the submission sent more than 50 commands")


async def test_a_submission_whose_script_fails_queues_none_and_a_retry_queues_all(board):
    redis = board.coordination.redis
    await redis.set(f"{board.prefix}:queue", "not a list")  # the script's first write would fail
    with pytest.raises(ExperienceBufferError, match="refused"):
        await board.submit(GROUP)
    assert not await redis.exists(*(board._key(job_id) for job_id in IDS))  # no sample recorded
    await redis.delete(f"{board.prefix}:queue")
    statuses, created = await board.submit(GROUP)
    assert created and [s.job_id for s in statuses] == IDS
    assert await left(board) == (IDS, IDS)


async def test_a_conflicting_sample_recorded_between_the_check_and_the_write_is_a_409_and_queues_none(board):
    """Another submission records g.2 with another request after this one read the records: the write sees it and
    writes nothing; the records are read again, and the conflict refuses the whole submission."""
    redis = board.coordination.redis
    other = JobRequest(task="other", job_id="g.2").model_dump_json()
    send = redis.execute_command

    async def beside(*args, **options):
        if args[0] == "EVALSHA":  # the submission's write: the other submission lands just before it
            del redis.execute_command
            await redis.hset(board._key("g.2"), "request", other)
        return await send(*args, **options)

    redis.execute_command = beside
    with pytest.raises(JobConflict):
        await board.submit(GROUP)
    assert await left(board) == ([], ["g.2"])


async def until(condition) -> None:
    async with asyncio.timeout(30):  # a bound on waiting, not a measurement
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_fenced_board_stops_its_jobs_writes_nothing_and_runs_them_anew_when_not_taken_over(coordination):
    """The replica's fence (replica.py) at the board: the jobs running here stop, their records stay as they were
    (not cancelled: they are still to run), and once the replica learns it was not taken over they run here again,
    anew, to their own results."""
    board = new_board(coordination)
    runner, ids = board.runner, {"f.0", "f.1"}
    await board.start()
    try:
        await board.submit(JobRequest(task="t", job_id="f", num_samples=2))
        await until(lambda: ids <= runner.jobs.keys())
        stopped = [runner.jobs[job_id] for job_id in sorted(ids)]
        board.fence()
        await until(lambda: not ids & runner.jobs.keys())  # stopped, and their runs forgotten
        assert [job.state for job in stopped] == [JobState.cancelled] * 2
        for job_id in sorted(ids):
            assert not (await board.status(job_id)).state.finished

        board.unfence()
        await until(lambda: ids <= runner.jobs.keys())
        for job_id in sorted(ids):
            job = runner.jobs[job_id]
            assert job not in stopped and job.state is JobState.running
            runner.end(job, sim_trajectory(job, 0, 0))
        results = [await board.result(job_id, wait=10) for job_id in sorted(ids)]
        assert [(r.job_id, r.error) for r in results] == [("f.0", None), ("f.1", None)]
        assert [(await board.status(job_id)).state for job_id in sorted(ids)] == [JobState.done] * 2
    finally:
        await board.stop()
