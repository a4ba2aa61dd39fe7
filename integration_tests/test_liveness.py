"""Nothing leaks and nothing waits forever: a real bwrap runtime and rollout service, driven by the scripted LLM
stand-in (each episode runs one chosen command), with jobs cancelled, timed out and their service killed."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from prorl_adapter.models import JobRequest, JobState
from prorl_adapter.trainer.client import RolloutClient

from . import scripted_llm
from .conftest import BACKEND_SKIPS, start_rollout
from .scripted_llm import bash_call

pytestmark = pytest.mark.skipif(bool(BACKEND_SKIPS["bwrap"]), reason=str(BACKEND_SKIPS["bwrap"]))

SCRIPTS = {"slow": [bash_call("sleep 60")], "quick": [bash_call("echo hi")]}


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    service = scripted_llm.start(SCRIPTS, tmp_path_factory.mktemp("scripts"))
    yield service
    service.stop()


def job(script: str, **fields) -> JobRequest:
    instance = {"goal": f"run it [script:{script}]", "check": "true"}
    return JobRequest(task="shell", instance=instance, max_turns=2, **fields)


async def sandboxes_of(runtime, owner: str | None = None) -> list:
    async with runtime.client() as client:
        boxes = await client.list_sandboxes()
    return [b for b in boxes if owner is None or b.labels.get("prorl_service") == owner]


async def eventually_none_left(runtime, seconds: float = 30.0) -> list:
    """The runtime's sandboxes once none is left, or what is left after `seconds` (deletes run late)."""
    deadline = time.monotonic() + seconds
    while (left := await sandboxes_of(runtime)) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    return left


async def test_every_sandbox_carries_the_service_label_and_a_ttl(sandbox_server, llm):
    rollout = start_rollout([sandbox_server.url], [llm.url], "--service-id", "labelled")
    try:
        async with RolloutClient(rollout.url) as client:
            status = await client.submit(job("slow", timeout_s=100))
            deadline = time.monotonic() + 30
            while not (boxes := await sandboxes_of(sandbox_server, "labelled")) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert len(boxes) == 1
            assert boxes[0].labels["job_id"] == status.job_id and boxes[0].ttl_s and boxes[0].ttl_s >= 100
            await client.cancel(status.job_id)
        assert await eventually_none_left(sandbox_server) == []
    finally:
        rollout.stop()


async def test_cancels_and_tiny_budgets_leave_no_sandbox(sandbox_server, llm):
    rollout = start_rollout([sandbox_server.url], [llm.url])
    try:
        async with RolloutClient(rollout.url) as client:
            timed = [await client.submit(job("quick", timeout_s=t)) for t in (0.002, 0.005, 0.01, 0.02, 0.03, 0.05)]
            cancelled = [await client.submit(job("slow")) for _ in range(4)]
            for status in cancelled:
                await client.cancel(status.job_id)
            for status in timed + cancelled:
                result = await client.result(status.job_id, wait=60)
                assert result.error is not None and result.filter
                assert (await client.job(status.job_id)).state in (JobState.failed, JobState.cancelled)
        assert await eventually_none_left(sandbox_server) == []
    finally:
        rollout.stop()


async def test_a_restarted_service_deletes_what_its_previous_run_left(sandbox_server, llm):
    first = start_rollout([sandbox_server.url], [llm.url], "--service-id", "restarted")
    async with RolloutClient(first.url) as client:
        await client.submit(job("slow"))
        deadline = time.monotonic() + 30
        while not await sandboxes_of(sandbox_server, "restarted") and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
    assert len(await sandboxes_of(sandbox_server, "restarted")) == 1
    first.process.send_signal(signal.SIGKILL)  # no clean-up runs
    first.process.wait()
    assert len(await sandboxes_of(sandbox_server, "restarted")) == 1
    second = start_rollout([sandbox_server.url], [llm.url], "--service-id", "restarted")
    try:
        assert await sandboxes_of(sandbox_server, "restarted") == []  # gone before it answered /healthz
    finally:
        second.stop()


async def test_an_8_mb_question_fails_its_job_cleanly(sandbox_server, llm):
    rollout = start_rollout([sandbox_server.url], [llm.url])
    try:
        async with RolloutClient(rollout.url, timeout=120) as client:
            question = "What is 1 + 1? " + "x " * (4 << 20)
            request = JobRequest(task="python_math", instance={"question": question, "answer": "2"})
            result = await client.run(request, wait=300)
            assert result.error is not None and result.error.error_class == "run" and result.filter
            assert "max_context_tokens is 4096" in result.error.message
            assert (await client.status()).finished["failed"] == 1
        assert await eventually_none_left(sandbox_server) == []
    finally:
        rollout.stop()
