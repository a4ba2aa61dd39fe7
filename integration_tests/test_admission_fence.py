"""The fenced admission lock, as a property: replicas (real Producers, each with its own coordination, buffer and
prompt queue on one real Redis) never admit beyond the bound, pace's (K + 1) * B or max_buffered, even when one of
them stalls past the lock's expiry between reading the counts and popping a prompt; the stalled admission is
refused and counted (`admission_lock_lapses`).

The stall is injected, not timed: the stalled replica waits inside its admission until every other replica has
taken the lock (which it can only do once the stalled one's lock expired) and admitted. Episodes never end here, so
what runs is what was admitted."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prorl_adapter.hooks import PluginSet
from prorl_adapter.models import JobRequest
from prorl_adapter.service.decoupled import ADMIT_PER_LOCK, Producer, ProducerConfig
from prorl_plugins.staleness import StalenessControl
from tests.test_producer import Episodes

from .redis_server import REDIS_SKIP, RedisServer

if REDIS_SKIP:
    pytest.skip(REDIS_SKIP, allow_module_level=True)
pytest.importorskip("redis", reason="the redis Python package is missing (make test installs it)")

from prorl_adapter.service.storage.coordination import AdmissionFence
from prorl_adapter.service.storage.redis_buffer import RedisBuffer
from prorl_adapter.service.storage.redis_coordination import RedisCoordination
from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue

LOCK_S = 0.25  # the admission lock's life here: each stall outlasts it once


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis-admission")).start()
    yield server.url
    server.kill()


class CountedHolds(RedisCoordination):
    """The Redis coordination, counting the admission holds that ended."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.holds = 0

    @contextlib.asynccontextmanager
    async def admission_lock(self) -> AsyncIterator[AdmissionFence]:
        try:
            async with super().admission_lock() as fence:
                yield fence
        finally:
            self.holds += 1


class StallingPrompts(RedisPromptQueue):
    """The Redis prompt queue, whose `at`-th read of the running counts (`where="counts"`: the counts are read,
    then it stalls, then they are returned) or `at`-th pop (`where="pop"`: it stalls before popping) waits until
    `resume` is set."""

    def __init__(self, *args, where: str | None = None, at: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.where, self.at = where, at
        self.calls = {"counts": 0, "pop": 0}
        self.stalled, self.resume = asyncio.Event(), asyncio.Event()

    async def _maybe_stall(self, where: str) -> None:
        self.calls[where] += 1
        if where == self.where and self.calls[where] == self.at + 1:
            self.stalled.set()
            await self.resume.wait()

    async def running_versions(self) -> dict[int, int]:
        counts = await super().running_versions()
        await self._maybe_stall("counts")
        return counts

    async def pop(self, version: int, fence: AdmissionFence | None = None) -> JobRequest | None:
        await self._maybe_stall("pop")
        return await super().pop(version, fence)


async def until(condition) -> None:
    async with asyncio.timeout(30):  # a bound on waiting, not a measurement
        while not condition():
            await asyncio.sleep(0.005)


@settings(max_examples=15, deadline=None)
@given(
    limit=st.sampled_from(["pace", "max_buffered"]),
    k=st.integers(0, 2),
    batch=st.integers(1, 2),
    max_buffered=st.integers(1, 6),
    extra=st.integers(0, 3),  # prompts beyond the bound
    where=st.sampled_from(["counts", "pop"]),
    at=st.integers(0, 5),
    others=st.integers(1, 2),
)
async def test_replicas_never_admit_beyond_the_bound_when_one_stalls_past_the_admission_locks_expiry(
    redis_url, limit, k, batch, max_buffered, extra, where, at, others
):
    bound = (k + 1) * batch if limit == "pace" else max_buffered
    upcoming = bound + extra
    at = at % bound  # the stalled replica admits `at` prompts first: room is left, and prompts
    staleness = {"mode": "pace", "max_staleness": k, "batch_size": batch} if limit == "pace" else {"mode": "off"}
    config = ProducerConfig(max_buffered=max_buffered if limit == "max_buffered" else 10_000)
    prefix = f"fence:{uuid.uuid4().hex[:12]}"
    producers: list[Producer] = []

    def replica(name: str, **stall) -> Producer:
        coordination = CountedHolds(redis_url, name, prefix=prefix, admission_lock_s=LOCK_S)
        plugins = PluginSet.load(objects=[StalenessControl(staleness)], entry_points=False)
        episodes = Episodes(plugins, workers=ADMIT_PER_LOCK, coordination=coordination)
        buffer = RedisBuffer(redis_url, consumer=name, prefix=f"{prefix}:buffer")
        prompts = StallingPrompts(redis_url, name, prefix=f"{prefix}:prompts", **stall)
        producer = Producer(episodes, buffer, prompts, config, coordination)
        plugins.register(producer, name="decoupled-producer")
        producers.append(producer)
        return producer

    async def start(producer: Producer) -> None:
        await producer.coordination.start()
        producer.start()

    stalled = replica("stalled", where=where, at=at)
    prompts: StallingPrompts = stalled.prompts  # type: ignore[assignment]
    try:
        await prompts.push([JobRequest(task="t", job_id=f"p{i}") for i in range(upcoming)])
        await start(stalled)
        await until(prompts.stalled.is_set)  # in its hold, `at` prompts admitted, on its way to one more
        holds = stalled.coordination.holds
        rest = [replica(f"other{i}") for i in range(others)]
        for producer in rest:
            await start(producer)
        await until(lambda: all(p.coordination.holds for p in rest))  # each took the lock (the stalled one's expired)
        prompts.resume.set()
        await until(lambda: stalled.coordination.holds > holds)  # the stalled hold ended
        assert sum((await prompts.running_versions()).values()) <= bound
        assert stalled.stats.admission_lock_lapses >= 1
    finally:
        for producer in producers:
            await producer.stop()
    # Nothing stalls any more: every prompt the bound allows was admitted, once, and no more.
    assert sum((await prompts.running_versions()).values()) == bound
    assert sum(len(p.runner.running()) for p in producers) == bound  # type: ignore[attr-defined]
    assert await prompts.size() == upcoming - bound
    for producer in producers:
        for part in (producer.buffer, producer.prompts, producer.coordination):
            await part.close()
