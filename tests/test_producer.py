"""Decoupled mode's liveness: the real Producer and MemoryBuffer with the real staleness plugin, on a simulated job
runner whose episodes end when the test says (`Episodes`), and a buffer fault injector (`Outage`) that makes the
buffer unreachable on cue, as a dead Redis does."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import JobError, JobRequest, JobState, Trajectory
from prorl_adapter.service.decoupled import Producer, ProducerConfig
from prorl_adapter.service.job_runner import JobRunner
from prorl_adapter.service.pipeline import RolloutPipeline
from prorl_adapter.service.storage.buffer import BufferUnavailable, ExperienceBuffer
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
from prorl_adapter.service.storage.prompts import MemoryPromptQueue
from prorl_adapter.testing import SimJob, SimulatedRunner, sim_trajectory
from prorl_plugins.staleness import StalenessControl


class Episodes(SimulatedRunner):
    """A simulated job runner whose episodes end when the test says (`finish`, `fail`)."""

    def running(self) -> list[SimJob]:
        return [j for j in self.jobs.values() if j.state is JobState.running]

    def fail(self, job: SimJob, outage: bool = False) -> None:
        """The episode failed for the infrastructure (its sandbox runtime died, say; `outage`: the LLM fleet was
        out, as the pipeline marks it)."""
        error = JobError(error_class="init", message="sandbox runtime gone")
        if outage:
            error = JobError(error_class="run", message="LLM: no healthy LLM server", outage=True)
        self.end(job, sim_trajectory(job, self.policy_version, self.policy_version, error), JobState.failed)

    def finish(self, job: SimJob, version: int | None = None) -> None:
        v = self.policy_version if version is None else version
        self.end(job, sim_trajectory(job, v, v))


class Outage(ExperienceBuffer):
    """A MemoryBuffer that raises BufferUnavailable from every call while `down` is set."""

    def __init__(self, inner: MemoryBuffer) -> None:
        self.inner, self.down = inner, False

    def _reachable(self) -> MemoryBuffer:
        if self.down:
            raise BufferUnavailable("Redis at redis://127.0.0.1:1 is unavailable (injected)")
        return self.inner

    async def put(self, trajectory: Trajectory) -> str:
        return await self._reachable().put(trajectory)

    async def put_many(self, trajectories: list[Trajectory]) -> list[str]:
        return await self._reachable().put_many(trajectories)

    async def take(self, n: int, timeout: float | None = None, order: str = "newest") -> list:
        return await self._reachable().take(n, timeout, order)

    async def ack(self, ids: Any) -> int:
        return await self._reachable().ack(ids)

    async def release(self, ids: Any) -> int:
        return await self._reachable().release(ids)

    async def expire(self, before_version: int) -> int:
        return await self._reachable().expire(before_version)

    async def reclaim(self, idle_s: float) -> int:
        return await self._reachable().reclaim(idle_s)

    async def buffered_versions(self) -> list[int]:
        return await self._reachable().buffered_versions()

    async def version_counts(self) -> dict[int, int]:
        return await self._reachable().version_counts()

    async def ready_counts(self) -> dict[int, int]:
        return await self._reachable().ready_counts()

    async def stats(self) -> Any:
        return await self._reachable().stats()

    async def close(self) -> None:
        await self.inner.close()


async def until(condition, seconds: float = 10.0) -> None:
    """Yield to the event loop until `condition()` holds (the producer's tasks run in between)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        if loop.time() >= deadline:  # a bound on waiting, not a measurement
            pytest.fail("the condition never held")
        await asyncio.sleep(0.01)


def rig(staleness: dict | None = None, **config: Any) -> tuple[Producer, Episodes, Outage]:
    control = StalenessControl(staleness or {"mode": "off"})
    plugins = PluginSet.load(objects=[control], entry_points=False)
    episodes = Episodes(plugins)
    buffer = Outage(MemoryBuffer())
    producer = Producer(episodes, buffer, config=ProducerConfig(**config), coordination=episodes.coordination)
    plugins.register(producer, name="decoupled-producer")
    producer.start()
    return producer, episodes, buffer


def prompts(n: int, start: int = 0) -> list[JobRequest]:
    return [JobRequest(job_id=f"p{i}", task="t") for i in range(start, start + n)]


async def test_an_unacknowledged_batch_is_delivered_again_then_becomes_a_dead_letter():
    producer, episodes, _ = rig(max_deliveries=2)
    try:
        await producer.enqueue(prompts(2))
        await until(lambda: len(episodes.running()) == 2)
        for job in episodes.running():
            episodes.finish(job)
        first = await producer.take_batch(2, timeout=5, lease_s=0.05)  # the trainer dies holding it
        assert [t.deliveries for t in first] == [1, 1]
        second = await producer.take_batch(2, timeout=5, lease_s=0.05)
        assert [t.deliveries for t in second] == [2, 2]
        assert {t.id for t in second} == {t.id for t in first}
        await until(lambda: producer.stats.dead_letters == 2)
        stats = await producer.snapshot()
        assert (stats.redelivered, stats.leased, len(stats.recent_dead_letters)) == (2, 0, 2)
        assert (await producer.buffer.stats()).ready == 0
    finally:
        await producer.stop()


async def test_an_acknowledged_batch_is_never_delivered_again_and_a_held_lease_blocks_nothing():
    producer, episodes, _ = rig(staleness={"mode": "pace", "max_staleness": 0, "batch_size": 2})
    try:
        await producer.enqueue(prompts(6))
        await until(lambda: len(episodes.running()) == 2)  # pace with K=0: one batch at a time
        for job in episodes.running():
            episodes.finish(job)
        batch = await producer.take_batch(2, timeout=5, lease_s=0.05)
        # The trainer crashed: its lease runs out, the entries come back, and a new trainer consumes them.
        again = await producer.take_batch(2, timeout=5, lease_s=60)
        assert {t.id for t in again} == {t.id for t in batch}
        await producer.ack([t.id for t in again])
        await episodes.new_version(1)
        await until(lambda: len(episodes.running()) == 2)  # admission was never deadlocked
        assert await producer.take_batch(2, timeout=0) == []
    finally:
        await producer.stop()


async def test_a_buffer_outage_pauses_production_and_loses_nothing():
    producer, episodes, buffer = rig()
    try:
        await producer.enqueue(prompts(2))
        await until(lambda: len(episodes.running()) == 2)
        buffer.down = True
        for job in episodes.running():
            episodes.finish(job)  # finished while the buffer is down: kept, in order
        await producer.enqueue(prompts(3, start=2))
        await until(lambda: producer.stats.degraded is not None)
        assert "unavailable" in producer.stats.degraded
        stats = await producer.snapshot()
        assert stats.undelivered == 2 and stats.produced == 0
        buffer.down = False
        await until(lambda: producer.stats.produced == 2 and len(episodes.running()) == 3, seconds=15)
        assert producer.stats.degraded is None
        assert len(await producer.take_batch(5, timeout=0)) == 2
    finally:
        await producer.stop()


async def test_a_fenced_producer_stops_its_episodes_delivers_nothing_and_runs_them_anew_when_not_taken_over():
    """The replica's fence (replica.py) at the producer: the episodes still running stop, a trajectory already
    made waits undelivered, nothing is admitted; unfenced (not taken over), the trajectory is delivered and the
    stopped prompts run again, anew, each delivered once."""
    producer, episodes, buffer = rig()
    try:
        await producer.enqueue(prompts(3))
        await until(lambda: len(episodes.running()) == 3)
        done, *stopped = sorted(episodes.running(), key=lambda job: job.id)
        buffer.down = True  # the trajectory made before the fence is not delivered yet...
        episodes.finish(done)
        await until(lambda: producer.stats.degraded is not None)
        producer.fence()
        buffer.down = False  # ...and waits while the fence holds
        await until(lambda: not {job.id for job in stopped} & episodes.jobs.keys())  # stopped and forgotten
        assert [job.state for job in stopped] == [JobState.cancelled] * 2
        await producer.enqueue(prompts(1, start=3))
        await until(lambda: producer.stats.held_back_reason is not None)
        assert "fenced" in producer.stats.held_back_reason and producer.stats.produced == 0

        producer.unfence()
        await until(lambda: len(episodes.running()) == 3)  # the two stopped again, and the one held back
        assert not {id(job) for job in episodes.running()} & {id(job) for job in stopped}
        for job in episodes.running():
            episodes.finish(job)
        await until(lambda: producer.stats.produced == 4)
        batch = await producer.take_batch(10, timeout=0)
        assert sorted(taken.trajectory.job_id for taken in batch) == ["p0", "p1", "p2", "p3"]
    finally:
        await producer.stop()


async def test_entries_too_stale_to_weigh_are_removed_at_take_time_even_when_not_the_newest():
    producer, episodes, _ = rig(staleness={"mode": "drop", "max_staleness": 1})
    try:
        await producer.enqueue(prompts(4))
        await until(lambda: len(episodes.running()) == 4)
        for version, job in zip([0, 0, 3, 4], list(episodes.running())):
            episodes.finish(job, version=version)
        await until(lambda: producer.stats.produced == 4)
        await episodes.new_version(4)
        batch = await producer.take_batch(1, timeout=0)  # newest first: version 4; versions 0 are expired
        assert [t.trajectory.policy_version_min for t in batch] == [4]
        assert producer.stats.expired == 2
        assert await producer.buffer.version_counts() == {3: 1, 4: 1}
    finally:
        await producer.stop()


async def test_admission_pauses_while_the_buffer_is_full():
    producer, episodes, _ = rig(max_buffered=2)
    try:
        await producer.enqueue(prompts(5))
        await until(lambda: len(episodes.running()) == 2)  # two running count as soon-to-be buffered
        for job in episodes.running():
            episodes.finish(job)
        await until(lambda: producer.stats.produced == 2)
        await until(lambda: producer.stats.held_back)
        assert "max_buffered=2" in producer.stats.held_back_reason
        assert len(episodes.jobs) == 2
        await producer.ack([t.id for t in await producer.take_batch(2, timeout=0)])
        await until(lambda: len(episodes.jobs) == 4)
    finally:
        await producer.stop()


async def test_a_prompt_whose_episode_failed_for_the_infrastructure_runs_again_up_to_max_attempts():
    producer, episodes, _ = rig(max_attempts=3, retry_delay_s=0.01)
    try:
        await producer.enqueue(prompts(1))
        for attempt in (1, 2, 3):
            await until(lambda: len(episodes.running()) == 1)
            [job] = episodes.running()
            assert job.request.attempt == attempt and job.request.retry_of == (None if attempt == 1 else "p0")
            episodes.fail(job)
        await until(lambda: producer.stats.filtered == 1)
        assert (producer.stats.retried, len(episodes.jobs), producer.stats.produced) == (2, 3, 0)
        assert sorted(episodes.jobs) == ["p0", "p0:2", "p0:3"]

        await producer.enqueue(prompts(1, start=1))
        await until(lambda: len(episodes.running()) == 1)
        episodes.fail(episodes.running()[0])
        await until(lambda: len(episodes.running()) == 1)
        episodes.finish(episodes.running()[0])  # the second run delivers
        await until(lambda: producer.stats.produced == 1)
        [delivered] = await producer.take_batch(1, timeout=0)
        assert delivered.trajectory.job_id == "p1:2"
    finally:
        await producer.stop()


async def test_runs_an_llm_outage_failed_do_not_count_against_max_attempts_up_to_max_outage_reruns():
    producer, episodes, _ = rig(max_attempts=2, max_outage_reruns=2, retry_delay_s=0.01)
    try:
        await producer.enqueue(prompts(1))
        # Two runs failed by outages (not counted), then one that counts, then a third outage: past
        # max_outage_reruns it counts, and with it max_attempts is spent.
        for attempt, outage in zip((1, 2, 3, 4), (True, True, False, True), strict=True):
            await until(lambda: len(episodes.running()) == 1)
            [job] = episodes.running()
            assert job.request.attempt == attempt
            assert job.request.outage_reruns == min(attempt - 1, 2)
            episodes.fail(job, outage=outage)
        await until(lambda: producer.stats.filtered == 1)
        assert (producer.stats.retried, producer.stats.outage_reruns) == (3, 2)
        assert sorted(episodes.jobs) == ["p0", "p0:2", "p0:3", "p0:4"]
    finally:
        await producer.stop()


class LossyPrompts(MemoryPromptQueue):
    """A prompt queue with a running record, like Redis's, whose next pop moves a prompt to running and then
    loses the reply (the connection died mid-call), when `lose_next_reply` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.running: dict[str, JobRequest] = {}
        self.lose_next_reply = False

    async def pop(self, version: int, fence: Any = None) -> JobRequest | None:
        request = await super().pop(version, fence)
        if request is not None:
            self.running[request.job_id] = request
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise BufferUnavailable("Redis at redis://127.0.0.1:1 is unavailable: the reply was lost (injected)")
        return request

    async def done(self, job_id: str) -> None:
        await super().done(job_id)
        self.running.pop(job_id, None)

    async def recover(self) -> list[JobRequest]:
        return list(self.running.values())


async def test_a_prompt_whose_pop_reply_was_lost_still_runs():
    prompts_queue = LossyPrompts()
    plugins = PluginSet.load(objects=[StalenessControl({"mode": "off"})], entry_points=False)
    episodes = Episodes(plugins)
    producer = Producer(episodes, MemoryBuffer(), prompts_queue, coordination=episodes.coordination)
    plugins.register(producer, name="decoupled-producer")
    prompts_queue.lose_next_reply = True
    producer.start()
    try:
        await producer.enqueue(prompts(3))
        await until(lambda: len(episodes.running()) == 3)  # p0's reply was lost: it runs all the same
        assert {job.id for job in episodes.running()} == {"p0", "p1", "p2"}
        for job in episodes.running():
            episodes.finish(job)
        await until(lambda: producer.stats.produced == 3)
        assert prompts_queue.running == {}
    finally:
        await producer.stop()


def test_the_pipeline_and_every_simulated_runner_are_job_runners():
    """The producer, the job boards and ProRL's API reach jobs only through `JobRunner`: the pipeline implements
    it, and so do the simulations that stand in for it here and in the benchmarks. A member added to the
    protocol and not to one of them fails here."""
    plugins = PluginSet.load(entry_points=False)
    pipeline = RolloutPipeline(plugins, {}, sandboxes=None, llm=None, chat=None)  # type: ignore[arg-type]
    for runner in (pipeline, Episodes(plugins), SimulatedRunner(plugins)):
        assert isinstance(runner, JobRunner), type(runner).__name__
    assert not isinstance(object(), JobRunner)
