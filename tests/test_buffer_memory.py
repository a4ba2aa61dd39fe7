"""MemoryBuffer alone: its bound (`max_size`: backpressure that only ack and expire relieve), the upkeep of its two
heaps, ids of any form, and `create_buffer`'s default. What every buffer promises is the contract suite's:
tests/storage/test_buffer_contract.py.

"Must not complete" is checked with asyncio.wait_for on a shielded task and a short timeout.
"""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.service.storage import create_buffer
from prorl_adapter.service.storage.buffer import BufferClosed, BufferStats, ExperienceBuffer
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer

from .storage import assert_blocked, jobs, make_trajectory


async def test_takes_in_one_order_leave_no_pile_of_stale_keys_in_the_other():
    buf = MemoryBuffer()
    for i in range(500):
        await buf.put(make_trajectory(f"j{i}", i % 7))
        [taken] = await buf.take(1, timeout=0)
        await buf.ack([taken.id])
    assert len(buf._ready_oldest) <= 16 and len(buf._ready) <= 16


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


async def test_close_wakes_a_put_waiting_for_room():
    buf = MemoryBuffer(max_size=1)
    await buf.put(make_trajectory("a"))
    waiting_put = asyncio.create_task(buf.put(make_trajectory("b")))
    await assert_blocked(waiting_put)
    await buf.close()
    with pytest.raises(BufferClosed):
        await waiting_put


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


async def test_an_id_of_its_form_it_never_handed_out_counts_as_unknown():
    """(One of another form is a 400, as with RedisBuffer: the contract suite.)"""
    buf = MemoryBuffer()
    await buf.put(make_trajectory("a"))
    [taken] = await buf.take(1, timeout=0)
    assert await buf.ack(["m999"]) == 0
    assert await buf.release(["m999"]) == 0
    assert await buf.stats() == BufferStats(ready=0, pending=1, acked=0)
    assert await buf.ack([taken.id]) == 1


def test_a_bad_max_size_is_refused_and_create_buffer_makes_a_memory_buffer_by_default():
    with pytest.raises(ValueError, match="max_size"):
        MemoryBuffer(max_size=0)
    assert isinstance(create_buffer(), MemoryBuffer)
    assert isinstance(create_buffer("memory://", max_size=3), ExperienceBuffer)
    with pytest.raises(ValueError, match="unknown experience buffer URL"):
        create_buffer("kafka://x")
