"""RedisBuffer against a real redis-server: what only it does. Several consumers (take_over, release and expire
beside another consumer's pending entries), crashed consumers, a Redis killed mid-stream, its key layout, its ids,
its URL. What every buffer promises is the contract suite's, run over this buffer too:
tests/storage/test_buffer_contract.py.

The fixture starts `redis-server` on a free loopback port from a temporary directory, waits until it answers
PING and kills it by its own pid at the end. Most tests share one server without persistence
(`--save '' --appendonly no`); the tests that kill Redis start their own: one with an append-only file
(`appendfsync always`), which shows that nothing is lost across the restart, and one without, which shows
only that the buffer recovers (Redis without persistence forgets its data when it dies, by design).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import httpx
import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.dev.localstack import REPO, free_port
from tests.storage import jobs, make_trajectory

from .redis_server import REDIS_SKIP, RedisServer

if REDIS_SKIP:
    pytest.skip(REDIS_SKIP, allow_module_level=True)
redis = pytest.importorskip(
    "redis", reason="the redis Python package is missing (pip install 'prorl-adapter[redis]'; make test does)"
)

from prorl_adapter.service.storage import create_buffer  # noqa: E402
from prorl_adapter.service.storage.buffer import BufferStats, BufferUnavailable, MalformedEntryId  # noqa: E402
from prorl_adapter.service.storage.redis_buffer import RedisBuffer  # noqa: E402
from prorl_adapter.service.storage.redis_connection import redact  # noqa: E402


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.kill()


@pytest.fixture
def own_redis_server(tmp_path, request) -> Iterator[RedisServer]:
    """A server this test may kill and restart; `appendonly` from the test's parametrisation."""
    server = RedisServer(tmp_path, appendonly=getattr(request, "param", False)).start()
    yield server
    server.kill()


@pytest.fixture
def prefix() -> str:
    return f"test:{uuid.uuid4().hex[:8]}"


async def leftover_keys(server: RedisServer, prefix: str) -> list[str]:
    client = redis.asyncio.Redis(port=server.port, decode_responses=True)
    try:
        return sorted([k async for k in client.scan_iter(f"{prefix}:v*")])
    finally:
        await client.aclose()


async def test_take_over_hands_back_another_consumers_entries_in_their_place(redis_server, prefix):
    async with (
        RedisBuffer(redis_server.url, prefix=prefix, consumer="service") as buf,
        RedisBuffer(redis_server.url, prefix=prefix, consumer="crashed") as crashed,
    ):
        for job, version in [("a1", 1), ("b3", 3), ("c2", 2), ("d3", 3), ("e1", 1), ("f2", 2)]:
            await buf.put(make_trajectory(job, version))
        first = await buf.take(3, timeout=0, order="oldest")
        assert jobs(first) == ["a1", "e1", "c2"]
        [lost] = await crashed.take(1, timeout=0)  # b3, taken by another consumer
        assert jobs([lost]) == ["b3"]
        assert await buf.ready_counts() == {2: 1, 3: 1}  # pending for any consumer is not ready
        assert await buf.take_over("crashed") == 1  # b3: back before d3
        assert await buf.ready_counts() == {2: 1, 3: 2}
        rest = await buf.take(10, timeout=0, order="oldest")
        assert jobs(rest) == ["f2", "b3", "d3"]
        assert [b.deliveries for b in rest] == [1, 2, 1]
        assert await buf.take_over("crashed") == 0  # nothing of its is left
        assert await buf.ack([b.id for b in first + rest]) == 6
        assert await buf.stats() == BufferStats(ready=0, pending=0, acked=6)


async def test_an_oldest_first_take_waits_for_a_put_from_another_client(redis_server, prefix):
    async with (
        RedisBuffer(redis_server.url, prefix=prefix) as producer,
        RedisBuffer(redis_server.url, prefix=prefix) as trainer,
    ):
        waiter = asyncio.create_task(trainer.take(2, timeout=30, order="oldest"))
        await producer.put(make_trajectory("new", 5))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), 0.2)
        await producer.put(make_trajectory("old", 1))
        # Woken by the put of another client; it took nothing while fewer than two were ready, so the two come oldest
        # first (the contract suite asserts the same with one client).
        assert jobs(await asyncio.wait_for(waiter, 10)) == ["old", "new"]


@pytest.mark.parametrize("operation", ["put", "stats", "waiting take"])
async def test_a_task_cancelled_at_any_point_of_a_buffer_call_ends(redis_server, prefix, operation):
    """redis-py sends under `asyncio.wait_for`, which on Python 3.11 swallows a cancellation that arrives as the
    send completes: a task looping over buffer calls then never ended (a stopping service waited for it forever).
    Every point of the call is tried: the cancellation comes after 0, 1, 2, ... steps of the event loop."""
    async with RedisBuffer(redis_server.url, prefix=prefix) as buf:
        calls = {
            "put": lambda: buf.put(make_trajectory("x")),
            "stats": buf.stats,
            "waiting take": lambda: buf.take(1, timeout=0.05, order="oldest"),
        }

        async def forever() -> None:
            while True:
                await calls[operation]()

        for steps in range(60):
            task = asyncio.create_task(forever())
            for _ in range(steps):
                await asyncio.sleep(0)  # one step of the event loop: where in the call the cancellation lands
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=10)
            assert done, f"the task cancelled after {steps} loop steps is still running"
            assert task.cancelled()


async def test_crashed_consumer_entries_are_reclaimed_and_consumed_exactly_once(redis_server, prefix):
    n = 20
    async with RedisBuffer(redis_server.url, prefix=prefix, consumer="producer") as producer:
        for i in range(n):
            await producer.put(make_trajectory(f"j{i}", i % 2))

    crashed = RedisBuffer(redis_server.url, prefix=prefix, consumer="trainer-a")
    lost = await crashed.take(8, timeout=0)
    assert len(lost) == 8
    await crashed.close()  # the trainer is gone without acknowledging anything
    del crashed

    async with RedisBuffer(redis_server.url, prefix=prefix, consumer="trainer-b") as survivor:
        rest = await survivor.take(n, timeout=0)
        assert len(rest) == n - 8
        assert await survivor.ack([b.id for b in rest]) == n - 8
        assert await survivor.stats() == BufferStats(ready=0, pending=8, acked=n - 8)
        assert await survivor.take(1, timeout=0) == []
        assert await survivor.reclaim(60) == 0  # not idle for a minute yet
        assert await survivor.reclaim(0) == 8
        assert await survivor.stats() == BufferStats(ready=8, pending=0, acked=n - 8)
        recovered = await survivor.take(n, timeout=0)
        assert sorted(b.id for b in recovered) == sorted(b.id for b in lost)
        assert all(b.deliveries == 2 for b in recovered)
        assert [b.trajectory.policy_version_min for b in recovered] == sorted(
            (b.trajectory.policy_version_min for b in recovered), reverse=True
        )
        assert await survivor.ack([b.id for b in recovered]) == 8
        consumed = jobs(rest) + jobs(recovered)
        assert len(consumed) == n and set(consumed) == {f"j{i}" for i in range(n)}
        assert await survivor.stats() == BufferStats(ready=0, pending=0, acked=n)
        assert await survivor.reclaim(0) == 0
    assert await leftover_keys(redis_server, prefix) == []


async def test_consumer_process_killed_with_sigkill_loses_nothing(redis_server, prefix):
    async with RedisBuffer(redis_server.url, prefix=prefix) as producer:
        for i in range(10):
            await producer.put(make_trajectory(f"j{i}"))
    script = textwrap.dedent(f"""
        import asyncio, json, sys
        from prorl_adapter.service.storage.redis_buffer import RedisBuffer

        async def main():
            buf = RedisBuffer({redis_server.url!r}, prefix={prefix!r}, consumer="doomed")
            batch = await buf.take(4, timeout=0)
            print(json.dumps([b.id for b in batch]), flush=True)
            await asyncio.Event().wait()  # hangs until killed, acknowledging nothing

        asyncio.run(main())
    """)
    child = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        taken = json.loads(child.stdout.readline())
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert len(taken) == 4

    async with RedisBuffer(redis_server.url, prefix=prefix, consumer="survivor") as survivor:
        first = await survivor.take(10, timeout=0)
        assert len(first) == 6 and not set(b.id for b in first) & set(taken)
        assert await survivor.ack([b.id for b in first]) == 6  # (reclaim(0) would take its own pending too)
        assert await survivor.reclaim(0) == 4
        second = await survivor.take(10, timeout=0)
        assert sorted(b.id for b in second) == sorted(taken)
        assert await survivor.ack([b.id for b in second]) == 4
        assert sorted(jobs(first + second)) == sorted(f"j{i}" for i in range(10))


async def test_late_ack_of_a_reclaimed_entry_is_not_delivered_again(redis_server, prefix):
    async with (
        RedisBuffer(redis_server.url, prefix=prefix, consumer="slow") as slow,
        RedisBuffer(redis_server.url, prefix=prefix, consumer="other") as other,
    ):
        await slow.put(make_trajectory("x"))
        [entry] = await slow.take(1, timeout=0)
        assert await other.reclaim(0) == 1
        assert await slow.ack([entry.id]) == 1  # the slow consumer finished it after all
        assert await other.take(1, timeout=0) == []
        assert await other.stats() == BufferStats(ready=0, pending=0, acked=1)


async def test_release_hands_back_only_entries_pending_for_this_consumer(redis_server, prefix):
    async with (
        RedisBuffer(redis_server.url, prefix=prefix, consumer="service") as buf,
        RedisBuffer(redis_server.url, prefix=prefix, consumer="other") as other,
    ):
        await buf.put(make_trajectory("old", 1))
        await buf.put(make_trajectory("a", 2))
        [mine] = await buf.take(1, timeout=0)
        [elsewhere] = await other.take(1, timeout=0)  # "old", pending for another consumer
        assert await buf.release([mine.id, elsewhere.id]) == 1  # only its own pending ones
        assert await buf.stats() == BufferStats(ready=1, pending=1, acked=0)
        assert await other.ack([elsewhere.id]) == 1
        [again] = await buf.take(3, timeout=0)
        assert again.id == mine.id and again.deliveries == 2
        assert await buf.ack([again.id]) == 1
        with pytest.raises(MalformedEntryId):
            await buf.release(["not-an-id"])


async def test_expire_deletes_in_slices_and_retires_the_streams_it_empties(redis_server, prefix):
    async with RedisBuffer(redis_server.url, prefix=prefix, consumer="service") as buf:
        await buf.put(make_trajectory("pending1", 1))
        [pending] = await buf.take(1, timeout=0)
        await buf.put(make_trajectory("released1", 1))
        [released] = await buf.take(1, timeout=0)
        assert await buf.release([released.id]) == 1  # ready again, though Redis holds it as pending
        for i in range(250):  # more than the script deletes per slice
            await buf.put(make_trajectory(f"b{i}", 1))
        for job, version in [("c2", 2), ("d3", 3), ("e4", 4)]:
            await buf.put(make_trajectory(job, version))
        assert await buf.expire(1) == 0
        assert await buf.expire(3) == 252  # released1, b0..b249 (a pending one stays in the stream), c2
        assert await buf.expire(3) == 0
        assert await buf.stats() == BufferStats(ready=2, pending=1, acked=0, expired=252)
        assert await buf.version_counts() == {1: 1, 3: 1, 4: 1}
        streams = [f"{prefix}:v{v}" for v in (1, 3, 4)]  # version 2: emptied, deleted and unregistered
        assert await leftover_keys(redis_server, prefix) == [*streams, f"{prefix}:versions"]
        assert jobs(await buf.take(5, timeout=0)) == ["e4", "d3"]
        assert await buf.ack([released.id]) == 0  # gone for good: a late ack does not count it
        assert await buf.release([pending.id]) == 1  # handed back, ready, stale: the next expire removes it
        assert await buf.expire(3) == 1
        assert await buf.stats() == BufferStats(ready=0, pending=2, acked=0, expired=253)
        assert await buf.take(1, timeout=0) == []
        assert await leftover_keys(redis_server, prefix) == [*streams[1:], f"{prefix}:versions"]  # v1 emptied


async def test_expire_leaves_entries_pending_for_other_consumers(redis_server, prefix):
    async with (
        RedisBuffer(redis_server.url, prefix=prefix, consumer="service") as buf,
        RedisBuffer(redis_server.url, prefix=prefix, consumer="other") as other,
    ):
        await buf.put(make_trajectory("x", 1))
        [taken] = await other.take(1, timeout=0)
        await buf.put(make_trajectory("y", 1))
        assert await buf.expire(2) == 1  # y
        assert await other.ack([taken.id]) == 1
        assert await buf.stats() == BufferStats(ready=0, pending=0, acked=1, expired=1)
        assert await leftover_keys(redis_server, prefix) == []


def assert_clear(exc: BufferUnavailable, server: RedisServer, what: str) -> None:
    message = str(exc)
    assert server.url in message and "unavailable" in message and what in message, message
    assert exc.__cause__ is None and exc.__suppress_context__  # no traceback from inside redis-py


@pytest.mark.parametrize("own_redis_server", [True], indirect=True, ids=["appendonly"])
async def test_redis_killed_mid_stream_fails_clearly_and_loses_nothing_with_aof(own_redis_server, prefix):
    server = own_redis_server
    async with RedisBuffer(server.url, prefix=prefix, consumer="trainer", socket_timeout=2) as buf:
        for i in range(10):
            await buf.put(make_trajectory(f"j{i}", i % 2))
        batch = await buf.take(3, timeout=0)
        assert await buf.ack([b.id for b in batch[:2]]) == 2
        # A take waiting for more than there is: it blocks, and takes nothing until it can take 20.
        waiter = asyncio.create_task(buf.take(20, timeout=60))
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(waiter), 0.3)
        assert await buf.stats() == BufferStats(ready=7, pending=1, acked=2)

        server.kill()
        with pytest.raises(BufferUnavailable) as failed:
            await asyncio.wait_for(waiter, 15)
        assert_clear(failed.value, server, "failed")  # normally "waiting for new entries on ... failed"
        with pytest.raises(BufferUnavailable) as failed:
            await buf.put(make_trajectory("while-down"))
        assert_clear(failed.value, server, "adding a trajectory")
        with pytest.raises(BufferUnavailable):
            await buf.stats()

        server.start()  # same port, same directory: Redis replays its append-only file
        await buf.ping()  # the same object reconnects
        # Durable: the 2 acknowledged are gone, the other 8 are still there: 7 ready, and 1 pending (taken before
        # the crash), which reclaim hands back.
        assert await buf.stats() == BufferStats(ready=7, pending=1, acked=2)
        assert len(await buf.buffered_versions()) == 8
        assert await buf.reclaim(0) == 1
        recovered = await buf.take(8, timeout=0)
        assert sorted(jobs(recovered)) == sorted({f"j{i}" for i in range(10)} - set(jobs(batch[:2])))
        assert await buf.ack([b.id for b in recovered]) == 8
        await buf.put(make_trajectory("after"))
        assert jobs(await buf.take(1, timeout=5)) == ["after"]


async def test_redis_without_persistence_loses_its_data_but_the_buffer_recovers(own_redis_server, prefix):
    server = own_redis_server
    async with RedisBuffer(server.url, prefix=prefix, socket_timeout=2) as buf:
        for i in range(5):
            await buf.put(make_trajectory(f"j{i}"))
        server.kill()
        with pytest.raises(BufferUnavailable) as failed:
            await buf.take(1, timeout=0)
        assert_clear(failed.value, server, server.url)
        server.start()
        # Honest: an in-memory Redis that died has forgotten the 5 entries (use appendonly for durability).
        assert await buf.stats() == BufferStats(ready=0, pending=0, acked=0)
        await buf.put(make_trajectory("after", 3))
        [entry] = await buf.take(1, timeout=5)
        assert entry.trajectory.job_id == "after" and await buf.ack([entry.id]) == 1


async def test_unreachable_redis_names_the_url_and_the_operation():
    url = f"redis://127.0.0.1:{free_port()}/0"
    async with RedisBuffer(url, socket_timeout=1, retries=0) as buf:
        with pytest.raises(BufferUnavailable, match=r"Redis at redis://127\.0\.0\.1:\d+/0 is unavailable: PING failed"):
            await buf.ping()
        with pytest.raises(BufferUnavailable, match="adding a trajectory to prorl:buffer:v0 failed"):
            await buf.put(make_trajectory("x"))


def test_passwords_are_hidden_in_messages():
    assert redact("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact("redis://user:s3cret@host/1") == "redis://user:***@host/1"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"
    assert "s3cret" not in repr(RedisBuffer("redis://:s3cret@127.0.0.1:1/0"))


async def test_create_buffer_opens_a_redis_buffer_from_its_url(redis_server, prefix):
    async with create_buffer(redis_server.url, prefix=prefix, consumer="c") as buf:
        assert isinstance(buf, RedisBuffer) and buf.consumer == "c"
        entry_id = await buf.put(make_trajectory("x", 2))
        [entry] = await buf.take(1, timeout=5)
        assert entry.id == entry_id and await buf.ack([entry_id]) == 1


async def test_the_service_answers_a_malformed_ack_id_with_a_400(redis_server):
    """Through the rollout service's API with the Redis buffer (it was a 500 with a traceback)."""
    localstack.build_tiny_model()
    dead = f"http://127.0.0.1:{free_port()}"  # no LLM or sandbox is needed to acknowledge
    rollout = localstack.start_rollout_service([dead], [dead], "--buffer", redis_server.url)
    try:
        async with httpx.AsyncClient(base_url=rollout.url) as http:
            answer = await http.post("/v1/batches/ack", json={"ids": ["not-an-id"]})
        assert answer.status_code == 400 and "not an entry id" in answer.json()["error"]
    finally:
        rollout.stop()
