"""Scale-out in one process: where sandboxes are placed, when a runtime counts as alive, and what the registration
flags accept (the Redis side: integration_tests/test_coordination_redis.py). The coordination's and the prompt
queue's contracts, counts admission weighs included, are tested over both in tests/storage/."""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.service.sandboxes import SEVER_AFTER_S, RuntimeFailed, SandboxPool
from prorl_adapter.service.storage.coordination import MemoryCoordination, RuntimeRecord
from sandbox_runtime.client import SandboxUnreachable
from sandbox_runtime.config import ServerConfig
from sandbox_runtime.models import RuntimeHeartbeat
from tests.fakes import HANG
from tests.fakes.sandbox import SandboxStandIn


def heartbeat(url: str, capacity: int = 10, sandboxes: int = 0, leaving: bool = False) -> RuntimeHeartbeat:
    return RuntimeHeartbeat(
        url=url, capacity=capacity, sandboxes=sandboxes, backend="bwrap", version="t", interval_s=1.0, leaving=leaving
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def swept(pool: SandboxPool) -> None:
    """Refresh, and let the first look at each new runtime (for an earlier run's leftovers) end: until it has,
    no sandbox goes there. Nothing listens on these ports: the look fails fast, and counts as done."""
    await pool.refresh()
    await asyncio.gather(*pool._sweeps)
    assert all(runtime.swept for runtime in pool.runtimes.values())


def test_a_runtime_is_alive_for_three_heartbeats_and_not_once_leaving():
    record = RuntimeRecord("a", heartbeat("http://127.0.0.1:1"), seen_at=100.0)
    assert record.alive(103.0) and not record.alive(103.1)
    assert not RuntimeRecord("a", heartbeat("http://127.0.0.1:1", leaving=True), seen_at=100.0).alive(100.0)


async def test_sandboxes_go_to_the_runtime_with_the_most_free_room():
    clock = Clock()
    coordination = MemoryCoordination("r0", clock=clock)
    pool = SandboxPool([], coordination=coordination, wait_for_runtime_s=0.0)
    try:
        await coordination.runtime_heard("a", heartbeat("http://127.0.0.1:1", capacity=10, sandboxes=8))
        await coordination.runtime_heard("b", heartbeat("http://127.0.0.1:2", capacity=4, sandboxes=1))
        await swept(pool)
        chosen = await pool._choose(exclude=set())
        assert chosen.url == "http://127.0.0.1:2"  # 3 free against 2
        assert (await pool._choose(exclude={"http://127.0.0.1:2"})).url == "http://127.0.0.1:1"
        # What this replica holds there counts when the runtime's own report is older than its creations.
        pool.runtimes["http://127.0.0.1:2"].active = 4
        assert (await pool._choose(exclude=set())).url == "http://127.0.0.1:1"
        states = {s.name: s for s in pool.describe()}
        assert states["b"].placed == 4 and states["b"].capacity == 4 and states["b"].source == "registered"
    finally:
        await pool.close()


async def test_a_silent_or_leaving_runtime_gets_no_sandbox():
    clock = Clock()
    coordination = MemoryCoordination("r0", clock=clock)
    pool = SandboxPool([], coordination=coordination, wait_for_runtime_s=0.0)
    try:
        await coordination.runtime_heard("a", heartbeat("http://127.0.0.1:1"))
        clock.now += 1.0
        await coordination.runtime_heard("b", heartbeat("http://127.0.0.1:2", sandboxes=5))
        clock.now += 2.5  # a: 3.5 s without a heartbeat (three intervals of 1 s); b: 2.5 s
        await swept(pool)
        assert (await pool._choose(exclude=set())).url == "http://127.0.0.1:2"
        await coordination.runtime_heard("b", heartbeat("http://127.0.0.1:2", leaving=True))
        await pool.refresh()
        # a: silent, still listed; b: left, unused here, so forgotten
        assert [(s.url, s.alive) for s in pool.describe()] == [("http://127.0.0.1:1", False)]
        with pytest.raises(RuntimeFailed, match="no sandbox runtime is alive"):
            await pool._choose(exclude=set())
    finally:
        await pool.close()


async def test_runtimes_given_by_url_stay_usable_beside_registered_ones():
    coordination = MemoryCoordination("r0")
    pool = SandboxPool(["http://static:1/"], coordination=coordination, wait_for_runtime_s=0.0)
    try:
        await pool.refresh()
        [state] = pool.describe()
        assert state.url == "http://static:1" and state.source == "static" and state.alive
        assert state.capacity is None and state.seen_s_ago is None
    finally:
        await pool.close()


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("register", ["rollout-host:8766"], "--register"),
        ("register", ["http://host:8766?x=1"], "--register"),
        ("advertise_url", "node-7:8765", "--advertise-url"),
        ("name", "a/b", "--name"),
        ("name", "x" * 129, "--name"),
        ("heartbeat_s", 0.0, "--heartbeat-s"),
    ],
)
def test_registration_settings_that_could_not_work_are_refused_at_start(field, value, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(**{field: value}).check()


def test_the_registration_flags_reach_the_config():
    from sandbox_runtime.cli import build_parser

    argv = [
        "serve",
        "--register",
        "http://127.0.0.1:1",
        "--register",
        "http://127.0.0.1:2",
        "--advertise-url",
        "http://n:2",
    ]
    args = build_parser().parse_args([*argv, "--name", "n"])
    assert (
        args.register == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        and args.advertise_url == "http://n:2"
        and args.name == "n"
    )


def test_a_heartbeat_is_validated_as_a_wire_model():
    with pytest.raises(ValueError, match="capacity"):
        RuntimeHeartbeat(url="http://127.0.0.1:1", capacity=-1, sandboxes=0, backend="b", version="v", interval_s=1.0)
    with pytest.raises(ValueError, match="url"):
        RuntimeHeartbeat(
            url="http://127.0.0.1:1/path", capacity=1, sandboxes=0, backend="b", version="v", interval_s=1.0
        )


async def test_when_every_runtime_is_full_an_init_waits_for_room_then_tries_one_all_the_same():
    coordination = MemoryCoordination("r0")
    pool = SandboxPool([], coordination=coordination, wait_for_runtime_s=0.0)
    try:
        await coordination.runtime_heard("a", heartbeat("http://127.0.0.1:1", capacity=2, sandboxes=2))
        await coordination.runtime_heard("b", heartbeat("http://127.0.0.1:2", capacity=2, sandboxes=1))
        await swept(pool)
        assert (await pool._choose(exclude=set())).url == "http://127.0.0.1:2"  # the one with room
        pool.runtimes["http://127.0.0.1:2"].active = 2
        # Both full: with no time left to wait, the fullest-but-least-loaded one is tried (it may answer 429).
        assert (await pool._choose(exclude=set())).url in {"http://127.0.0.1:1", "http://127.0.0.1:2"}
    finally:
        await pool.close()


async def test_calls_to_a_runtime_gone_silent_end_at_once_and_its_leftovers_go_when_it_beats_again():
    clock = Clock()
    coordination = MemoryCoordination("r0", clock=clock)
    async with SandboxStandIn() as runtime:
        pool = SandboxPool([], coordination=coordination, wait_for_runtime_s=0.0)
        try:
            await coordination.runtime_heard("a", heartbeat(runtime.url))
            await swept(pool)
            env = await pool.acquire({"image": None}, exclude=set())
            runtime.cue("exec", HANG)  # a node that vanished: no answer, no reset
            call = asyncio.ensure_future(env.exec("make test", timeout=3600))
            await runtime.until(lambda: runtime.held == 1)

            clock.now += 3.5  # three beats missed: no new sandbox goes there, but its calls go on
            await pool.refresh()
            assert not pool.runtimes[runtime.url].alive and not call.done()

            clock.now += SEVER_AFTER_S  # silent for good: taken for gone, its calls end now
            await pool.refresh()
            with pytest.raises(SandboxUnreachable, match="taken for gone"):
                await call
            with pytest.raises(SandboxUnreachable, match="taken for gone"):  # and new ones at their start
                await env.exec("echo again")
            await pool.release(env)  # the episode moves on; the delete cannot reach the runtime
            assert env.sandbox_id in runtime.boxes

            await coordination.runtime_heard("a", heartbeat(runtime.url))  # back: used again, leftovers deleted
            await swept(pool)
            assert pool.runtimes[runtime.url].alive and not runtime.boxes
        finally:
            runtime.release()
            await pool.close()
