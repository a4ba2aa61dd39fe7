"""The replicas' shared state on a real Redis: a dead replica is handed to exactly one survivor, the policy version
is one for all and reaches every replica, admission is one replica at a time, jobs and prompts of a dead replica
come back, and the runtimes heard by one replica are seen by all. What one replica alone sees (of the coordination
and the prompt queue) is the contract suites', run over Redis and memory: tests/storage/."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from prorl_adapter.hooks.plugin_set import PluginSet
from prorl_adapter.models import JobRequest
from prorl_adapter.service import decoupled
from prorl_adapter.service.decoupled import Producer
from prorl_adapter.service.storage.coordination import (
    ALONE_MISSED_BEATS,
    MISSED_BEATS,
    AdmissionLapsed,
    BarrierNews,
    BeatReply,
)
from prorl_adapter.service.storage.memory_buffer import MemoryBuffer
from prorl_adapter.service.storage.prompts import MemoryPromptQueue
from prorl_adapter.service.storage.redis_buffer import RedisBuffer
from prorl_adapter.service.storage.redis_coordination import RedisCoordination
from prorl_adapter.service.storage.redis_prompts import RedisPromptQueue
from sandbox_runtime.models import RuntimeHeartbeat
from tests.test_producer import Episodes

from .redis_server import REDIS_SKIP, RedisServer

pytestmark = pytest.mark.skipif(bool(REDIS_SKIP), reason=REDIS_SKIP or "")


@pytest.fixture
def redis(tmp_path):
    server = RedisServer(tmp_path).start()
    yield server
    server.kill()


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


async def replicas(url: str, *ids: str) -> list[RedisCoordination]:
    started = [RedisCoordination(url, i, prefix="t") for i in ids]
    for replica in started:
        await replica.start()
    return started


async def lapse(observer: RedisCoordination, replica_id: str, silent_s: float) -> None:
    """Until Redis's clock says `replica_id` has been silent for `silent_s`."""
    while True:
        now, records = await observer.replicas()
        if now - next(r for r in records if r.id == replica_id).seen_at > silent_s:
            return


async def test_a_dead_replica_is_handed_to_exactly_one_survivor(redis):
    dead, a, b = await replicas(redis.url, "dead", "a", "b")
    try:
        await a.beat("http://a", {}, interval_s=10)
        await b.beat("http://b", {}, interval_s=10)
        # Its last beat tells it of the two others: they may take it over after its three missed beats.
        assert await dead.beat("http://dead", {}, interval_s=0.05) == BeatReply(taken=False, others_alive=2)
        assert await a.claim_dead(hold_s=60) == [] and await b.claim_dead(hold_s=60) == []  # all alive
        await lapse(a, "dead", 0.15)  # its three intervals of 0.05 s
        claims = await asyncio.gather(a.claim_dead(hold_s=60), b.claim_dead(hold_s=60))
        assert sorted(claims, key=len) == [[], ["dead"]]
        # The takeover is under way: however long the dead one has been silent, nobody claims it again.
        await lapse(a, "dead", 0.5)
        assert await a.claim_dead(hold_s=60) == [] and await b.claim_dead(hold_s=60) == []
        _, records = await a.replicas()
        assert {r.id for r in records} == {"dead", "a", "b"}  # until the survivor forgets it
        await a.forget_replica("dead")
        _, records = await b.replicas()
        assert {r.id for r in records} == {"a", "b"}
    finally:
        for replica in (dead, a, b):
            await replica.close()


async def test_a_claim_given_up_or_run_out_hands_the_dead_replica_out_again(redis):
    """A takeover that failed releases its claim (only its own: another's release changes nothing), and one
    that never ends loses it once the hold passes: either way a survivor claims the dead replica again."""
    dead, a, b = await replicas(redis.url, "dead", "a", "b")
    try:
        await a.beat("http://a", {}, interval_s=10)
        await b.beat("http://b", {}, interval_s=10)
        await dead.beat("http://dead", {}, interval_s=0.05)
        await lapse(a, "dead", 0.15)
        first = await a.claim_dead(hold_s=60) or await b.claim_dead(hold_s=60)
        assert first == ["dead"]
        holder, other = (a, b) if await _holds(a) else (b, a)
        await other.release_claim("dead")  # not its claim
        assert await other.claim_dead(hold_s=60) == []
        await holder.release_claim("dead")
        assert await other.claim_dead(hold_s=0.2) == ["dead"]  # a short hold this time...
        assert await holder.claim_dead(hold_s=60) == []
        while await holder.claim_dead(hold_s=60) == []:  # ...which runs out (Redis's clock) with no takeover done
            await asyncio.sleep(0.02)
    finally:
        for replica in (dead, a, b):
            await replica.close()


async def test_a_replica_that_was_told_of_no_other_is_taken_over_only_after_the_missed_beats_of_one_alone(redis):
    """A replica whose last beat found nobody else alive fences itself only after ALONE_MISSED_BEATS (replica.py):
    a replica started since may take it over only then, not after the usual three missed beats."""
    alone, newcomer = await replicas(redis.url, "alone", "newcomer")
    try:
        assert await alone.beat("http://alone", {}, interval_s=0.01) == BeatReply(taken=False, others_alive=0)
        await newcomer.beat("http://newcomer", {}, interval_s=10)  # started after the other's last beat
        await lapse(newcomer, "alone", MISSED_BEATS * 0.01)
        await newcomer.beat("http://newcomer", {}, interval_s=10)
        assert await newcomer.claim_dead(hold_s=60) == []
        await lapse(newcomer, "alone", ALONE_MISSED_BEATS * 0.01)
        assert await newcomer.claim_dead(hold_s=60) == ["alone"]
    finally:
        await alone.close()
        await newcomer.close()


async def _holds(replica: RedisCoordination) -> bool:
    """Whether `replica` holds the claim on "dead" (read from the shared record)."""
    raw = await replica.redis.hget("t:replicas", "dead")
    return raw is not None and json.loads(raw).get("taken_by") == replica.replica_id


async def test_the_policy_version_is_shared_and_every_replica_hears_of_a_change(redis):
    a, b = await replicas(redis.url, "a", "b")
    heard: list[int] = []
    b.on_policy_version(heard.append)
    try:
        assert await a.set_policy_version(4, raise_only=False) == 4
        await until(lambda: 4 in heard)
        assert await b.policy_version() == 4
        assert await b.set_policy_version(2, raise_only=True) == 4  # raise only, at another replica: kept
        assert await b.set_policy_version(1, raise_only=False) == 1
        assert await a.policy_version() == 1
    finally:
        await a.close()
        await b.close()


async def test_admission_is_one_replica_at_a_time(redis):
    a, b = await replicas(redis.url, "a", "b")
    inside: list[str] = []
    overlap = False

    async def admit(replica: RedisCoordination) -> None:
        nonlocal overlap
        for _ in range(20):
            async with replica.admission_lock():
                overlap = overlap or bool(inside)
                inside.append(replica.replica_id)
                await asyncio.sleep(0)  # let the other one try to enter
                inside.pop()

    try:
        await asyncio.gather(admit(a), admit(b))
        assert not overlap
    finally:
        await a.close()
        await b.close()


async def test_a_replica_cancelled_at_any_point_leaves_the_admission_lock_free_and_closes(redis):
    """A cancellation that lands anywhere in taking the lock (redis-py can swallow it on Python 3.11, see
    `keeping_cancellation`) ends the task and leaves the lock free for the other replica, and closing a
    replica right after it started (its listener subscribing) ends too."""
    a, b = await replicas(redis.url, "a", "b")
    try:

        async def admit_forever() -> None:
            while True:
                async with a.admission_lock():
                    await asyncio.sleep(0)

        for steps in range(40):
            task = asyncio.create_task(admit_forever())
            for _ in range(steps):
                await asyncio.sleep(0)  # one step of the event loop: where the cancellation lands
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=10)
            assert done and task.cancelled(), f"cancelled after {steps} loop steps, the task still runs"
            async with asyncio.timeout(1):  # far below the lock's own expiry (ADMISSION_LOCK_S)
                async with b.admission_lock():
                    pass
        for steps in range(0, 40, 4):
            replica = RedisCoordination(redis.url, f"short-{steps}", prefix="t")
            starting = asyncio.create_task(replica.start())
            for _ in range(steps):
                await asyncio.sleep(0)
            async with asyncio.timeout(10):
                await replica.close()
                await asyncio.gather(starting, return_exceptions=True)
    finally:
        await a.close()
        await b.close()


async def test_a_pop_under_a_lapsed_admission_lock_moves_nothing_and_one_under_the_held_lock_renews_it(redis):
    a, b = (RedisCoordination(redis.url, name, prefix="tf", admission_lock_s=60) for name in ("a", "b"))
    prompts = RedisPromptQueue(redis.url, "a", prefix="tf:prompts")
    try:
        await prompts.push([JobRequest(task="t", job_id=f"p{i}") for i in range(2)])
        async with a.admission_lock() as fence:
            await a.redis.pexpire(fence.key, 1000)
            assert (await prompts.pop(1, fence)).job_id == "p0"
            assert await a.redis.pttl(fence.key) > 1000  # renewed for the lock's whole life (60 s)
            await a.redis.delete(fence.key)  # it expired: its holder stalled
            with pytest.raises(AdmissionLapsed):
                await prompts.pop(1, fence)
            async with b.admission_lock() as taken:  # and another replica takes it
                with pytest.raises(AdmissionLapsed):
                    await prompts.pop(1, fence)
                assert (await prompts.size(), await prompts.running_versions()) == (1, {1: 1})  # nothing moved
                assert (await prompts.pop(2, taken)).job_id == "p1"
            assert not await a.redis.exists(fence.key)  # b let go; a's hold ends without touching the lock
    finally:
        for part in (a, b, prompts):
            await part.close()


async def test_a_producer_refuses_a_prompt_queue_that_cannot_check_its_admission_lock(redis):
    """The fence is checked inside the pop: the queue must be on the coordination's Redis server and database."""
    coordination = RedisCoordination(redis.url, "a", prefix="tg")
    other_db = RedisPromptQueue(redis.url.rsplit("/", 1)[0] + "/1", "a", prefix="tg")
    same = RedisPromptQueue(f"redis://127.0.0.1:{redis.port}", "a", prefix="tg")  # db 0 by default: the same
    episodes = Episodes(PluginSet.load(entry_points=False), coordination=coordination)
    try:
        for prompts in (other_db, MemoryPromptQueue()):
            with pytest.raises(ValueError, match="one Redis"):
                Producer(episodes, MemoryBuffer(), prompts, coordination=coordination)
        Producer(episodes, MemoryBuffer(), same, coordination=coordination)
    finally:
        for part in (coordination, other_db, same):
            await part.close()


async def test_runtimes_heard_by_one_replica_are_seen_by_all(redis):
    a, b = await replicas(redis.url, "a", "b")
    beat = RuntimeHeartbeat(url="http://n1:8765", capacity=8, sandboxes=2, backend="bwrap", version="v", interval_s=2)
    try:
        await a.runtime_heard("n1", beat)
        now, [record] = await b.runtimes()
        assert record.name == "n1" and record.heartbeat == beat and record.alive(now)
        await a.runtime_heard("n1", beat.model_copy(update={"leaving": True}))
        assert (await b.runtimes())[1] == []
    finally:
        await a.close()
        await b.close()


async def test_a_dead_replicas_prompts_are_run_by_the_one_that_takes_over(redis):
    dead = RedisPromptQueue(redis.url, "dead", prefix="tp")
    survivor = RedisPromptQueue(redis.url, "survivor", prefix="tp")
    try:
        await dead.push([JobRequest(task="t", job_id=f"p{i}") for i in range(3)])
        assert (await dead.pop(1)).job_id == "p0"
        assert (await survivor.pop(2)).job_id == "p1"
        assert await survivor.running_versions() == {1: 1, 2: 1}  # every replica's, by version
        assert await survivor.recover() == [JobRequest(task="t", job_id="p1")]  # its own only
        taken = await survivor.take_over("dead")
        assert [r.job_id for r in taken] == ["p0"]
        assert await dead.take_over("dead") == []  # now the survivor's
        await survivor.done("p0")
        assert await survivor.running_versions() == {2: 1}
    finally:
        await dead.close()
        await survivor.close()


async def test_a_replica_taken_for_dead_learns_it_from_its_next_beat_and_a_cut_off_one_claims_nobody(redis):
    slow, survivor = await replicas(redis.url, "slow", "survivor")
    try:
        assert (await survivor.beat("http://survivor", {}, interval_s=0.05)).taken is False
        assert (await slow.beat("http://slow", {}, interval_s=0.05)).taken is False
        await lapse(survivor, "slow", 0.3)  # twice the slow one's three intervals
        # The survivor was silent as long: back from a gap of its own, it judges nobody on this beat...
        await survivor.beat("http://survivor", {}, interval_s=0.05)
        assert await survivor.claim_dead(hold_s=60) == []
        # ...and on the next one, beating in time again, it does.
        await survivor.beat("http://survivor", {}, interval_s=10)
        assert await survivor.claim_dead(hold_s=60) == ["slow"]
        assert (
            await slow.beat("http://slow", {}, interval_s=0.05)
        ).taken is True  # taken over: its work is not its own
        assert (await slow.beat("http://slow", {}, interval_s=0.05)).taken is False
        await survivor.forget_replica("slow")  # the slow one beat since: its record is its own, and stays
        assert {r.id for r in (await survivor.replicas())[1]} == {"slow", "survivor"}
    finally:
        await slow.close()
        await survivor.close()


async def test_only_the_replica_running_a_prompt_ends_its_run(redis):
    first = RedisPromptQueue(redis.url, "first", prefix="tq")
    other = RedisPromptQueue(redis.url, "other", prefix="tq")
    try:
        await first.push([JobRequest(task="t", job_id="p")])
        await first.pop(1)
        await other.done("p")  # not its run: nothing changes
        assert await first.running_versions() == {1: 1}
        await first.done("p")
        assert await first.running_versions() == {}
    finally:
        await first.close()
        await other.close()


async def test_prompts_added_through_one_replica_are_admitted_by_the_others_at_once(redis, monkeypatch):
    """Replicas share the upcoming prompts. One that is not told finds what another added only at its next look
    (SHARED_WAKE_S, an hour here), by when the other may have taken all it can run; told through the channel, it
    admits alongside it."""
    monkeypatch.setattr(decoupled, "SHARED_WAKE_S", 3600.0)
    replicas, episodes = [], []

    async def replica(name: str) -> Producer:
        coordination = RedisCoordination(redis.url, name, prefix="tw")
        await coordination.start()
        plugins = PluginSet.load(entry_points=False)
        episodes.append(Episodes(plugins, workers=4, coordination=coordination))
        buffer, prompts = RedisBuffer(redis.url, prefix="tw:buffer"), RedisPromptQueue(redis.url, name, prefix="tw")
        producer = Producer(episodes[-1], buffer, prompts, coordination=coordination)
        plugins.register(producer, name="decoupled-producer")
        producer.start()
        replicas.append(producer)
        return producer

    try:
        b = await replica("b")
        await b.enqueue([JobRequest(task="t", job_id="b0")])  # b, alone, has looked, admitted it, and waits
        await until(lambda: len(episodes[0].running()) == 1)
        a = await replica("a")
        await a.enqueue([JobRequest(task="t", job_id=f"a{i}") for i in range(8)])
        await until(lambda: [len(e.running()) for e in episodes] == [4, 4])  # each what its 4 workers run
        assert await a.prompts.size() == 1
    finally:
        for producer in replicas:
            await producer.stop()
            await producer.buffer.close()
            await producer.prompts.close()
            await producer.coordination.close()


async def test_a_weight_update_barrier_reaches_the_other_replicas_and_one_that_starts_while_it_holds(redis):
    a, b = await replicas(redis.url, "a", "b")
    heard: dict[str, list[BarrierNews]] = {"a": [], "b": [], "late": []}
    a.on_barrier(heard["a"].append)
    b.on_barrier(heard["b"].append)
    late = RedisCoordination(redis.url, "late", prefix="t")
    try:
        await a.barrier_announce(BarrierNews("pause", "b1", "abort", 60.0))
        await until(lambda: heard["b"])
        # (b may hear it twice: its subscription's first read of the barrier held now can race the message)
        assert {(n.kind, n.barrier, n.mode, n.replica) for n in heard["b"]} == {("pause", "b1", "abort", "a")}
        late.on_barrier(heard["late"].append)
        await late.start()  # subscribes, then reads the barrier held now
        await until(lambda: heard["late"])
        assert heard["late"][0].barrier == "b1" and 0 < heard["late"][0].expires_in_s <= 60
        held_now: list[BarrierNews] = []
        probe = RedisCoordination(redis.url, "probe", prefix="t")
        probe.on_barrier(held_now.append)
        await b.barrier_announce(BarrierNews("resume", "other", "abort", 0.0))  # not the barrier held: it stays
        await probe.barrier_held_now()
        assert [(n.kind, n.barrier) for n in held_now] == [("pause", "b1")]
        await a.barrier_announce(BarrierNews("resume", "b1", "abort", 0.0))
        await until(lambda: ("resume", "b1") in [(n.kind, n.barrier) for n in heard["b"]])
        held_now.clear()
        await probe.barrier_held_now()
        await probe.close()
        assert held_now == []  # ended: nothing held any more
        assert all(news.replica != "a" for news in heard["a"])  # a replica acts on its own news where it makes it
    finally:
        for replica in (a, b, late):
            await replica.close()


async def test_the_pausing_replica_waits_for_every_live_replica_to_drain(redis):
    a, b, c = await replicas(redis.url, "a", "b", "c")
    try:
        for replica in (a, b, c):
            await replica.beat(None, {}, interval_s=30)
        waiting = asyncio.ensure_future(a.barrier_wait_drained("b2", 20))
        await b.barrier_report_drained("b2")
        with pytest.raises(TimeoutError):  # c has not drained: a keeps waiting
            await asyncio.wait_for(asyncio.shield(waiting), 1.0)
        await c.barrier_report_drained("b2")
        assert await waiting is True
        assert await a.barrier_wait_drained("b3", 0.5) is False  # nobody reported this one
    finally:
        for replica in (a, b, c):
            await replica.close()
