"""The rollout service when its parts die mid-batch: a vLLM server, a sandbox runtime server."""

from __future__ import annotations

import asyncio
import signal

import pytest

from prorl_adapter.dev import localstack
from prorl_adapter.trainer.client import RolloutClient

from .conftest import BACKEND_SKIPS, VLLM_SKIP, start_rollout, start_server, stop_server
from .test_rollout import shell_job


@pytest.fixture(scope="module")
def sandbox_servers(tmp_path_factory):
    if BACKEND_SKIPS["bwrap"]:
        pytest.skip(BACKEND_SKIPS["bwrap"])
    servers = [start_server(tmp_path_factory.mktemp(f"fail-sandboxes-{i}"), "bwrap") for i in range(2)]
    yield servers
    for server in servers:
        stop_server(server)


async def wait_for(condition, timeout: float = 120.0) -> None:
    """Poll an async condition of the system under test until it holds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.05)


async def test_episodes_fail_over_when_an_llm_server_dies(vllm, sandbox_servers, tmp_path):
    if VLLM_SKIP:
        pytest.skip(VLLM_SKIP)
    doomed = localstack.start_vllm(log=tmp_path / "vllm-doomed.log")
    try:
        rollout = start_rollout([sandbox_servers[0].url], [vllm.url, doomed.url])
        try:
            async with RolloutClient(rollout.url) as client:
                jobs = [await client.submit(shell_job("sleep 1", max_turns=3)) for _ in range(6)]

                async def doomed_has_served() -> bool:
                    servers = {s.url: s for s in await client.llm_servers()}
                    return servers[doomed.url].requests >= 2

                await wait_for(doomed_has_served)
                doomed.kill()
                results = [await client.result(job.job_id, wait=600) for job in jobs]
                servers = {s.url: s for s in await client.llm_servers()}
        finally:
            rollout.stop()
    finally:
        doomed.kill()
    assert all(r.error is None and not r.filter and r.num_turns == 3 for r in results)
    used = [{t.llm_server for t in r.turns} for r in results]
    assert any(servers_used == {vllm.url, doomed.url} for servers_used in used), used  # failed over mid-episode
    assert servers[doomed.url].healthy is False  # by a failed request or by the health check, whichever came first


async def test_a_dead_sandbox_servers_episodes_start_again_elsewhere_and_init_retries_elsewhere(vllm, sandbox_servers):
    survivor, victim = sandbox_servers
    rollout = start_rollout([survivor.url, victim.url], [vllm.url])
    try:
        async with RolloutClient(rollout.url) as client:
            jobs = [await client.submit(shell_job("sleep 2", max_turns=2)) for _ in range(4)]

            async def all_running() -> bool:
                states = [(await client.job(j.job_id)).state for j in jobs]
                return all(state == "running" for state in states)

            await wait_for(all_running)
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            results = [await client.result(job.job_id, wait=300) for job in jobs]
            first = [await client.job(job.job_id) for job in jobs]
            # Their sandboxes died with their server: those episodes started again, from init, on the survivor.
            assert all(r.error is None for r in results), [r.error for r in results]
            assert any(s.attempts == 2 for s in first), "some episodes ran on the server that died"
            # New episodes: init picks the dead server for some of them, fails there, and retries on the other.
            later = [await client.submit(shell_job("pwd", max_turns=1)) for _ in range(4)]
            later_results = [await client.result(job.job_id, wait=300) for job in later]
            statuses = [await client.job(job.job_id) for job in later]
    finally:
        rollout.stop()
    assert all(r.error is None for r in later_results), [r.error for r in later_results]
    assert any(s.attempts == 2 for s in statuses)
