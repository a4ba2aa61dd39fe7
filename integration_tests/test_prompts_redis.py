"""RedisPromptQueue against a real redis-server: what a restarted service finds, and a Redis that dies. What every
prompt queue promises is the contract suite's, run over this one too: tests/storage/test_prompt_queue_contract.py."""

from __future__ import annotations

import uuid

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.storage.buffer import BufferUnavailable

from .redis_server import REDIS_SKIP, CommandFault, RedisServer

if REDIS_SKIP:
    pytest.skip(REDIS_SKIP, allow_module_level=True)
pytest.importorskip("redis", reason="the redis Python package is missing (make test installs it)")

from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path, appendonly=True).start()
    yield server
    server.kill()


def queue(server: RedisServer, prefix: str) -> RedisPromptQueue:
    return RedisPromptQueue(server.url, prefix=prefix, socket_timeout=1)


async def test_a_restarted_service_gets_back_what_ran_and_what_was_upcoming(redis_server):
    prefix = f"test:{uuid.uuid4().hex}"
    first = queue(redis_server, prefix)
    assert await first.push([JobRequest(task="t", labels={"n": str(i)}) for i in range(3)]) == 3
    running = await first.pop(0)
    assert running is not None and running.job_id and running.labels == {"n": "0"}
    delivered = await first.pop(0)
    await first.done(delivered.job_id)
    assert await first.size() == 1
    await first.close()  # the service dies here

    second = queue(redis_server, prefix)
    try:
        assert [r.job_id for r in await second.recover()] == [running.job_id]  # it runs again, same id
        upcoming = await second.pop(0)
        assert upcoming.labels == {"n": "2"} and await second.pop(0) is None
    finally:
        await second.close()


async def test_an_unreachable_redis_is_buffer_unavailable_and_the_queue_works_once_it_is_back(redis_server):
    prompts = queue(redis_server, f"test:{uuid.uuid4().hex}")
    try:
        await prompts.push([JobRequest(task="t")])
        redis_server.kill()
        with pytest.raises(BufferUnavailable, match="unavailable"):
            await prompts.push([JobRequest(task="t")])
        redis_server.start()  # the append-only file brings the first prompt back
        assert await prompts.push([JobRequest(task="t")]) == 2
    finally:
        await prompts.close()


@pytest.mark.parametrize("lost", ["request", "reply"])
async def test_a_push_of_many_prompts_that_redis_fails_leaves_all_of_them_upcoming_or_none(redis_server, lost):
    """Producer.enqueue's one write (POST /v1/prompts): the fault at each command of the push in turn."""
    prompts = queue(redis_server, f"test:{uuid.uuid4().hex}")
    batch = [JobRequest(task="t", job_id=f"p{i}") for i in range(20)]
    try:
        for at in range(10):
            fault = CommandFault(prompts._connection.redis, at, lost)
            try:
                await prompts.push(batch)
            except BufferUnavailable:
                assert fault.hit
            finally:
                fault.remove()
            assert await prompts.size() in (0, 20)
            while await prompts.pop(0) is not None:  # emptied for the next fault
                pass
            if not fault.hit:
                return
        pytest.fail("the push sent more than 10 commands")
    finally:
        await prompts.close()
