"""Pace's `deadline-take` rule on the real Producer and MemoryBuffer, with the real staleness plugin and the
pipeline stand-in of tests/test_producer.py (episodes finish when the test says): admission runs ahead of what
`any-take` allows, the take serves the oldest version first and waits for the episode at its limit, and no
trajectory is consumed with staleness > K. "Must not complete" is checked with asyncio.wait_for on a shielded
task and a short timeout."""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import AdmissionState
from prorl_adapter.service.decoupled import Producer
from prorl_adapter.service.storage.buffer import BufferStats
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
from prorl_plugins.staleness import StalenessControl, should_pace
from tests.test_producer import Episodes, prompts, until

K, B = 1, 2


def rig(rule: str) -> tuple[Producer, Episodes]:
    section = {"mode": "pace", "max_staleness": K, "batch_size": B, "pace_rule": rule}
    plugins = PluginSet.load(objects=[StalenessControl(section)], entry_points=False)
    episodes = Episodes(plugins)
    producer = Producer(episodes, MemoryBuffer(), coordination=episodes.coordination)
    plugins.register(producer, name="decoupled-producer")
    producer.start()
    return producer, episodes


def by_job(episodes: Episodes, job_id: str):
    return episodes.jobs[job_id]


async def assert_blocked(task: asyncio.Task, within: float = 0.1) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), within)
    assert not task.done()


async def to_version_one(producer: Producer, episodes: Episodes, consumed: list[int]) -> None:
    """Four episodes admitted at version 0; p0 is slow. The take at 0 gets two of the others, the trainer
    moves to version 1 and acknowledges them: p0 (still running) and p3 (buffered) are left, both of version 0."""
    await producer.enqueue(prompts(10))
    await until(lambda: len(episodes.running()) == (K + 1) * B)  # nothing old yet: both rules admit 4
    for job_id in ("p1", "p2", "p3"):
        episodes.finish(by_job(episodes, job_id))
    await until(lambda: producer.stats.produced == 3)
    batch = await producer.take_batch(B, timeout=5)
    consumed += [0 - item.trajectory.policy_version_min for item in batch]
    assert len(batch) == B
    await episodes.new_version(1)  # as PUT /v1/policy-version does: the producer hears of it
    await producer.ack([item.id for item in batch])


async def test_any_take_holds_admission_while_the_oldest_is_at_its_limit():
    producer, episodes = rig("any-take")
    try:
        await to_version_one(producer, episodes, [])
        await until(lambda: producer.stats.held_back)
        assert [job.id for job in episodes.running()] == ["p0"]  # 2 pending: all any-take allows at version 1
    finally:
        await producer.stop()


async def test_deadline_take_admits_more_waits_for_the_episode_at_its_limit_and_never_exceeds_k():
    producer, episodes = rig("deadline-take")
    consumed: list[int] = []
    try:
        await to_version_one(producer, episodes, consumed)
        # (K + 1) * B pending whatever their age: two more start at version 1, beyond any-take's bound.
        await until(lambda: len(episodes.running()) == 3)
        assert sorted(job.id for job in episodes.running()) == ["p0", "p4", "p5"]
        assert should_pace(AdmissionState(1, {0: 1, 1: 1}, {0: 1}), K, B, rule="any-take")  # would have held p5
        for job_id in ("p4", "p5"):
            episodes.finish(by_job(episodes, job_id))
        await until(lambda: producer.stats.produced == 5)

        # Ready: p3 (version 0), p4 and p5 (version 1). The newest first would be p4 and p5, and then p3 and p0
        # would be consumed at version 2, with staleness 2 > K. The take must hold both of version 0, and p0
        # still runs: a take that times out gets nothing, and leaves everything ready.
        assert await producer.take_batch(B, timeout=0) == []
        assert await producer.take_batch(B, timeout=0.05) == []
        assert await producer.buffer.stats() == BufferStats(ready=3, pending=0, acked=2)
        assert producer.stats.leased == 0

        waiting = asyncio.create_task(producer.take_batch(B, timeout=30))
        await assert_blocked(waiting)
        assert await producer.take_batch(B, timeout=0) == []  # another take is not stuck behind the waiting one
        episodes.finish(by_job(episodes, "p0"), version=0)
        batch = await asyncio.wait_for(waiting, 5)  # woken by the finished episode, long before its timeout
        assert sorted(item.trajectory.job_id for item in batch) == ["p0", "p3"]
        consumed += [1 - item.trajectory.policy_version_min for item in batch]
        await episodes.new_version(2)
        await producer.ack([item.id for item in batch])

        batch = await producer.take_batch(B, timeout=5)
        assert sorted(item.trajectory.job_id for item in batch) == ["p4", "p5"]
        consumed += [2 - item.trajectory.policy_version_min for item in batch]
        assert consumed == [0, 0, 1, 1, 1, 1]
        assert max(consumed) <= K
    finally:
        await producer.stop()


async def test_a_deadline_take_that_times_out_returns_only_what_meets_every_demand():
    producer, episodes = rig("deadline-take")
    try:
        await producer.enqueue(prompts(3))
        await until(lambda: len(episodes.running()) == 3)
        # Version 0, three pending: the take at 0 must hold one of them (the takes after it hold two at most).
        assert await producer.take_batch(B, timeout=0) == []  # nothing ready: nothing
        episodes.finish(by_job(episodes, "p1"))
        await until(lambda: producer.stats.produced == 1)
        [first] = await producer.take_batch(B, timeout=0)  # fewer than asked, but it holds the demand
        assert first.trajectory.job_id == "p1"
        # A top-up at the same version counts what this take already holds: no demand left, nothing ready.
        assert await producer.take_batch(1, timeout=0) == []
        episodes.finish(by_job(episodes, "p0"))
        await until(lambda: producer.stats.produced == 2)
        [second] = await producer.take_batch(1, timeout=5)
        assert second.trajectory.job_id == "p0"
    finally:
        await producer.stop()


async def test_takes_smaller_than_the_batch_size_meet_a_demand_together_instead_of_waiting_for_ever():
    producer, episodes = rig("deadline-take")
    try:
        await producer.enqueue(prompts(4))
        await until(lambda: len(episodes.running()) == (K + 1) * B)
        for job_id in ("p0", "p1", "p2", "p3"):
            episodes.finish(by_job(episodes, job_id))
        await until(lambda: producer.stats.produced == 4)
        # Version 0, four pending: the take at 0 must hold two (the takes after it hold two at most), more than a
        # take of one can. Two takes of one at the same version hold them together.
        first = await producer.take_batch(1, timeout=5)
        second = await producer.take_batch(1, timeout=5)
        assert len(first) == len(second) == 1
        assert {item.trajectory.policy_version_min for item in first + second} == {0}
    finally:
        await producer.stop()


async def test_any_take_keeps_the_newest_first_take_that_waits_for_nothing():
    producer, episodes = rig("any-take")
    try:
        await producer.enqueue(prompts(2))
        await until(lambda: len(episodes.running()) == 2)
        episodes.finish(by_job(episodes, "p0"), version=0)
        episodes.finish(by_job(episodes, "p1"), version=1)
        await until(lambda: producer.stats.produced == 2)
        await episodes.new_version(1)
        [newest] = await producer.take_batch(1, timeout=0)
        assert newest.trajectory.job_id == "p1"
    finally:
        await producer.stop()
