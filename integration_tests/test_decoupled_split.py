"""How two replicas share decoupled work when a shared bound, not their workers, limits it: real Producers, each
with its own coordination, buffer and prompt queue on one real Redis, and a trainer that takes and acknowledges
at one replica only. The room an acknowledgement frees is announced to every replica (`room_freed`), and replicas
alive together admit in turns of one prompt (`FAIR_TURN_S`): before, the replica the trainer talked to saw the
room first and ran most episodes (67% / 33% in bench_scale_out). Episodes are simulated (`Episodes`): they end
when the test's loop says, at whichever replica runs them."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import JobRequest, JobState
from prorl_adapter.service.decoupled import Producer, ProducerConfig
from tests.test_producer import Episodes

from .redis_server import REDIS_SKIP, RedisServer

if REDIS_SKIP:
    pytest.skip(REDIS_SKIP, allow_module_level=True)
pytest.importorskip("redis", reason="the redis Python package is missing (make test installs it)")

from prorl_adapter.service.storage.redis_buffer import RedisBuffer
from prorl_adapter.service.storage.redis_coordination import RedisCoordination
from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue

PROMPTS = 120
MAX_BUFFERED = 4  # the shared bound: far below what either replica's workers take (16)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-split")).start()
    yield server.url
    server.kill()


async def test_replicas_share_the_room_a_trainer_frees_at_one_of_them(redis_url):
    prefix = f"split:{uuid.uuid4().hex[:12]}"
    producers: list[Producer] = []
    for name in ("trainer-side", "other"):
        coordination = RedisCoordination(redis_url, name, prefix=prefix)
        plugins = PluginSet.load(entry_points=False)
        episodes = Episodes(plugins, workers=16, coordination=coordination)
        buffer = RedisBuffer(redis_url, consumer=name, prefix=f"{prefix}:buffer")
        prompts = RedisPromptQueue(redis_url, name, prefix=f"{prefix}:prompts")
        producer = Producer(episodes, buffer, prompts, ProducerConfig(max_buffered=MAX_BUFFERED), coordination)
        plugins.register(producer, name="decoupled-producer")
        producer.replicas_alive = 2  # what each replica's beat tells it
        producers.append(producer)
    trainer_side = producers[0]
    try:
        for producer in producers:
            await producer.coordination.start()
            producer.start()
        await trainer_side.enqueue([JobRequest(task="t", job_id=f"p{i}") for i in range(PROMPTS)])
        taken = 0
        async with asyncio.timeout(120):  # a bound on the whole run, not a measurement
            while taken < PROMPTS:
                for producer in producers:  # every running episode ends, wherever it runs
                    for job in producer.runner.running():
                        producer.runner.finish(job)
                batch = await trainer_side.take_batch(2, timeout=0.05)
                await trainer_side.ack([item.id for item in batch])
                taken += len(batch)
        ran = [sum(job.state is JobState.done for job in p.runner.jobs.values()) for p in producers]
    finally:
        for producer in producers:
            await producer.stop()
            await producer.coordination.close()
    print(f"\nepisodes run: trainer's replica {ran[0]}, the other {ran[1]} of {PROMPTS}")
    assert sum(ran) == PROMPTS  # each prompt once
    assert min(ran) >= PROMPTS * 0.3, ran  # an even share, give or take: before, about a third at most
