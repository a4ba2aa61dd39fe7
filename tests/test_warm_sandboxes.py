"""Warm sandboxes (`--warm-sandboxes`) and throttled creation (`--max-concurrent-creates`), against the real
sandbox runtime in process (bubblewrap where installed, else the `local` backend).

Nothing here waits by sleeping: a test waits for a condition on the pool's own bookkeeping or on what the runtime
lists; the pace of refills is checked on the times the pool recorded, not on how long the test took.
"""

from __future__ import annotations

import asyncio
import itertools
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from prorl_adapter.models import ServiceStatus
from prorl_adapter.service.config import RolloutConfig
from prorl_adapter.service.metrics import RolloutMetrics
from prorl_adapter.service.pipeline import PipelineConfig
from prorl_adapter.service.sandboxes import OWNER_LABEL, RuntimeFailed, SandboxPool
from prorl_adapter.service.server import SANDBOXES, create_app
from prorl_adapter.service.warm_sandboxes import (
    WARM_LABEL,
    CreateGate,
    WarmConfig,
    spec_digest,
    spec_key,
)
from prorl_adapter.trainer.client import RolloutClient
from sandbox_runtime.client import SandboxAPIError, SandboxClient
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.server import create_app as create_runtime_app
from tests.fakes import CharChat, ScriptedLLM, bash_call, finish_call, shell_job

BACKEND = "bwrap" if shutil.which("bwrap") else "local"
SPEC = {"limits": {"memory_mb": 512, "pids": 64}, "env": {"KIND": "a"}}
TTL = 300.0


def ask(spec: dict | None = None, ttl: float = TTL, job: str = "j") -> dict:
    """What the pipeline hands `acquire`: the task's spec, the episode's labels and its TTL."""
    return {**(spec or SPEC), "labels": {"job_id": job, "task": "t"}, "ttl_s": ttl}


@pytest.fixture
async def runtime() -> AsyncIterator[tuple[str, SandboxClient]]:
    """The runtime's URL and a client of its own. Its state dir lies outside pytest's private temporary
    directories: a root server's sandbox uids must reach it."""
    base = Path(tempfile.mkdtemp(prefix="prorl-test-warm-"))
    base.chmod(0o711)
    config = ServerConfig(state_dir=base / "state", backend=BACKEND, allow_local=BACKEND == "local")
    try:
        async with TestServer(create_runtime_app(config)) as server:
            url = str(server.make_url("")).rstrip("/")
            async with SandboxClient(url) as client:
                yield url, client
    finally:
        shutil.rmtree(base, ignore_errors=True)


async def until(condition: Callable[[], object], what: str, timeout: float = 60.0) -> None:
    """Wait for `condition` to hold (looked at between the event loop's other work)."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)
    assert condition(), what


async def listed(client: SandboxClient) -> set[str]:
    return {box.id for box in await client.list_sandboxes()}


async def until_listed(client: SandboxClient, expected: Callable[[set[str]], bool], timeout: float = 60.0) -> set[str]:
    async with asyncio.timeout(timeout):
        while not expected(ids := await listed(client)):
            await asyncio.sleep(0.02)
    return ids


def warm_pool(url: str, **warm) -> SandboxPool:
    config = WarmConfig(**{"size": 2, "refill_per_s": 50.0, **warm})
    return SandboxPool([url], owner="r-test", warm=config, wait_for_runtime_s=0.0)


def state(pool: SandboxPool, spec: dict | None = None):
    return pool.warm.specs[spec_key(ask(spec))]


# -- off by default ---------------------------------------------------------------------------------------------
async def test_off_by_default_nothing_is_created_ahead(runtime):
    url, client = runtime
    assert RolloutConfig([], [], "t").warm.size == 0 and RolloutConfig([], [], "t").max_concurrent_creates == 0
    pool = SandboxPool([url], owner="r-test")
    try:
        assert pool.warm is None and pool.describe_warm() == {}
        env = await pool.acquire(ask(), exclude=set())
        assert await listed(client) == {env.sandbox_id}  # the episode's own, and nothing ahead
        info = await client.get_sandbox(env.sandbox_id)
        assert info.labels == {"job_id": "j", "task": "t", OWNER_LABEL: "r-test"} and info.ttl_s == TTL
        await pool.release(env)
        assert await listed(client) == set()
        assert pool.runtimes[url].gate.limit is None
    finally:
        await pool.close()


# -- hits, refills ------------------------------------------------------------------------------------------------
async def test_the_first_ask_misses_then_the_pool_fills_to_size_and_serves_hits(runtime):
    url, client = runtime
    pool = warm_pool(url, size=2)
    try:
        first = await pool.acquire(ask(), exclude=set())
        warm = state(pool)
        assert (warm.hits, warm.misses) == (0, 1)
        await until(lambda: len(warm.ready) == 2 and warm.creating == 0, "two warm sandboxes")
        assert warm.created == 2
        ids = await listed(client)
        assert len(ids) == 3 and first.sandbox_id in ids  # never more than `size` ahead
        ready = {box.sandbox_id for box in warm.ready}
        second = await pool.acquire(ask(job="k"), exclude=set())
        assert second.sandbox_id in ready and (warm.hits, warm.misses) == (1, 1)
        info = await client.get_sandbox(second.sandbox_id)
        assert info.labels == {OWNER_LABEL: "r-test", WARM_LABEL: spec_digest(warm.key)}
        assert info.ttl_s == pool.warm.config.max_age_s + TTL  # the oldest allowed age and the episode's TTL
        await until(lambda: len(warm.ready) == 2 and warm.creating == 0, "topped up again")
        assert warm.created == 3 and len(await listed(client)) == 4
        described = pool.describe_warm()[spec_digest(warm.key)]
        assert (described.size, described.ready, described.hits, described.misses) == (2, 2, 1, 1)
        assert described.refill_per_s == 50.0
        status = ServiceStatus(
            policy_version=0,
            queues={},
            active={},
            finished={},
            episodes_per_s_last_60s=0.0,
            workers={},
            llm_servers=[],
            degraded=None,
            warm_sandboxes=pool.describe_warm(),
        )
        assert status.model_dump()["warm_sandboxes"][spec_digest(warm.key)]["hits"] == 1
        await pool.release(first)
        await pool.release(second)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_refills_start_no_faster_than_refill_per_s(runtime):
    url, client = runtime
    pool = warm_pool(url, size=4, refill_per_s=8.0)
    try:
        env = await pool.acquire(ask(), exclude=set())
        warm = state(pool)
        await until(lambda: len(warm.ready) == 4, "four warm sandboxes")
        starts = list(pool.warm.refill_starts)
        assert len(starts) == 4 == warm.created
        assert all(later - earlier >= 1 / 8.0 - 1e-9 for earlier, later in itertools.pairwise(starts)), starts
        await pool.release(env)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_a_warm_sandbox_is_handed_out_once_and_fresh(runtime):
    url, client = runtime
    pool = warm_pool(url, size=1)
    try:
        own = await pool.acquire(ask(), exclude=set())  # a miss: the episode's own
        warm = state(pool)
        seen = {own.sandbox_id}
        previous = own
        for episode in range(3):
            await until(lambda: len(warm.ready) == 1, "a warm sandbox")
            env = await pool.acquire(ask(job=f"e{episode}"), exclude=set())
            assert env.sandbox_id not in seen  # never a second episode's
            seen.add(env.sandbox_id)
            with pytest.raises(SandboxAPIError):  # what the episode before wrote is not there
                await env.read_file(f"{env.workdir}/left-behind.txt")
            await env.write_file(f"{env.workdir}/left-behind.txt", "from an earlier episode")
            await pool.release(previous)
            assert previous.sandbox_id not in await listed(client)  # release deletes it, warm or not
            previous = env
        assert warm.hits == 3 and warm.misses == 1
        await pool.release(previous)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_an_old_warm_sandbox_or_one_with_too_short_a_ttl_is_deleted_not_handed_out(runtime):
    url, client = runtime
    pool = warm_pool(url, size=1, max_age_s=60.0)
    try:
        own = await pool.acquire(ask(), exclude=set())
        warm = state(pool)
        await until(lambda: len(warm.ready) == 1, "a warm sandbox")
        old = warm.ready[0]
        old.started -= 61.0  # as if created 61 s ago
        env = await pool.acquire(ask(job="k"), exclude=set())
        assert env.sandbox_id != old.sandbox_id and warm.misses == 2 and warm.expired == 1
        await until_listed(client, lambda ids: old.sandbox_id not in ids)
        await pool.release(env)
        # A longer budget than any before: the warm one's TTL (60 + 300 s) would not cover its 400 s.
        await until(lambda: len(warm.ready) == 1, "a warm sandbox again")
        short = warm.ready[0]
        env = await pool.acquire(ask(ttl=400.0, job="long"), exclude=set())
        assert env.sandbox_id != short.sandbox_id and warm.expired == 2
        assert (await client.get_sandbox(env.sandbox_id)).ttl_s == 400.0
        await until_listed(client, lambda ids: short.sandbox_id not in ids)
        await until(lambda: len(warm.ready) == 1 and warm.creating == 0, "refilled with the longer TTL")
        assert (await client.get_sandbox(warm.ready[0].sandbox_id)).ttl_s == 60.0 + 400.0
        hit = await pool.acquire(ask(ttl=400.0, job="long2"), exclude=set())
        assert warm.hits == 1
        for held in (own, env, hit):
            await pool.release(held)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_an_excluded_or_dead_runtime_is_not_served_from(runtime):
    url, client = runtime
    pool = warm_pool(url, size=1)
    try:
        own = await pool.acquire(ask(), exclude=set())
        warm = state(pool)
        await until(lambda: len(warm.ready) == 1, "a warm sandbox")
        box = warm.ready[0]
        assert pool.warm.take(ask(), exclude={url}) is None  # excluded: kept for another episode
        assert list(warm.ready) == [box] and warm.misses == 2
        pool.runtimes[url].alive = False  # its heartbeats stopped
        assert pool.warm.take(ask(), exclude=set()) is None
        assert not warm.ready and warm.expired == 1
        await until_listed(client, lambda ids: box.sandbox_id not in ids)
        pool.runtimes[url].alive = True
        await pool.release(own)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_close_deletes_every_warm_sandbox_even_those_being_created(runtime):
    url, client = runtime
    pool = warm_pool(url, size=3)
    server = pool.runtimes[url]
    create, held, release = server.client.create_sandbox, [], asyncio.Event()

    async def slow_after_the_first(**spec):
        info = await create(**spec)
        if WARM_LABEL in spec["labels"]:
            held.append(info.id)
            if len(held) > 1:
                await release.wait()  # created, but its answer is still on its way when the pool closes
        return info

    server.client.create_sandbox = slow_after_the_first  # type: ignore[method-assign]
    env = await pool.acquire(ask(), exclude=set())
    warm = state(pool)
    await until(lambda: len(warm.ready) == 1 and len(held) == 3, "one warm sandbox, two being created")
    await pool.release(env)
    closing = asyncio.ensure_future(pool.close())
    await until(lambda: pool.warm._closed, "closing")
    release.set()
    await closing
    assert await listed(client) == set()


async def test_the_least_recently_asked_spec_is_dropped_with_its_warm_sandboxes(runtime):
    url, client = runtime
    other = {**SPEC, "env": {"KIND": "b"}}
    pool = warm_pool(url, size=1, max_specs=1)
    try:
        first = await pool.acquire(ask(), exclude=set())
        warm = state(pool)
        await until(lambda: len(warm.ready) == 1, "a warm sandbox of the first spec")
        dropped = warm.ready[0].sandbox_id
        second = await pool.acquire(ask(other), exclude=set())
        assert list(pool.warm.specs) == [spec_key(ask(other))]
        await until_listed(client, lambda ids: dropped not in ids)
        kept = state(pool, other)
        await until(lambda: len(kept.ready) == 1, "a warm sandbox of the second spec")
        assert await listed(client) == {first.sandbox_id, second.sandbox_id, kept.ready[0].sandbox_id}
        await pool.release(first)
        await pool.release(second)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_a_spec_the_runtime_refuses_pauses_its_refills_until_asked_again(runtime):
    url, client = runtime
    pool = warm_pool(url, size=1)  # one refill at a time: the first one's failure is seen before another starts
    bad = {"image": "no-such-image.sif"}
    try:
        with pytest.raises(RuntimeFailed, match="no-such-image"):
            await pool.acquire(ask(bad), exclude=set())
        warm = state(pool, bad)
        await until(lambda: warm.paused and warm.creating == 0, "refills paused")
        assert warm.failures == 1 and warm.created == 0 and len(pool.warm.refill_starts) == 1
    finally:
        await pool.close()
    assert await listed(client) == set()


# -- throttled creation -------------------------------------------------------------------------------------------
async def test_the_runtimes_state_shows_the_creations_in_flight_and_those_the_limit_holds_back(runtime):
    url, client = runtime
    pool = SandboxPool([url], owner="r-test", max_concurrent_creates=1, wait_for_runtime_s=0.0)
    gate = pool.runtimes[url].gate
    try:
        (idle,) = pool.describe()
        assert (idle.creating, idle.creations_waiting, idle.max_concurrent_creates) == (0, 0, 1)
        await gate.enter(urgent=True)  # a creation in flight, held for as long as the test needs
        episode = asyncio.ensure_future(pool.acquire(ask(), exclude=set()))
        await until(lambda: gate.waiting(True) == 1, "the episode's creation waits at the limit")
        (held,) = pool.describe()
        assert (held.creating, held.creations_waiting) == (1, 1)
        gate.leave()
        env = await episode
        (done,) = pool.describe()
        assert (done.creating, done.creations_waiting) == (0, 0)
        await pool.release(env)
    finally:
        await pool.close()
    assert await listed(client) == set()


async def test_the_gate_lets_an_episode_go_before_any_waiting_refill():
    gate = CreateGate(limit=1)
    order: list[str] = []
    await gate.enter(urgent=True)

    async def creation(name: str, urgent: bool) -> None:
        await gate.enter(urgent)
        order.append(name)
        gate.leave()

    refill = asyncio.ensure_future(creation("refill", urgent=False))
    await until(lambda: gate.waiting(False) == 1, "the refill waits")
    episode = asyncio.ensure_future(creation("episode", urgent=True))
    await until(lambda: gate.waiting(True) == 1, "the episode waits")
    cancelled = asyncio.ensure_future(gate.enter(urgent=True))
    await until(lambda: gate.waiting(True) == 2, "another episode waits")
    cancelled.cancel()
    gate.leave()
    await asyncio.gather(refill, episode)
    assert order == ["episode", "refill"] and gate.in_flight == 0
    assert await asyncio.gather(cancelled, return_exceptions=True) != [None]


async def test_at_most_max_concurrent_creates_are_in_flight_on_a_runtime(runtime):
    url, client = runtime
    pool = SandboxPool([url], owner="r-test", max_concurrent_creates=2, wait_for_runtime_s=0.0)
    server = pool.runtimes[url]
    create, in_flight, most = server.client.create_sandbox, [0], [0]

    async def counted(**spec):
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        try:
            return await create(**spec)
        finally:
            in_flight[0] -= 1

    server.client.create_sandbox = counted  # type: ignore[method-assign]
    try:
        envs = await asyncio.gather(*(pool.acquire(ask(job=f"j{n}"), exclude=set()) for n in range(5)))
        assert most[0] == 2 and len({env.sandbox_id for env in envs}) == 5 and server.gate.in_flight == 0
        for env in envs:
            await pool.release(env)
    finally:
        await pool.close()
    assert await listed(client) == set()


# -- configuration, metrics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("warm", "creates", "words"),
    [
        (WarmConfig(size=-1), 0, "--warm-sandboxes"),
        (WarmConfig(size=2, refill_per_s=0), 0, "--warm-refill-per-s"),
        (WarmConfig(size=2, max_specs=0), 0, "--warm-max-specs"),
        (WarmConfig(size=2, max_age_s=0), 0, "--warm-max-age-s"),
        (WarmConfig(), -1, "--max-concurrent-creates"),
    ],
)
def test_bad_settings_are_refused_naming_the_flag(warm, creates, words):
    config = RolloutConfig(["http://s"], [], "t", warm=warm, max_concurrent_creates=creates)
    with pytest.raises(ValueError, match=words):
        config.check()


def test_the_cli_refuses_a_bad_warm_setting(capsys):
    from prorl_adapter.service.cli import main

    argv = ["serve", "--sandbox-url", "http://s", "--tokenizer", "t", "--warm-sandboxes", "2", "--warm-refill-per-s"]
    assert main([*argv, "0"]) == 2
    assert "--warm-refill-per-s 0 must be in (0, 1000]" in capsys.readouterr().err


def test_hits_and_misses_are_counted_for_prometheus():
    metrics = RolloutMetrics()
    metrics.count_warm(hits=2, misses=1)
    metrics.count_warm(hits=5, misses=1)
    text = metrics.render().decode()
    assert 'prorl_rollout_warm_sandboxes_total{outcome="hit"} 5.0' in text
    assert 'prorl_rollout_warm_sandboxes_total{outcome="miss"} 1.0' in text


# -- through the service ------------------------------------------------------------------------------------------
async def test_the_service_serves_episodes_warm_and_shows_it_in_status_and_metrics(runtime):
    """The whole service (`create_app`, the LLM and tokenizer stand-ins) on the real runtime: the first episode
    misses, the next ones take warm sandboxes, and nothing is left on the runtime after the service stops."""
    url, client = runtime
    script = [bash_call("echo hi > /workspace/goal-reached"), finish_call("42")]
    async with ScriptedLLM(script) as llm:
        config = RolloutConfig(
            sandbox_urls=[url],
            llm_urls=[llm.url],
            tokenizer="(the CharChat stand-in)",
            pipeline=PipelineConfig(max_init_workers=2, max_run_workers=2, max_eval_workers=2),
            llm_health_interval_s=3600.0,
            service_id="warm-tests",
            warm=WarmConfig(size=1, refill_per_s=50.0),
            max_concurrent_creates=4,
        )
        app = create_app(config, chat=CharChat())  # type: ignore[arg-type]  # a stand-in for ChatTokenizer
        async with TestClient(TestServer(app)) as http:
            rollouts = RolloutClient(str(http.make_url("")).rstrip("/"))
            async with rollouts:
                pool = app[SANDBOXES]
                for _ in range(3):
                    trajectory = await rollouts.run(shell_job(), wait=60)
                    assert trajectory.reward == 1.0, trajectory
                    await until(
                        lambda: [len(w.ready) for w in pool.warm.specs.values()] == [1], "a warm one for the next"
                    )
                [warm] = pool.warm.specs.values()
                status = await (await http.get("/v1/status")).json()
                metrics = await (await http.get("/metrics")).text()
            [figures] = status["warm_sandboxes"].values()
            assert (figures["hits"], figures["misses"], figures["size"], figures["ready"]) == (2, 1, 1, 1)
            assert 'prorl_rollout_warm_sandboxes_total{outcome="hit"} 2.0' in metrics
            assert [box.labels[WARM_LABEL] for box in await client.list_sandboxes()] == [spec_digest(warm.key)]
    assert await listed(client) == set()  # the service's close deleted the warm one
