"""MemoryBuffer: order, ack, reclaim, waiting, backpressure and pacing data, without sleeps as synchronisation.

"Must not complete" is checked with asyncio.wait_for on a shielded task and a short timeout; reclaim's idle time
runs on an injected clock.
"""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.models import BatchItem, Trajectory
from prorl_adapter.service.storage import create_buffer
from prorl_adapter.service.storage.buffer import (
    BufferClosed,
    BufferStats,
    ExperienceBuffer,
)
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
from prorl_adapter.trainer.samples import trajectory_from_tensors


def make_trajectory(job_id: str, version: int = 0) -> Trajectory:
    return trajectory_from_tensors([1, 2, 3], [4, 5], [1, 0], [-0.5, 0.0], version, version, job_id=job_id, task="test")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def assert_blocked(task: asyncio.Task, within: float = 0.05) -> None:
    """The task must not complete (it waits on the buffer)."""
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(asyncio.shield(task), within)
    assert not task.done()


def jobs(batch: list[BatchItem]) -> list[str]:
    return [b.trajectory.job_id for b in batch]


async def test_produce_consume_ack_nothing_lost_nothing_duplicated():
    async with MemoryBuffer() as buf:
        ids = [await buf.put(make_trajectory(f"j{i}")) for i in range(10)]
        assert len(set(ids)) == 10
        assert await buf.stats() == BufferStats(ready=10, pending=0, acked=0)
        seen: list[str] = []
        while batch := await buf.take(3, timeout=0):
            assert all(b.deliveries == 1 for b in batch)
            assert (await buf.stats()).pending == len(batch)
            assert await buf.ack([b.id for b in batch]) == len(batch)
            seen += jobs(batch)
        assert seen == [f"j{i}" for i in range(10)]  # one version: FIFO
        assert await buf.stats() == BufferStats(ready=0, pending=0, acked=10)
        assert await buf.buffered_versions() == []


async def test_newest_version_first_fifo_within_a_version():
    buf = MemoryBuffer()
    for job, version in [("a1", 1), ("b3", 3), ("c2", 2), ("d3", 3), ("e1", 1), ("f2", 2)]:
        await buf.put(make_trajectory(job, version))
    batch = await buf.take(6, timeout=0)
    assert jobs(batch) == ["b3", "d3", "c2", "f2", "a1", "e1"]
    assert [b.trajectory.policy_version_min for b in batch] == [3, 3, 2, 2, 1, 1]
    # A newer version put later still comes first.
    await buf.put(make_trajectory("g1", 1))
    await buf.put(make_trajectory("h5", 5))
    assert jobs(await buf.take(2, timeout=0)) == ["h5", "g1"]


async def test_oldest_version_first_fifo_within_a_version_and_handed_back_entries_keep_their_place():
    clock = FakeClock()
    buf = MemoryBuffer(clock=clock)
    for job, version in [("a1", 1), ("b3", 3), ("c2", 2), ("d3", 3), ("e1", 1), ("f2", 2)]:
        await buf.put(make_trajectory(job, version))
    assert await buf.ready_counts() == {1: 2, 2: 2, 3: 2}
    first = await buf.take(3, timeout=0, order="oldest")
    assert jobs(first) == ["a1", "e1", "c2"]
    assert await buf.ready_counts() == {2: 1, 3: 2}
    newest = await buf.take(1, timeout=0)  # the default order is unchanged, and the orders share the entries
    assert jobs(newest) == ["b3"]
    await buf.put(make_trajectory("g0", 0))  # an older version put later still comes first
    assert await buf.release([first[1].id, first[0].id]) == 2  # back in their place: before c2's peers
    clock.now += 60
    assert await buf.reclaim(30) == 2  # c2 and b3: before f2 and d3, FIFO in their versions
    assert await buf.ready_counts() == {0: 1, 1: 2, 2: 2, 3: 2}
    again = await buf.take(10, timeout=0, order="oldest")
    assert jobs(again) == ["g0", "a1", "e1", "c2", "f2", "b3", "d3"]
    assert [b.deliveries for b in again] == [1, 2, 2, 2, 1, 2, 1]
    assert await buf.take(1, timeout=0) == [] and await buf.ready_counts() == {}
    assert await buf.ack([b.id for b in again]) == 7
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=7)


async def test_an_oldest_first_take_waits_and_a_bad_order_is_refused():
    buf = MemoryBuffer()
    waiter = asyncio.create_task(buf.take(2, order="oldest"))
    await assert_blocked(waiter)
    await buf.put(make_trajectory("new", 5))
    await assert_blocked(waiter)
    await buf.put(make_trajectory("old", 1))
    assert jobs(await waiter) == ["old", "new"]
    with pytest.raises(ValueError, match="order must be one of newest, oldest"):
        await buf.take(1, order="fifo")


async def test_takes_in_one_order_leave_no_pile_of_stale_keys_in_the_other():
    buf = MemoryBuffer()
    for i in range(500):
        await buf.put(make_trajectory(f"j{i}", i % 7))
        [taken] = await buf.take(1, timeout=0)
        await buf.ack([taken.id])
    assert len(buf._ready_oldest) <= 16 and len(buf._ready) <= 16


async def test_take_waits_until_n_are_ready():
    buf = MemoryBuffer()
    task = asyncio.create_task(buf.take(3))
    await assert_blocked(task)
    await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    await assert_blocked(task)  # two are not three
    await buf.put(make_trajectory("c"))
    assert jobs(await task) == ["a", "b", "c"]


async def test_timeout_returns_what_there_is():
    buf = MemoryBuffer()
    assert await buf.take(4, timeout=0) == []
    assert await buf.take(4, timeout=0.01) == []
    await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    assert jobs(await buf.take(4, timeout=0.01)) == ["a", "b"]
    await buf.put(make_trajectory("c"))
    assert jobs(await buf.take(4, timeout=0)) == ["c"]


async def test_concurrent_takers_get_disjoint_batches():
    buf = MemoryBuffer()
    first, second = asyncio.create_task(buf.take(2)), asyncio.create_task(buf.take(2))
    await assert_blocked(first)
    for i in range(4):
        await buf.put(make_trajectory(f"j{i}"))
    a, b = await first, await second
    assert sorted(jobs(a) + jobs(b)) == ["j0", "j1", "j2", "j3"]


async def test_ack_counts_only_pending_entries_once():
    buf = MemoryBuffer()
    never_taken = await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    [taken] = await buf.take(1, timeout=0)
    assert taken.trajectory.job_id == "a" and taken.id == never_taken
    untaken = await buf.put(make_trajectory("c"))
    assert await buf.ack([untaken, "no-such-id"]) == 0  # not taken: not consumed
    assert await buf.ack([taken.id]) == 1
    assert await buf.ack([taken.id]) == 0  # twice: once
    assert await buf.stats() == BufferStats(ready=2, pending=0, acked=1)


async def test_reclaim_hands_back_entries_idle_too_long_in_their_place():
    clock = FakeClock()
    buf = MemoryBuffer(clock=clock)
    for job, version in [("old", 1), ("new-a", 2), ("new-b", 2), ("new-c", 2)]:
        await buf.put(make_trajectory(job, version))
    crashed = await buf.take(2, timeout=0)  # a trainer takes two and dies
    assert jobs(crashed) == ["new-a", "new-b"]
    clock.now += 10
    recent = await buf.take(1, timeout=0)  # a live trainer takes one
    assert jobs(recent) == ["new-c"]
    clock.now += 5
    assert await buf.reclaim(30) == 0  # nobody idle for 30 s
    assert await buf.reclaim(15) == 2  # the crashed trainer's two, not the live one's (idle 5 s)
    assert await buf.stats() == BufferStats(ready=3, pending=1, acked=0)
    again = await buf.take(3, timeout=0)
    assert jobs(again) == ["new-a", "new-b", "old"]  # their original place: version 2 before version 1
    assert [b.deliveries for b in again] == [2, 2, 1]
    assert [b.id for b in again[:2]] == [b.id for b in crashed]
    assert await buf.ack([b.id for b in again + recent]) == 4
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=4)


async def test_late_ack_after_reclaim_is_not_delivered_again():
    clock = FakeClock()
    buf = MemoryBuffer(clock=clock)
    await buf.put(make_trajectory("slow"))
    [entry] = await buf.take(1, timeout=0)
    clock.now += 60
    assert await buf.reclaim(30) == 1
    assert await buf.ack([entry.id]) == 1  # the slow trainer did consume it after all
    assert await buf.take(1, timeout=0) == []
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=1)


async def test_reclaim_wakes_a_waiting_take():
    clock = FakeClock()
    buf = MemoryBuffer(clock=clock)
    await buf.put(make_trajectory("a"))
    await buf.take(1, timeout=0)
    waiter = asyncio.create_task(buf.take(1))
    await assert_blocked(waiter)
    assert await buf.reclaim(0) == 1
    [entry] = await waiter
    assert entry.trajectory.job_id == "a" and entry.deliveries == 2


async def test_max_size_put_waits_for_room_which_only_ack_makes():
    buf = MemoryBuffer(max_size=2)
    await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    blocked = asyncio.create_task(buf.put(make_trajectory("c")))
    await assert_blocked(blocked)
    batch = await buf.take(1, timeout=0)
    await assert_blocked(blocked)  # taken is still held until acked
    await buf.ack([b.id for b in batch])
    await blocked
    assert await buf.stats() == BufferStats(ready=2, pending=0, acked=1)
    assert jobs(await buf.take(2, timeout=0)) == ["b", "c"]


async def test_buffered_versions_count_ready_and_pending_until_acked():
    buf = MemoryBuffer()
    for version in (1, 2, 2, 4):
        await buf.put(make_trajectory(f"v{version}", version))
    assert await buf.buffered_versions() == [1, 2, 2, 4]
    [newest] = await buf.take(1, timeout=0)
    assert newest.trajectory.policy_version_min == 4
    assert await buf.buffered_versions() == [1, 2, 2, 4]  # pending is still buffered
    await buf.ack([newest.id])
    assert await buf.buffered_versions() == [1, 2, 2]


async def test_close_wakes_waiters_and_refuses_further_calls():
    buf = MemoryBuffer(max_size=1)
    await buf.put(make_trajectory("a"))
    waiting_put = asyncio.create_task(buf.put(make_trajectory("b")))
    other = MemoryBuffer()
    waiting_take = asyncio.create_task(other.take(1))
    await assert_blocked(waiting_put)
    await assert_blocked(waiting_take)
    await buf.close()
    await other.close()
    with pytest.raises(BufferClosed):
        await waiting_put
    with pytest.raises(BufferClosed):
        await waiting_take
    with pytest.raises(BufferClosed):
        await buf.put(make_trajectory("c"))
    with pytest.raises(BufferClosed):
        await buf.take(1, timeout=0)
    await buf.close()  # idempotent


async def test_bad_arguments_are_refused_with_a_message():
    buf = MemoryBuffer()
    with pytest.raises(ValueError, match="positive integer"):
        await buf.take(0)
    with pytest.raises(TypeError, match="Trajectory"):
        await buf.put({"job_id": "x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_size"):
        MemoryBuffer(max_size=0)


def test_create_buffer_from_url():
    assert isinstance(create_buffer(), MemoryBuffer)
    assert isinstance(create_buffer("memory://", max_size=3), ExperienceBuffer)
    with pytest.raises(ValueError, match="unknown experience buffer URL"):
        create_buffer("kafka://x")


async def test_release_hands_back_exactly_these_entries_in_their_place():
    buf = MemoryBuffer()
    for job, version in [("old", 1), ("a", 2), ("b", 2), ("c", 2)]:
        await buf.put(make_trajectory(job, version))
    untaken = await buf.put(make_trajectory("untaken", 0))
    a, b, c = await buf.take(3, timeout=0)
    assert await buf.release([c.id, a.id, untaken, "no-such-id"]) == 2  # only pending entries count
    assert await buf.release([a.id]) == 0  # already released
    assert await buf.stats() == BufferStats(ready=4, pending=1, acked=0)
    again = await buf.take(3, timeout=0)
    assert jobs(again) == ["a", "c", "old"]  # their original place: FIFO in version 2, before version 1
    assert [e.deliveries for e in again] == [2, 2, 1]
    assert await buf.ack([b.id]) == 1
    assert await buf.release([b.id]) == 0  # acknowledged
    assert await buf.stats() == BufferStats(ready=1, pending=3, acked=1)


async def test_release_wakes_a_waiting_take():
    buf = MemoryBuffer()
    await buf.put(make_trajectory("a"))
    [entry] = await buf.take(1, timeout=0)
    waiter = asyncio.create_task(buf.take(1))
    await assert_blocked(waiter)
    assert await buf.release(entry.id) == 1  # one id alone works too, as with ack
    [again] = await waiter
    assert again.id == entry.id and again.deliveries == 2


async def test_expire_removes_ready_entries_of_older_versions_only():
    clock = FakeClock()
    buf = MemoryBuffer(clock=clock)
    await buf.put(make_trajectory("pending1", 1))
    [pending] = await buf.take(1, timeout=0)
    await buf.put(make_trajectory("reclaimed1", 1))
    [reclaimed] = await buf.take(1, timeout=0)
    clock.now += 60
    assert await buf.reclaim(30) == 2
    [pending] = await buf.take(1, timeout=0)  # pending again; reclaimed1 stays ready
    assert pending.trajectory.job_id == "pending1"
    for job, version in [("b1", 1), ("c2", 2), ("d3", 3), ("e4", 4)]:
        await buf.put(make_trajectory(job, version))
    assert await buf.expire(1) == 0  # nothing older than version 1
    assert await buf.expire(3) == 3  # reclaimed1, b1, c2: ready and older than 3
    assert await buf.expire(3) == 0
    assert await buf.stats() == BufferStats(ready=2, pending=1, acked=0, expired=3)
    assert await buf.version_counts() == {1: 1, 3: 1, 4: 1}  # the pending one stays
    assert jobs(await buf.take(5, timeout=0)) == ["e4", "d3"]
    assert await buf.ack([reclaimed.id]) == 0  # gone for good: a late ack does not count it
    assert await buf.release([pending.id]) == 1  # handed back, ready, stale: the next expire removes it
    assert await buf.expire(3) == 1
    assert await buf.stats() == BufferStats(ready=0, pending=2, acked=0, expired=4)


async def test_expire_makes_room_and_leaves_no_stale_heap_keys():
    buf = MemoryBuffer(max_size=1000)
    for i in range(1000):
        await buf.put(make_trajectory(f"old{i}", 0))
    blocked = asyncio.create_task(buf.put(make_trajectory("new", 1)))
    await assert_blocked(blocked)
    assert await buf.expire(1) == 1000
    await blocked
    # The expired keys were at the bottom of the newest-first heap, where take would never reach them.
    assert len(buf._ready) == 1
    assert jobs(await buf.take(2, timeout=0)) == ["new"]


async def test_version_counts_follow_put_ack_and_expire_but_not_take():
    buf = MemoryBuffer()
    assert await buf.version_counts() == {}
    for version in (4, 2, 1, 2):
        await buf.put(make_trajectory(f"v{version}", version))
    assert await buf.version_counts() == {1: 1, 2: 2, 4: 1}
    assert list(await buf.version_counts()) == [1, 2, 4]  # ascending
    [newest] = await buf.take(1, timeout=0)
    assert await buf.version_counts() == {1: 1, 2: 2, 4: 1}  # pending is still unconsumed
    await buf.ack([newest.id])
    assert await buf.version_counts() == {1: 1, 2: 2}  # no zero counts
    assert await buf.expire(2) == 1
    assert await buf.version_counts() == {2: 2}
    assert await buf.buffered_versions() == [2, 2]
