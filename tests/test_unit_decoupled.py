"""Decoupled mode through the service's API: prompts in (POST /v1/prompts), weighed batches out (POST
/v1/batches), acknowledgements, leases that run out, and admission held back by the staleness plugin's pace mode.
The service is the real one with its memory buffer and the installed staleness plugin; the LLM server, the
sandbox runtime and the tokenizer are in-process stand-ins (tests/fakes), and time is virtual, so a lease of
30 s or a long poll of 600 s takes no real time."""

from __future__ import annotations

import asyncio
import math

import pytest

from prorl_adapter.models import JobRequest
from tests.fakes import Hang, Stack, bash_call, finish_call, on_virtual_time, rollout_stack, shell_job


def prompts(count: int, first: int = 0) -> list[JobRequest]:
    return [shell_job(job_id=f"prompt-{i}") for i in range(first, first + count)]


async def jobs_started(stack: Stack) -> set[str]:
    return {box.labels["job_id"] for box in stack.sandbox.created}


@on_virtual_time
async def test_prompts_become_weighed_batches_that_are_gone_once_acknowledged():
    plugins = {"staleness": {"mode": "linear", "max_staleness": 4}}
    async with rollout_stack(script=[Hang(then=finish_call())], plugin_config=plugins) as stack:
        assert await stack.client.enqueue_prompts(prompts(2)) == 2  # upcoming
        await stack.llm.until(lambda: stack.llm.held == 2)  # both episodes sampling at version 0
        await stack.client.set_policy_version(1)
        stack.llm.release()

        batch = await stack.client.take_batch(2, timeout=600, lease_s=60)
        assert batch.policy_version == 1 and len(batch.items) == 2
        assert {item.trajectory.job_id for item in batch.items} == {"prompt-0", "prompt-1"}
        for item in batch.items:
            assert item.deliveries == 1 and item.trajectory.policy_version_min == 0
            assert item.weight.sample == pytest.approx(0.75)  # linear: 1 - staleness 1 / K 4
            assert item.weight.reasons

        buffer = await stack.client.buffer()
        assert (buffer.pending, buffer.ready, buffer.produced, buffer.leased) == (2, 0, 2, 2)
        assert await stack.client.ack([item.id for item in batch.items]) == 2
        assert await stack.client.ack([item.id for item in batch.items]) == 0  # once only
        buffer = await stack.client.buffer()
        assert (buffer.pending, buffer.acked, buffer.leased, buffer.in_flight) == (0, 2, 0, 0)
        assert (await stack.client.take_batch(2, timeout=0)).items == []


@on_virtual_time
async def test_a_batch_asked_for_before_anything_finished_waits_for_it():
    async with rollout_stack(script=[Hang(then=bash_call("echo hi")), finish_call()]) as stack:
        await stack.client.enqueue_prompts(prompts(1))
        await stack.llm.until(lambda: stack.llm.held == 1)
        taking = asyncio.create_task(stack.client.take_batch(1, timeout=600))
        await asyncio.sleep(50)  # virtual: 50 s in which no episode finishes
        assert not taking.done()
        stack.llm.release()
        [item] = (await taking).items
        assert item.trajectory.job_id == "prompt-0" and item.trajectory.num_turns == 2
        assert item.weight.sample == 1.0 and item.weight.tokens is None


@on_virtual_time
async def test_an_unacknowledged_batch_is_delivered_again_when_its_lease_runs_out_then_dead_lettered():
    async with rollout_stack(script=[finish_call()], decoupled={"max_deliveries": 2}) as stack:
        await stack.client.enqueue_prompts(prompts(1))
        [first] = (await stack.client.take_batch(1, timeout=600, lease_s=30)).items
        # The trainer died holding it: 30 virtual seconds later it is handed out again.
        [again] = (await stack.client.take_batch(1, timeout=600, lease_s=30)).items
        assert (again.id, first.deliveries, again.deliveries) == (first.id, 1, 2)
        assert (await stack.client.buffer()).redelivered == 1

        # Its second lease runs out as well: after max_deliveries it is removed, not handed out forever.
        assert (await stack.client.take_batch(1, timeout=120)).items == []
        buffer = await stack.client.buffer()
        assert (buffer.dead_letters, buffer.recent_dead_letters, buffer.ready) == (1, [first.id], 0)


@on_virtual_time
async def test_pace_mode_holds_admission_until_the_trainer_moves_on():
    plugins = {"staleness": {"mode": "pace", "max_staleness": 0, "batch_size": 2}}
    async with rollout_stack(script=[finish_call()], plugin_config=plugins) as stack:
        await stack.client.enqueue_prompts(prompts(4))
        first = await stack.client.take_batch(2, timeout=600, lease_s=600)
        assert len(first.items) == 2
        buffer = await stack.client.buffer()
        assert (buffer.upcoming, buffer.held_back) == (2, True)
        assert "admission control" in buffer.held_back_reason
        assert len(await jobs_started(stack)) == 2  # K = 0: one batch at a time

        await stack.client.set_policy_version(1)
        await stack.client.ack([item.id for item in first.items])
        second = await stack.client.take_batch(2, timeout=600)
        assert {item.trajectory.policy_version_min for item in second.items} == {1}
        assert await jobs_started(stack) == {f"prompt-{i}" for i in range(4)}
        assert {item.trajectory.job_id for item in first.items + second.items} == await jobs_started(stack)


@on_virtual_time
async def test_importance_weights_come_back_per_token_from_the_trainers_logprobs():
    plugins = {"staleness": {"mode": "importance", "max_staleness": 2, "importance_cap": 2.0}}
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()], plugin_config=plugins) as stack:
        await stack.client.enqueue_prompts(prompts(1))
        [ready] = (await stack.client.take_batch(1, timeout=600, lease_s=1)).items
        trajectory = ready.trajectory
        current = [lp + 0.5 * m for lp, m in zip(trajectory.response_logprobs, trajectory.response_mask)]
        await stack.client.set_policy_version(1)
        [item] = (await stack.client.take_batch(1, timeout=600, current_logprobs={ready.id: current})).items
    expected = [math.exp(0.5) if m else 1.0 for m in trajectory.response_mask]
    assert item.weight.tokens == pytest.approx(expected) and item.weight.sample == 1.0


@on_virtual_time
async def test_prompts_of_an_unknown_task_are_refused_and_nothing_is_queued():
    async with rollout_stack() as stack:
        response = await stack.http.post("/v1/prompts", json={"requests": [{"task": "nope"}, {"task": "shell"}]})
        assert response.status == 400 and "nope" in (await response.json())["error"]
        empty = await stack.http.post("/v1/prompts", json={"requests": []})
        assert empty.status == 400
        assert (await stack.client.buffer()).upcoming == 0


async def a_lease_run_out(stack: Stack) -> str:
    """One trajectory, taken once and not acknowledged in time: its entry id, known to the trainer, is ready again."""
    await stack.client.enqueue_prompts(prompts(1))
    [item] = (await stack.client.take_batch(1, timeout=600, lease_s=1)).items
    return item.id


IMPORTANCE = {"staleness": {"mode": "importance", "max_staleness": 2}}


@on_virtual_time
async def test_current_logprobs_of_the_wrong_length_are_the_callers_mistake():
    async with rollout_stack(script=[finish_call()], plugin_config=IMPORTANCE) as stack:
        entry = await a_lease_run_out(stack)
        body = {"size": 1, "timeout_s": 600, "current_logprobs": {entry: [0.0]}}
        response = await stack.http.post("/v1/batches", json=body)
        assert response.status == 400 and "logprobs" in (await response.json())["error"]


@on_virtual_time
async def test_entries_of_a_take_that_failed_are_delivered_again():
    async with rollout_stack(script=[finish_call()], plugin_config=IMPORTANCE) as stack:
        entry = await a_lease_run_out(stack)
        body = {"size": 1, "timeout_s": 600, "current_logprobs": {entry: [0.0]}}
        assert (await stack.http.post("/v1/batches", json=body)).status >= 400
        again = await stack.client.take_batch(1, timeout=60)
        assert [item.id for item in again.items] == [entry]
