"""Scale-out on one machine: runtimes that register themselves, and replicas of the service sharing one Redis.

Real processes throughout (Redis, bwrap runtimes, the rollout service's replicas, vLLM). The faults are kill -9
of a runtime and of a replica while episodes run on them; afterwards every job must have finished (done, run
again elsewhere where its runtime or replica died) and no sandbox may be left on any runtime.
"""

from __future__ import annotations

import asyncio
import signal
import time

import httpx
import pytest

from prorl_adapter.trainer.client import RolloutClient

from .conftest import BACKEND_SKIPS, start_rollout, start_server
from .redis_server import REDIS_SKIP, RedisServer
from .test_rollout import shell_job

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"] or REDIS_SKIP), reason="needs bwrap and Redis")


async def until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll an async `condition()` until it holds (effects of heartbeats and background takeovers)."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} did not hold within {timeout:g} s")
        await asyncio.sleep(0.1)


async def runtimes_alive(url: str) -> set[str]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as http:
        return {r["url"] for r in (await http.get("/v1/runtimes")).json()["runtimes"] if r["alive"]}


def kill(service) -> None:
    service.process.send_signal(signal.SIGKILL)
    service.process.wait()


async def test_runtimes_register_leave_and_die(vllm, tmp_path):
    service = start_rollout([], [vllm.url])
    first = second = None
    try:
        first = start_server(tmp_path / "a", "bwrap", None, "--register", service.url, "--heartbeat-s", "0.5")
        await until(lambda: _has(service.url, {first.url}), what="the first runtime registered")
        async with RolloutClient(service.url) as client:
            assert (await client.run(shell_job("pwd", max_turns=1), wait=300)).error is None
            status = await client.status()
        [runtime] = status.runtimes
        assert runtime.source == "registered" and runtime.capacity == 1024 and runtime.placed == 0

        second = start_server(tmp_path / "b", "bwrap", None, "--register", service.url, "--heartbeat-s", "0.5")
        await until(lambda: _has(service.url, {first.url, second.url}), what="the second runtime registered")
        first.service.stop()  # a clean stop says it is leaving: unused at once
        assert await runtimes_alive(service.url) == {second.url}
        kill(second)  # a crash says nothing: unused after three missed heartbeats
        await until(lambda: _has(service.url, set()), timeout=10, what="the dead runtime dropped")
    finally:
        for server in (first, second):
            if server is not None:
                server.service.stop()
        service.stop()


async def _has(url: str, alive: set[str]) -> bool:
    return await runtimes_alive(url) == alive


async def test_replicas_share_jobs_and_lose_none_to_a_dead_replica_or_runtime(vllm, tmp_path):
    redis = RedisServer(tmp_path).start()
    replicas = [
        start_rollout([], [vllm.url], "--buffer", redis.url, "--service-id", f"replica-{i}", "--max-run-workers", "4")
        for i in range(2)
    ]
    urls = [r.url for r in replicas]
    register = [arg for url in urls for arg in ("--register", url)] + ["--heartbeat-s", "0.5"]
    # Each runtime has a token of its own (the service learns it from the heartbeats): this test calls one at the end.
    runtimes = [
        start_server(tmp_path / f"rt{i}", "bwrap", f"runtime-{i}-own-token-0123456789", *register) for i in range(2)
    ]
    try:
        for url in urls:
            await until(lambda url=url: _has(url, {r.url for r in runtimes}), what="both runtimes registered")
        async with RolloutClient(urls[0]) as first, RolloutClient(urls[1]) as second:
            # Replicas share the policy version: set through one, the other reports it.
            await second.set_policy_version(3)
            assert (await first.status()).policy_version == 3
            jobs = [shell_job("sleep 1; pwd", "ls", max_turns=2, job_id=f"job-{i}") for i in range(16)]
            for job in jobs:
                await first.submit(job)
            # Both replicas take work from the shared queue; any replica answers for any job.
            holders: set[str] = set()

            async def both_hold_jobs() -> bool:
                for job in jobs:
                    status = await second.job(job.job_id)
                    if status.replica and status.state.value in ("init", "running"):
                        holders.add(status.replica)
                return holders == {"replica-0", "replica-1"}

            await until(both_hold_jobs, timeout=120, what="both replicas running jobs")
            kill(replicas[1])  # a replica dies with episodes in hand
            kill(runtimes[0])  # and so does a runtime
            results = await asyncio.gather(*(first.result(job.job_id, wait=600) for job in jobs))
            status = await first.status()
        assert [r.error for r in results] == [None] * len(jobs), [r.error for r in results if r.error]
        assert {r.policy_version_min for r in results} == {3}
        assert status.replicas and {r.id for r in status.replicas} == {"replica-0"}  # the dead one taken over
        async with runtimes[1].client() as client:
            assert await client.list_sandboxes() == []  # nothing left, the dead replica's sandboxes included
    finally:
        for service in (*replicas, *(r.service for r in runtimes)):
            service.stop()
        redis.kill()
