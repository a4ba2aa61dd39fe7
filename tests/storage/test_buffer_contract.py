"""The experience buffer's contract (`storage/buffer.py`), over `MemoryBuffer` and `RedisBuffer`: order, waiting,
ack, reclaim, release, expire and the counts pacing reads. What only one of them does is tested beside it:
tests/test_buffer_memory.py (max_size, heap upkeep) and integration_tests/test_buffer_redis.py (several consumers,
crashes, a Redis that dies, key layout).

Idle time for `reclaim` is the memory buffer's injected clock and Redis's own: `rig.idle(s)` lets `s` seconds
pass on whichever the buffer reads (a real sleep for Redis, so keep them short).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

import pytest

from prorl_adapter.service.storage.buffer import BufferClosed, BufferStats, ExperienceBuffer, MalformedEntryId
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer

from . import assert_blocked, jobs, make_trajectory


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rig:
    kind: str
    buffer: ExperienceBuffer
    url: str | None = None
    prefix: str | None = None
    clock: FakeClock | None = None
    opened: AsyncExitStack = field(default_factory=AsyncExitStack)

    @property
    def unknown_id(self) -> str:
        """An id of the form this buffer hands out, which it never handed out."""
        return "m999999" if self.kind == "memory" else "2:1-1"

    async def idle(self, seconds: float) -> None:
        """Let `seconds` pass on the clock the buffer measures pending entries' idle time by."""
        if self.clock is not None:
            self.clock.now += seconds
        else:
            await asyncio.sleep(seconds)  # Redis's own clock: nothing to inject

    async def client(self, consumer: str) -> ExperienceBuffer:
        """Another client of the same buffer (a producer beside the trainer): for memory, the one object a process
        shares; for Redis, a connection of its own under another consumer name."""
        if self.kind == "memory":
            return self.buffer
        from prorl_adapter.service.storage.redis_buffer import RedisBuffer

        return await self.opened.enter_async_context(RedisBuffer(self.url, prefix=self.prefix, consumer=consumer))


@pytest.fixture
async def rig(kind, prefix, request) -> AsyncIterator[Rig]:
    if kind == "memory":
        clock = FakeClock()
        rig = Rig(kind, MemoryBuffer(clock=clock), clock=clock)
    else:
        from prorl_adapter.service.storage.redis_buffer import RedisBuffer

        url = request.getfixturevalue("redis_url")
        rig = Rig(kind, RedisBuffer(url, prefix=prefix, consumer="trainer"), url=url, prefix=prefix)
    async with rig.opened:
        try:
            yield rig
        finally:
            await rig.buffer.close()


async def test_produce_consume_ack_nothing_lost_nothing_duplicated(rig):
    n = 60
    producer, trainer = await rig.client("producer"), rig.buffer
    produced = {f"j{i}": i % 4 for i in range(n)}
    ids = [await producer.put(make_trajectory(job, version)) for job, version in produced.items()]
    assert len(set(ids)) == n
    assert await trainer.stats() == BufferStats(ready=n, pending=0, acked=0)
    consumed: list[str] = []
    while batch := await trainer.take(7, timeout=0):
        assert all(b.deliveries == 1 for b in batch)
        assert all(b.trajectory == make_trajectory(b.trajectory.job_id, produced[b.trajectory.job_id]) for b in batch)
        assert (await trainer.stats()).pending == len(batch)
        assert await trainer.ack([b.id for b in batch]) == len(batch)
        consumed += jobs(batch)
    # Newest version first, FIFO within a version, across batches as within one.
    assert consumed == sorted(produced, key=lambda job: (-produced[job], int(job[1:])))
    assert await trainer.ack(ids) == 0  # acknowledged once only
    assert await trainer.stats() == BufferStats(ready=0, pending=0, acked=n)
    assert await trainer.buffered_versions() == []


async def test_put_many_puts_all_in_their_order_or_none(rig):
    """An import's put: every trajectory or none (a wrong one refuses the lot), each id in the order given."""
    batch = [make_trajectory("a", 2), make_trajectory("b", 1), make_trajectory("c", 2)]
    with pytest.raises(TypeError):
        await rig.buffer.put_many([*batch, "not a trajectory"])
    assert await rig.buffer.stats() == BufferStats(ready=0, pending=0, acked=0)
    ids = await rig.buffer.put_many(batch)
    assert len(set(ids)) == 3 and await rig.buffer.version_counts() == {2: 2, 1: 1}
    taken = await rig.buffer.take(3, timeout=0)
    assert jobs(taken) == ["a", "c", "b"] and {b.id for b in taken} == set(ids)
    assert dict(zip(jobs(taken), [b.id for b in taken], strict=True)) == dict(zip("abc", ids, strict=True))


async def test_newest_version_first_fifo_within_a_version(rig):
    buf = rig.buffer
    for job, version in [("a1", 1), ("b3", 3), ("c2", 2), ("d3", 3), ("e1", 1), ("f2", 2)]:
        await buf.put(make_trajectory(job, version))
    first = await buf.take(3, timeout=0)
    assert jobs(first) == ["b3", "d3", "c2"]
    assert [b.trajectory.policy_version_min for b in first] == [3, 3, 2]
    await buf.put(make_trajectory("g5", 5))  # a newer version put later overtakes what is left
    assert jobs(await buf.take(10, timeout=0)) == ["g5", "f2", "a1", "e1"]
    await buf.put(make_trajectory("g1", 1))
    await buf.put(make_trajectory("h5", 5))
    assert jobs(await buf.take(2, timeout=0)) == ["h5", "g1"]


async def test_oldest_version_first_fifo_within_a_version_and_handed_back_entries_keep_their_place(rig):
    buf = rig.buffer
    for job, version in [("a1", 1), ("b3", 3), ("c2", 2), ("d3", 3), ("e1", 1), ("f2", 2)]:
        await buf.put(make_trajectory(job, version))
    assert await buf.ready_counts() == {1: 2, 2: 2, 3: 2}
    first = await buf.take(3, timeout=0, order="oldest")
    assert jobs(first) == ["a1", "e1", "c2"]
    assert await buf.ready_counts() == {2: 1, 3: 2}
    newest = await buf.take(1, timeout=0)  # the default order is unchanged, and the orders share the entries
    assert jobs(newest) == ["b3"]
    assert await buf.ready_counts() == {2: 1, 3: 1}  # pending is not ready
    await buf.put(make_trajectory("g0", 0))  # an older version put later still comes first
    assert await buf.release([first[1].id, first[0].id]) == 2  # back in their place: before c2's peers
    await rig.idle(0.4)
    assert await buf.reclaim(0.3) == 2  # c2 and b3: before f2 and d3, FIFO in their versions
    assert await buf.ready_counts() == {0: 1, 1: 2, 2: 2, 3: 2}
    again = await buf.take(10, timeout=0, order="oldest")
    assert jobs(again) == ["g0", "a1", "e1", "c2", "f2", "b3", "d3"]
    assert [b.deliveries for b in again] == [1, 2, 2, 2, 1, 2, 1]
    assert await buf.take(1, timeout=0) == [] and await buf.ready_counts() == {}
    assert await buf.ack([b.id for b in again]) == 7
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=7)


async def test_an_oldest_first_take_waits_for_n_and_returns_them_oldest_first(rig):
    buf = rig.buffer
    waiter = asyncio.create_task(buf.take(2, order="oldest"))
    await assert_blocked(waiter)
    await buf.put(make_trajectory("new", 5))
    await assert_blocked(waiter)
    await buf.put(make_trajectory("old", 1))
    assert jobs(await asyncio.wait_for(waiter, 10)) == ["old", "new"]


async def test_take_waits_until_n_are_ready(rig):
    buf = rig.buffer
    task = asyncio.create_task(buf.take(3))
    await assert_blocked(task)
    await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    await assert_blocked(task)  # two are not three
    await buf.put(make_trajectory("c"))
    assert jobs(await asyncio.wait_for(task, 10)) == ["a", "b", "c"]


async def test_a_take_is_woken_by_a_put_from_another_client_and_a_timeout_returns_what_there_is(rig):
    producer, trainer = await rig.client("producer"), rig.buffer
    assert await trainer.take(4, timeout=0) == []
    assert await trainer.take(4, timeout=0.01) == []
    waiter = asyncio.create_task(trainer.take(3, timeout=30))
    await assert_blocked(waiter)
    for i, version in enumerate((0, 7, 3)):  # version 7 and 3: versions the waiter had never seen
        await producer.put(make_trajectory(f"j{i}", version))
    started = time.monotonic()
    batch = await asyncio.wait_for(waiter, 10)
    assert sorted(jobs(batch)) == ["j0", "j1", "j2"]
    assert time.monotonic() - started < 2  # woken by the put, not by its timeout

    await producer.put(make_trajectory("a"))
    await producer.put(make_trajectory("b"))
    assert jobs(await trainer.take(4, timeout=0.01)) == ["a", "b"]
    await producer.put(make_trajectory("c"))
    assert jobs(await trainer.take(4, timeout=0)) == ["c"]
    await producer.put(make_trajectory("only", 1))
    started = time.monotonic()
    assert jobs(await trainer.take(5, timeout=0.3)) == ["only"]
    assert 0.25 <= time.monotonic() - started < 5


async def test_concurrent_takers_get_disjoint_batches(rig):
    buf = rig.buffer
    first, second = asyncio.create_task(buf.take(2)), asyncio.create_task(buf.take(2))
    await assert_blocked(first)
    for i in range(4):
        await buf.put(make_trajectory(f"j{i}"))
    a, b = await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert sorted(jobs(a) + jobs(b)) == ["j0", "j1", "j2", "j3"]


async def test_ack_counts_only_pending_entries_once(rig):
    buf = rig.buffer
    never_taken = await buf.put(make_trajectory("a"))
    await buf.put(make_trajectory("b"))
    [taken] = await buf.take(1, timeout=0)
    assert taken.trajectory.job_id == "a" and taken.id == never_taken
    untaken = await buf.put(make_trajectory("c"))
    assert await buf.ack([untaken, rig.unknown_id]) == 0  # not taken, never handed out: not consumed
    assert await buf.ack([taken.id]) == 1
    assert await buf.ack([taken.id]) == 0  # twice: once
    assert await buf.stats() == BufferStats(ready=2, pending=0, acked=1)


async def test_an_id_of_a_form_the_buffer_never_hands_out_is_refused_with_a_400(rig):
    buf = rig.buffer
    await buf.put(make_trajectory("a"))
    [taken] = await buf.take(1, timeout=0)
    for call in (buf.ack, buf.release):
        with pytest.raises(MalformedEntryId, match="not an entry id of this buffer") as refusal:
            await call([taken.id, "not-an-id"])
        assert refusal.value.status == 400
    assert await buf.stats() == BufferStats(ready=0, pending=1, acked=0)  # nothing of the call was done


async def test_reclaim_hands_back_entries_idle_too_long_in_their_place(rig):
    buf = rig.buffer
    for job, version in [("old", 1), ("new-a", 2), ("new-b", 2), ("new-c", 2)]:
        await buf.put(make_trajectory(job, version))
    crashed = await buf.take(2, timeout=0)  # a trainer takes two and dies
    assert jobs(crashed) == ["new-a", "new-b"]
    await rig.idle(1.0)
    recent = await buf.take(1, timeout=0)  # a live trainer takes one
    assert jobs(recent) == ["new-c"]
    await rig.idle(0.5)
    assert await buf.reclaim(30) == 0  # nobody idle for 30 s
    assert await buf.reclaim(1.2) == 2  # the crashed trainer's two (idle 1.5 s), not the live one's (0.5 s)
    assert await buf.stats() == BufferStats(ready=3, pending=1, acked=0)
    again = await buf.take(3, timeout=0)
    assert jobs(again) == ["new-a", "new-b", "old"]  # their original place: version 2 before version 1
    assert [b.deliveries for b in again] == [2, 2, 1]
    assert [b.id for b in again[:2]] == [b.id for b in crashed]
    assert await buf.ack([b.id for b in again + recent]) == 4
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=4)
    assert await buf.reclaim(0) == 0


async def test_late_ack_after_reclaim_is_not_delivered_again(rig):
    buf = rig.buffer
    await buf.put(make_trajectory("slow"))
    [entry] = await buf.take(1, timeout=0)
    await rig.idle(0.3)
    assert await buf.reclaim(0.2) == 1
    assert await buf.ack([entry.id]) == 1  # the slow trainer did consume it after all
    assert await buf.take(1, timeout=0) == []
    assert await buf.stats() == BufferStats(ready=0, pending=0, acked=1)


async def test_reclaim_wakes_a_waiting_take(rig):
    buf = rig.buffer
    await buf.put(make_trajectory("a"))
    await buf.take(1, timeout=0)
    waiter = asyncio.create_task(buf.take(1))
    await assert_blocked(waiter)
    assert await buf.reclaim(0) == 1
    [entry] = await asyncio.wait_for(waiter, 10)
    assert entry.trajectory.job_id == "a" and entry.deliveries == 2


async def test_buffered_versions_count_ready_and_pending_until_acked(rig):
    buf = rig.buffer
    for version in (1, 2, 2, 4):
        await buf.put(make_trajectory(f"v{version}", version))
    assert await buf.buffered_versions() == [1, 2, 2, 4]
    [newest] = await buf.take(1, timeout=0)
    assert newest.trajectory.policy_version_min == 4
    assert await buf.buffered_versions() == [1, 2, 2, 4]  # pending is still buffered
    await buf.ack([newest.id])
    assert await buf.buffered_versions() == [1, 2, 2]


async def test_a_take_waiting_when_the_buffer_closes_raises_and_later_calls_are_refused(rig):
    """The memory buffer wakes the take at once; a Redis one learns of it when its current wait on Redis ends (up to
    half its socket timeout, 2.5 s by default)."""
    buf = rig.buffer
    waiting_take = asyncio.create_task(buf.take(1))
    await assert_blocked(waiting_take)
    await buf.close()
    with pytest.raises(BufferClosed):
        await asyncio.wait_for(waiting_take, 10)
    with pytest.raises(BufferClosed):
        await buf.put(make_trajectory("c"))
    with pytest.raises(BufferClosed):
        await buf.take(1, timeout=0)
    await buf.close()  # idempotent


async def test_bad_arguments_are_refused_with_a_message(rig):
    buf = rig.buffer
    with pytest.raises(ValueError, match="positive integer"):
        await buf.take(0)
    with pytest.raises(TypeError, match="Trajectory"):
        await buf.put({"job_id": "x"})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="order must be one of newest, oldest"):
        await buf.take(1, order="fifo")


async def test_release_hands_back_exactly_these_entries_in_their_place(rig):
    buf = rig.buffer
    for job, version in [("old", 1), ("a", 2), ("b", 2), ("c", 2)]:
        await buf.put(make_trajectory(job, version))
    untaken = await buf.put(make_trajectory("untaken", 0))
    a, b, c = await buf.take(3, timeout=0)
    assert await buf.release([c.id, a.id, untaken, rig.unknown_id]) == 2  # only pending entries count
    assert await buf.release([a.id]) == 0  # already released
    assert await buf.stats() == BufferStats(ready=4, pending=1, acked=0)
    again = await buf.take(3, timeout=0)
    assert jobs(again) == ["a", "c", "old"]  # their original place: FIFO in version 2, before version 1
    assert [e.deliveries for e in again] == [2, 2, 1]
    assert await buf.ack([b.id]) == 1
    assert await buf.release([b.id]) == 0  # acknowledged
    assert await buf.stats() == BufferStats(ready=1, pending=3, acked=1)


async def test_release_wakes_a_waiting_take(rig):
    buf = rig.buffer
    await buf.put(make_trajectory("a"))
    [entry] = await buf.take(1, timeout=0)
    waiter = asyncio.create_task(buf.take(1))
    await assert_blocked(waiter)
    assert await buf.release(entry.id) == 1  # one id alone works too, as with ack
    [again] = await asyncio.wait_for(waiter, 10)
    assert again.id == entry.id and again.deliveries == 2
    assert await buf.ack([again.id]) == 1


async def test_expire_removes_ready_entries_of_older_versions_only(rig):
    buf = rig.buffer
    await buf.put(make_trajectory("pending1", 1))
    [pending] = await buf.take(1, timeout=0)
    await buf.put(make_trajectory("reclaimed1", 1))
    [reclaimed] = await buf.take(1, timeout=0)
    await rig.idle(0.3)
    assert await buf.reclaim(0.2) == 2
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
    assert await buf.take(1, timeout=0) == []


async def test_version_counts_follow_put_ack_and_expire_but_not_take(rig):
    buf = rig.buffer
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


async def test_one_process_has_no_other_consumer_to_take_over(rig):
    """`take_over` of a consumer that took nothing hands back nothing (a buffer of one process: never anything)."""
    buf = rig.buffer
    await buf.put(make_trajectory("a"))
    [entry] = await buf.take(1, timeout=0)
    assert await buf.take_over("nobody") == 0
    assert await buf.stats() == BufferStats(ready=0, pending=1, acked=0)
    assert await buf.ack([entry.id]) == 1
