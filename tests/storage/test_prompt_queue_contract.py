"""The prompt queue's contract (`storage/prompts.py`), over `MemoryPromptQueue` and `RedisPromptQueue`: push, pop,
done, and the running prompts admission weighs. What only the Redis queue does (a restarted service finds its
prompts, a dead replica's are taken over, only a prompt's owner ends its run, an outage) is tested beside it:
integration_tests/test_prompts_redis.py and test_coordination_redis.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.storage.prompts import MemoryPromptQueue, PromptQueue


@pytest.fixture
async def queue(kind, prefix, request) -> AsyncIterator[PromptQueue]:
    if kind == "memory":
        prompts: PromptQueue = MemoryPromptQueue()
    else:
        from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue

        prompts = RedisPromptQueue(request.getfixturevalue("redis_url"), "r0", prefix=prefix, socket_timeout=1)
    try:
        yield prompts
    finally:
        await prompts.close()


async def test_prompts_come_out_in_order_each_with_a_job_id(queue):
    assert await queue.size() == 0 and await queue.pop(0) is None
    assert await queue.push([JobRequest(task="t", labels={"n": str(i)}) for i in range(3)]) == 3
    assert await queue.push([JobRequest(task="t", job_id="mine")]) == 4  # a job id given is kept
    assert await queue.push([]) == 4
    running = await queue.pop(0)
    assert running is not None and running.job_id and running.labels == {"n": "0"}
    popped = [await queue.pop(0) for _ in range(3)]
    assert [r.labels.get("n") for r in popped] == ["1", "2", None] and popped[2].job_id == "mine"
    assert len({running.job_id, *(r.job_id for r in popped)}) == 4
    assert popped[2] == JobRequest(task="t", job_id="mine")  # the request as pushed
    assert await queue.size() == 0 and await queue.pop(0) is None


async def test_running_prompts_are_counted_by_the_version_they_were_admitted_at(queue):
    await queue.push([JobRequest(task="t", job_id=f"p{i}") for i in range(3)])
    first, second = await queue.pop(2), await queue.pop(3)
    await queue.pop(3)
    assert await queue.running_versions() == {2: 1, 3: 2}
    await queue.done(second.job_id)
    await queue.done(first.job_id)
    await queue.done(first.job_id)  # twice: counted once
    await queue.done("never-popped")
    assert await queue.running_versions() == {3: 1}


async def test_recover_returns_the_prompts_popped_here_and_not_done(queue):
    await queue.push([JobRequest(task="t", job_id=f"p{i}") for i in range(3)])
    await queue.pop(1)
    done = await queue.pop(1)
    await queue.done(done.job_id)
    assert await queue.recover() == [JobRequest(task="t", job_id="p0")]


async def test_a_replica_that_ran_nothing_leaves_nothing_to_take_over(queue):
    await queue.push([JobRequest(task="t", job_id="p0")])
    await queue.pop(1)
    assert await queue.take_over("nobody") == []
    assert await queue.running_versions() == {1: 1}


async def test_a_prompt_pushed_twice_counts_once(queue):
    await queue.push([JobRequest(task="t", job_id="p"), JobRequest(task="t", job_id="p")])
    await queue.pop(1)
    await queue.pop(2)  # the same prompt again (a push retried): one run, counted once
    assert await queue.running_versions() == {1: 1}
    await queue.done("p")
    assert await queue.running_versions() == {}
