"""The coordination's contract (`storage/coordination.py`), over `MemoryCoordination` and `RedisCoordination`, as one
replica sees it: its heartbeat, the runtimes it hears, the policy version and its listeners, the admission lock and
its fence.
What needs several replicas (a dead one handed to exactly one survivor, a version or a runtime seen by all, the lock
across replicas) is Redis's alone: integration_tests/test_coordination_redis.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.storage.coordination import Coordination, MemoryCoordination
from prorl_adapter.service.storage.prompts import MemoryPromptQueue, PromptQueue
from sandbox_runtime.models import RuntimeHeartbeat

from . import until


@pytest.fixture
async def coordination(kind, prefix, request) -> AsyncIterator[Coordination]:
    if kind == "memory":
        replica: Coordination = MemoryCoordination("r0")
    else:
        from prorl_adapter.service.storage.redis_coordination import RedisCoordination

        replica = RedisCoordination(request.getfixturevalue("redis_url"), "r0", prefix=prefix)
    await replica.start()
    try:
        yield replica
    finally:
        await replica.close()


async def test_a_replica_alone_is_listed_alive_and_nobody_is_dead(coordination):
    assert (await coordination.beat("http://r0", {"running": 3}, interval_s=10)).taken is False
    now, [me] = await coordination.replicas()
    assert (me.id, me.url, me.figures, me.interval_s) == ("r0", "http://r0", {"running": 3}, 10)
    assert me.alive(now)
    assert await coordination.claim_dead(hold_s=60) == []  # never the caller itself
    await coordination.release_claim("nobody")
    await coordination.forget_replica("nobody")
    assert (await coordination.beat("http://r0", {}, interval_s=10)).taken is False
    assert [r.id for r in (await coordination.replicas())[1]] == ["r0"]


async def test_a_runtime_heard_is_listed_until_it_leaves(coordination):
    beat = RuntimeHeartbeat(url="http://n1:8765", capacity=8, sandboxes=2, backend="bwrap", version="v", interval_s=2)
    assert (await coordination.runtimes())[1] == []
    await coordination.runtime_heard("n1", beat)
    now, [record] = await coordination.runtimes()
    assert record.name == "n1" and record.heartbeat == beat and record.alive(now)
    await coordination.runtime_heard("n1", beat.model_copy(update={"leaving": True}))
    assert (await coordination.runtimes())[1] == []


async def test_the_policy_version_is_set_as_asked(coordination):
    assert await coordination.policy_version() == 0
    assert await coordination.set_policy_version(5, raise_only=False) == 5
    assert await coordination.set_policy_version(3, raise_only=True) == 5  # raise only: kept
    assert await coordination.policy_version() == 5
    assert await coordination.set_policy_version(2, raise_only=False) == 2
    assert await coordination.policy_version() == 2


async def test_listeners_hear_each_change_of_the_version_once_and_in_order(coordination):
    """Also where news of a change can come twice and late (Redis: the set's own answer, then its message on the
    channel, and the read made when the subscription starts): each change is numbered, and older news ignored."""
    heard: list[int] = []
    coordination.on_policy_version(heard.append)
    for version, raise_only in [(5, False), (3, True), (5, False), (2, False), (7, True)]:
        await coordination.set_policy_version(version, raise_only=raise_only)  # 3: kept at 5; 5 again: no change
    assert coordination.version == 7
    # A barrier: a message sent after the sets arrives after theirs (one channel keeps its order), so when it is
    # heard every late message of theirs has been too.
    prompts: list[None] = []
    coordination.on_admission_news(lambda: prompts.append(None))
    await coordination.prompts_added()
    await until(lambda: bool(prompts))
    assert heard == [5, 2, 7] and coordination.version == 7


@pytest.mark.parametrize("news", ["prompts_added", "room_freed"])
async def test_listeners_hear_of_prompts_added_and_room_freed_through_this_replica(coordination, news):
    heard: list[None] = []
    coordination.on_admission_news(lambda: heard.append(None))
    await getattr(coordination, news)()
    await until(lambda: bool(heard), timeout=1.0)


async def test_admission_is_one_holder_at_a_time(coordination):
    inside: list[int] = []
    overlap = False

    async def admit(who: int) -> None:
        nonlocal overlap
        for _ in range(20):
            async with coordination.admission_lock():
                overlap = overlap or bool(inside)
                inside.append(who)
                await asyncio.sleep(0)  # let the other one try to enter
                inside.pop()

    await asyncio.wait_for(asyncio.gather(admit(1), admit(2)), 30)
    assert not overlap


async def test_a_prompt_is_popped_under_the_admission_lock_with_its_fence(coordination, kind, prefix, request):
    """What the producer does: each pop of a hold is given the hold's fence (None where the lock cannot expire
    under its holder, in one process), which the prompt queue beside the coordination checks."""
    if kind == "memory":
        prompts: PromptQueue = MemoryPromptQueue()
    else:
        from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue

        prompts = RedisPromptQueue(request.getfixturevalue("redis_url"), "r0", prefix=f"{prefix}:prompts")
    try:
        await prompts.push([JobRequest(task="t", job_id="p")])
        async with coordination.admission_lock() as fence:
            assert (fence is None) == (not coordination.shared)
            assert (await prompts.pop(3, fence)).job_id == "p"
            assert await prompts.pop(3, fence) is None
        assert await prompts.running_versions() == {3: 1}
    finally:
        await prompts.close()
