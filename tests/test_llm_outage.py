"""An LLM outage told apart from a failing episode (docs/reliability.md), through the service's API: while no LLM
server is healthy, admission pauses and running turns wait for one (`--llm-outage-wait-s`); /healthz, /v1/status,
/metrics and /v1/buffer say why; an episode the outage failed runs again without its run counting against
max_attempts, while a request the LLM server refuses (a 4xx: the policy's own failure) counts as before. The
service is the real one; the LLM server, the sandbox runtime and the tokenizer are in-process stand-ins
(tests/fakes), and time is virtual: a wait of minutes takes no real time."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import pytest

from prorl_adapter.models import AgentProgram
from prorl_adapter.service.agent_program import ProgramFailed, run_program
from prorl_adapter.service.llm import LLMPool
from prorl_adapter.service.server import LLM, PIPELINE, PRODUCER
from sandbox_runtime.models import ExecResult
from tests.fakes import Fail, Hang, Stack, bash_call, finish_call, on_virtual_time, rollout_stack, shell_job

NONE_HEALTHY = "none of the 1 LLM servers is healthy"


async def jobs_started(stack: Stack) -> set[str]:
    return {box.labels["job_id"] for box in stack.sandbox.created}


async def metrics(stack: Stack) -> str:
    return await (await stack.http.get("/metrics")).text()


async def settled(condition: Callable[[], bool]) -> None:
    """Let the service's tasks run until `condition()` holds, with no time passing (for what follows an event the
    test has seen at once, with no timer in between)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    pytest.fail("the condition never held")


async def fleet_down(stack: Stack) -> LLMPool:
    """The one LLM server answers 503 to everything; a health check (as the background one would) finds it."""
    pool = stack.app[LLM]
    stack.llm.down = True
    await pool.check_health()
    return pool


@on_virtual_time
async def test_an_outage_shorter_than_the_wait_pauses_admission_and_running_episodes_finish_after_it():
    async with rollout_stack(script=[finish_call()]) as stack:
        llm = stack.llm
        llm.cue(Hang(then=bash_call("echo hi")))  # a's first turn, sampled while the fleet goes down
        await stack.client.enqueue_prompts([shell_job(job_id="a")])
        await llm.until(lambda: llm.held == 1)
        pool = await fleet_down(stack)

        await stack.client.enqueue_prompts([shell_job(job_id="b")])
        buffer = await stack.client.buffer()
        assert buffer.held_back and buffer.upcoming == 1
        assert buffer.held_back_reason.startswith(f"LLM outage: {NONE_HEALTHY}; admission resumes")

        llm.release()  # a's first turn is answered; its second waits for a server
        await llm.until(lambda: (outage := pool.outage()) is not None and outage.waiting == 1)
        health = await stack.client.health()
        assert health.degraded == f"LLM outage: {NONE_HEALTHY} (1 turns waiting for a server)"
        status = await stack.client.status()
        assert (status.llm_outage.reason, status.llm_outage.waiting) == (NONE_HEALTHY, 1)
        assert status.degraded == health.degraded
        text = await metrics(stack)
        assert "prorl_rollout_llm_outage 1.0" in text and "prorl_rollout_llm_outage_waits_total 1.0" in text
        assert await jobs_started(stack) == {"a"}  # b is held back

        llm.down = False  # the fleet is back: the waiting turn's next health round finds it, and admission resumes
        batch = await stack.client.take_batch(2, timeout=600)
        by_id = {item.trajectory.job_id: item.trajectory for item in batch.items}
        assert set(by_id) == {"a", "b"} and all(t.error is None and t.attempt == 1 for t in by_id.values())
        assert by_id["a"].num_turns == 2  # the episode went on where it was

        buffer = await stack.client.buffer()
        assert (buffer.retried, buffer.outage_reruns, buffer.filtered, buffer.held_back_reason) == (0, 0, 0, None)
        assert (await stack.client.health()).degraded is None and (await stack.client.status()).llm_outage is None
        assert "prorl_rollout_llm_outage 0.0" in await metrics(stack)


@on_virtual_time
async def test_an_outage_longer_than_the_wait_fails_episodes_as_its_own_and_they_run_again_after_it():
    # max_attempts=1: a failure that counted would filter the prompt at once.
    decoupled = {"max_attempts": 1, "retry_delay_s": 0.01}
    async with rollout_stack(
        script=[finish_call()], llm_outage_wait_s=20.0, llm_health_interval_s=5.0, decoupled=decoupled
    ) as stack:
        llm, producer = stack.llm, stack.app[PRODUCER]
        llm.cue(Hang(then=bash_call("echo hi")))
        await stack.client.enqueue_prompts([shell_job(job_id="a")])
        await llm.until(lambda: llm.held == 1)
        await fleet_down(stack)
        llm.release()

        failed = await stack.client.result("a", wait=600)  # its second turn waited 20 s for a server
        assert failed.error.error_class == "run" and failed.error.outage and failed.filter
        assert "--llm-outage-wait-s" in failed.error.message
        # Queued again, and held back while the outage lasts (the background health check keeps probing).
        await llm.until(lambda: producer.stats.outage_reruns == 1)
        buffer = await stack.client.buffer()
        assert (buffer.upcoming, buffer.held_back, buffer.retried, buffer.filtered) == (1, True, 1, 0)
        assert buffer.held_back_reason.startswith("LLM outage")
        assert await jobs_started(stack) == {"a"}

        llm.down = False  # the background health check sees it back; its listener wakes admission
        [item] = (await stack.client.take_batch(1, timeout=600)).items
        rerun = item.trajectory
        assert (rerun.job_id, rerun.attempt, rerun.retry_of, rerun.error) == ("a:2", 2, "a", None)
        assert (await stack.client.buffer()).filtered == 0


@on_virtual_time
async def test_a_job_whose_time_budget_runs_out_while_it_waits_for_a_server_fails_as_the_outages():
    async with rollout_stack(script=[finish_call()]) as stack:  # the wait (300 s) outlasts the job's budget
        llm = stack.llm
        llm.cue(Hang(then=bash_call("echo hi")))
        await stack.client.submit(shell_job(job_id="j", timeout_s=60))
        await llm.until(lambda: llm.held == 1)
        await fleet_down(stack)
        llm.release()
        failed = await stack.client.result("j", wait=600)
        assert failed.error.error_class == "timeout" and failed.error.outage


@on_virtual_time
async def test_a_request_the_llm_server_refuses_still_counts_toward_max_attempts():
    refused = Fail(400, "This model's maximum context length is 8 tokens")
    async with rollout_stack(script=[refused], decoupled={"max_attempts": 2, "retry_delay_s": 0.01}) as stack:
        llm, producer = stack.llm, stack.app[PRODUCER]
        await stack.client.enqueue_prompts([shell_job(job_id="p")])
        first = await stack.client.result("p", wait=600)
        await llm.until(lambda: len(llm.requests) == 2)  # the second run asked
        second = await stack.client.result("p:2", wait=600)
        for trajectory in (first, second):
            assert trajectory.error.error_class == "run" and not trajectory.error.outage
            assert "maximum context length" in trajectory.error.message
        await settled(lambda: producer.stats.filtered == 1)  # two runs failed: max_attempts spent
        assert (producer.stats.retried, producer.stats.outage_reruns) == (1, 0)
        assert await jobs_started(stack) == {"p", "p:2"}
        assert (await stack.client.status()).llm_outage is None  # a refusal is no outage


@on_virtual_time
async def test_outage_reruns_are_the_services_to_set():
    async with rollout_stack() as stack:
        body = {"requests": [{"task": "shell", "outage_reruns": 1}]}
        response = await stack.http.post("/v1/prompts", json=body)
        assert response.status == 400 and "outage_reruns" in (await response.json())["error"]


class OutageProgram:
    """A stand-in sandbox whose `exec` plays an agent program that asks the gateway once, meets the outage (503,
    after the service waited `--llm-outage-wait-s` for a server) and exits with an error, as a harness would."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.statuses = stack, []

    async def exec(self, command: str, timeout: float = 30.0, max_output_bytes: int | None = None) -> ExecResult:
        key = re.search(r"OPENAI_API_KEY=(\S+?);", command).group(1)
        reply = await self.stack.gateway.post(f"/gateway/{key}/v1/chat/completions", json=CHAT)
        self.statuses.append(reply.status)
        return ExecResult(output="error: 503", exit_code=1, status="completed", truncated=False, duration_s=1, cwd="/")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@on_virtual_time
async def test_an_agent_program_whose_call_met_an_outage_fails_as_the_outages_not_the_policys():
    """Its exit says nothing of the policy: the run fails with `outage` set (decoupled mode runs it again, not
    counted), as a built-in agent loop's turn does."""
    async with rollout_stack(script=[finish_call()]) as stack:
        await fleet_down(stack)
        request = shell_job(agent=AgentProgram(command="my-harness"))
        handler = stack.app[PIPELINE].tasks["shell"]
        program = OutageProgram(stack)
        with pytest.raises(ProgramFailed) as failed:
            await run_program("job-1", request, handler, program, stack.app[PIPELINE].gateway, budget_s=1800)
    assert program.statuses == [503]
    assert failed.value.outage and "--llm-outage-wait-s" in str(failed.value)
