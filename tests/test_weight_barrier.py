"""The weight-update barrier (service/weight_barrier.py) and the partial rollouts it makes: through the service's
API with the LLM stand-in (which pauses, aborts and resumes as vLLM 0.32 and SGLang do), on virtual time. The
same against real vLLM: integration_tests/test_weight_update.py."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import pytest

from prorl_adapter.models import BatchItem, Resumption, SamplingParams
from prorl_adapter.service.agent import sample
from prorl_adapter.service.llm import LLMUnavailable, Pin
from prorl_adapter.service.server import BARRIER, PIPELINE
from prorl_adapter.service.storage.coordination import MemoryCoordination
from prorl_adapter.service.weight_barrier import ModeRefused, WeightBarrier
from prorl_adapter.trainer.client import RolloutAPIError

from .fakes import on_virtual_time
from .fakes.chat import CharChat
from .fakes.llm import Interruptible, Reply, ScriptedLLM, bash_call
from .fakes.rigs import llm_pool, rollout_stack, shell_job
from .fakes.standin import Hang

TURN = bash_call("echo interrupted")  # a turn long enough to be cut
CUT = 7  # tokens sampled before the abort


def rest_of(text: str, sampled: int) -> Reply:
    """What the server samples when asked to go on after `sampled` tokens of `text`."""
    chat = CharChat()
    return Reply(chat.decode(chat.encode(text)[sampled:]))


async def until_held(llm: ScriptedLLM, count: int = 1) -> None:
    await llm.until(lambda: llm.held >= count)


@on_virtual_time
async def test_an_aborted_turn_resumes_from_its_sampled_tokens_under_the_new_version():
    async with rollout_stack() as stack:
        stack.llm.cue(Interruptible(TURN, CUT), rest_of(TURN, CUT))
        job = await stack.client.submit(shell_job())
        await until_held(stack.llm)
        state = await stack.client.pause_generation("abort")
        assert state.paused and state.mode == "abort" and state.in_flight == 0
        assert stack.llm.control == ["/pause?mode=abort"]
        assert len(stack.llm.requests) == 1  # the rest waits for the resume
        resumed = await stack.client.resume_generation(version=1)
        assert not resumed.paused and resumed.policy_version == 1 and stack.llm.control[-1] == "/resume"
        trajectory = await stack.client.result(job.job_id)

    first, rest = stack.llm.requests[0], stack.llm.requests[1]
    cut = stack.llm.sampled[0].token_ids
    assert len(cut) == CUT and stack.llm.sampled[0].finish_reason == "abort"
    assert rest["prompt"] == first["prompt"] + cut  # the prompt plus what was sampled, nothing re-tokenised
    assert rest["max_tokens"] == first["max_tokens"] - CUT
    turn = trajectory.turns[0]
    assert turn.text == TURN and turn.tool_calls[0].arguments == {"command": "echo interrupted"}
    assert turn.finish_reason == "stop" and turn.policy_version == 0
    assert turn.resumptions == [Resumption(offset=CUT, policy_version=1)]
    span = slice(turn.response_start, turn.response_start + turn.response_tokens)
    assert trajectory.response_ids[span] == cut + stack.llm.sampled[1].token_ids
    assert trajectory.response_logprobs[span] == stack.llm.sampled[0].logprobs + stack.llm.sampled[1].logprobs
    versions = BatchItem(id="x", trajectory=trajectory).token_versions()[span]
    assert versions == [0] * CUT + [1] * (turn.response_tokens - CUT)
    assert (trajectory.policy_version_min, trajectory.policy_version_max) == (0, 1)


@on_virtual_time
async def test_drain_lets_the_turn_in_flight_finish_and_holds_the_next_until_the_resume():
    async with rollout_stack() as stack:
        stack.llm.cue(Hang(then=bash_call("echo 1")))
        job = await stack.client.submit(shell_job())
        await until_held(stack.llm)
        pause = asyncio.ensure_future(stack.client.pause_generation("drain"))
        with pytest.raises(TimeoutError):  # 60 s of virtual time: it waits for the turn, however long it takes
            await asyncio.wait_for(asyncio.shield(pause), 60)
        stack.llm.release()
        state = await pause
        assert state.paused and state.in_flight == 0 and stack.llm.control == []  # drain asks no server anything
        barrier = stack.app[BARRIER]
        while barrier.state().waiting == 0:  # polled: the episode's tool runs before its next turn reaches the gate
            await asyncio.sleep(0.01)
        assert len(stack.llm.requests) == 1 and not (await stack.client.job(job.job_id)).state.finished
        await stack.client.resume_generation(version=5)
        trajectory = await stack.client.result(job.job_id)
    assert [t.policy_version for t in trajectory.turns] == [0, 5]
    assert all(t.resumptions == [] for t in trajectory.turns)


@on_virtual_time
async def test_a_barrier_never_resumed_ends_at_its_timeout_visibly(caplog):
    caplog.set_level(logging.WARNING, logger="prorl_adapter.service.weight_barrier")
    async with rollout_stack() as stack:
        paused_at = time.monotonic()
        await stack.client.pause_generation("drain", timeout_s=30)
        job = await stack.client.submit(shell_job())
        trajectory = await stack.client.result(job.job_id, wait=300)
        state = await stack.client.weight_update_state()
    assert trajectory.error is None and time.monotonic() - paused_at >= 30
    assert not state.paused and state.expired == 1 and state.last_expired_at is not None
    assert "expired without a resume" in caplog.text


@on_virtual_time
async def test_an_abort_from_outside_is_resumed_and_never_recorded_as_a_finished_turn():
    """As verl's replicas do around their own weight updates: pause the engine with its requests aborted, then
    resume it. The service sends the rest at once; the paused server queues it until its resume."""
    async with rollout_stack() as stack:
        stack.llm.cue(Interruptible(TURN, CUT), rest_of(TURN, CUT))
        job = await stack.client.submit(shell_job())
        await until_held(stack.llm)
        async with aiohttp.ClientSession() as http:
            await http.post(f"{stack.llm.url}/pause?mode=abort")
            await stack.llm.until(lambda: len(stack.llm.requests) == 2)
            await http.post(f"{stack.llm.url}/resume")
        trajectory = await stack.client.result(job.job_id)
    turn = trajectory.turns[0]
    assert turn.text == TURN and turn.finish_reason == "stop"
    assert turn.resumptions == [Resumption(offset=CUT, policy_version=0)]
    assert stack.llm.requests[1]["prompt"] == stack.llm.requests[0]["prompt"] + stack.llm.sampled[0].token_ids


@on_virtual_time
async def test_a_gateway_call_in_flight_gets_one_whole_answer_and_its_record_holds_both_versions():
    async with rollout_stack() as stack:
        answer = "the files are a.txt and b.txt"
        stack.llm.cue(Interruptible(answer, CUT), rest_of(answer, CUT))
        episode = stack.app[PIPELINE].gateway.open("job-1", shell_job())
        messages = [{"role": "user", "content": "list the files"}]
        call = asyncio.ensure_future(
            stack.gateway.post(f"/gateway/{episode.key}/v1/chat/completions", json={"model": "m", "messages": messages})
        )
        await until_held(stack.llm)
        await stack.client.pause_generation("abort")
        await stack.client.resume_generation(version=2)
        reply = await (await call).json()
    assert reply["choices"][0]["message"]["content"] == answer and reply["choices"][0]["finish_reason"] == "stop"
    [turn] = episode.log.segments()[1]
    assert turn.policy_version == 0 and turn.resumptions == [Resumption(offset=CUT, policy_version=2)]


@on_virtual_time
async def test_sglang_is_paused_and_continued_by_its_own_routes():
    async with ScriptedLLM(protocol="sglang") as llm, llm_pool([llm]) as pool:
        barrier = WeightBarrier(MemoryCoordination("test"), pool)
        llm.cue(Interruptible(TURN, CUT), rest_of(TURN, CUT))
        turn = asyncio.ensure_future(
            sample(pool, CharChat(), [1, 2, 3], SamplingParams(max_tokens=100), Pin(), barrier)
        )
        await until_held(llm)
        await barrier.pause("abort", 60)
        await barrier.resume(3, raise_only=False)
        sampled = await turn
    assert llm.control == ['/pause_generation {"mode": "abort"}', "/continue_generation"]
    assert CharChat().decode(sampled.generation.token_ids[:-1]) == TURN
    assert sampled.resumptions == [Resumption(offset=CUT, policy_version=3)]


@on_virtual_time
async def test_a_regex_turn_that_was_aborted_is_sampled_again_whole():
    """The server would match the regex from its start again on the rest: the partial tokens are dropped."""
    async with ScriptedLLM() as llm, llm_pool([llm]) as pool:
        barrier = WeightBarrier(MemoryCoordination("test"), pool)
        llm.cue(Interruptible(TURN, CUT), TURN)
        sampling = SamplingParams(max_tokens=100, regex=".*")
        turn = asyncio.ensure_future(sample(pool, CharChat(), [1, 2, 3], sampling, Pin(), barrier))
        await until_held(llm)
        await barrier.pause("abort", 60)
        await barrier.resume(1, raise_only=False)
        sampled = await turn
    assert llm.requests[1]["prompt"] == [1, 2, 3] and llm.requests[1]["max_tokens"] == 100
    assert sampled.generation.token_ids == llm.sampled[1].token_ids
    assert sampled.policy_version == 1 and sampled.resumptions == []


@on_virtual_time
async def test_prorl_servers_take_drain_only_and_abort_is_refused_before_anything_is_held():
    async with ScriptedLLM(protocol="prorl") as llm, llm_pool([llm]) as pool:
        await pool.check_health()
        barrier = WeightBarrier(MemoryCoordination("test"), pool)
        with pytest.raises(ModeRefused, match="prorl protocol has no way to abort"):
            await barrier.pause("abort", 60)
        assert not barrier.state().paused
        assert (await barrier.pause("drain", 60)).paused
        await barrier.resume(None, raise_only=False)
        assert not barrier.state().paused


@on_virtual_time
async def test_a_server_that_cannot_pause_fails_the_call_and_leaves_no_barrier_held():
    async with rollout_stack() as stack:
        stack.llm.pausable = False
        with pytest.raises(RolloutAPIError) as failed:
            await stack.client.pause_generation("abort")
        assert failed.value.status == 502 and "VLLM_SERVER_DEV_MODE" in failed.value.message
        assert not (await stack.client.weight_update_state()).paused
        trajectory = await stack.client.run(shell_job())  # generation goes on
    assert trajectory.error is None


@on_virtual_time
async def test_bad_barrier_requests_are_refused_with_400():
    async with rollout_stack() as stack:
        for body in ({"mode": "keep-going"}, {"timeout_s": 0}, {"timeout_s": "soon"}, {"mode": "drain", "x": 1}):
            reply = await stack.http.post("/v1/weight-update/pause", json=body)
            assert reply.status == 400, body
        reply = await stack.http.post("/v1/weight-update/resume", json={"version": -1})
        assert reply.status == 400
        assert not (await stack.client.weight_update_state()).paused


@on_virtual_time
async def test_a_second_pause_renews_the_barrier_and_a_second_resume_is_harmless():
    async with rollout_stack() as stack:
        first = await stack.client.pause_generation("drain", timeout_s=10)
        second = await stack.client.pause_generation("drain", timeout_s=100)
        assert second.barrier == first.barrier and second.expires_in_s > 90 and second.pauses == 1
        await stack.client.resume_generation(version=4)
        state = await stack.client.resume_generation(version=4)
    assert not state.paused and state.policy_version == 4 and state.expired == 0


@on_virtual_time
async def test_a_pause_in_another_mode_than_the_barrier_held_is_refused_and_changes_nothing():
    async with rollout_stack() as stack:
        held = await stack.client.pause_generation("abort")
        with pytest.raises(RolloutAPIError) as refused:
            await stack.client.pause_generation("drain")
        assert refused.value.status == 409 and "resume it first" in refused.value.message
        state = await stack.client.weight_update_state()
        assert state.barrier == held.barrier and state.mode == "abort"
        await stack.client.resume_generation(version=1)
    assert stack.llm.control == ["/pause?mode=abort", "/resume"]  # the servers are resumed as they were paused


@on_virtual_time
async def test_a_resume_with_no_barrier_held_still_resumes_the_servers():
    """A replica restarted since the pause (memory coordination: it remembers nothing) is still told to go on."""
    async with rollout_stack() as stack:
        state = await stack.client.resume_generation(version=2)
    assert not state.paused and state.policy_version == 2 and stack.llm.control == ["/resume"]


@on_virtual_time
async def test_a_turn_the_server_keeps_aborting_fails_instead_of_looping():
    async with ScriptedLLM() as llm, llm_pool([llm]) as pool:
        barrier = WeightBarrier(MemoryCoordination("test"), pool)
        llm.cue(*[Interruptible(TURN, 1) for _ in range(200)])
        turn = asyncio.ensure_future(sample(pool, CharChat(), [1], SamplingParams(max_tokens=1000), Pin(), barrier))
        while True:  # every request is aborted as it arrives
            held = asyncio.ensure_future(until_held(llm))
            done, _ = await asyncio.wait([turn, held], return_when=asyncio.FIRST_COMPLETED)
            if turn in done:
                held.cancel()
                break
            llm.abort()
        with pytest.raises(LLMUnavailable, match="aborted 101 times"):
            await turn


async def until_received(stack, tokens: int) -> None:
    """Until the service has read `tokens` tokens of the turn it streams (the barrier's own count)."""
    requests = stack.app[BARRIER]._requests
    while not any(r.progress.received >= tokens for r in requests):
        await asyncio.sleep(0.01)  # polled: the stream's events arrive on their own


@on_virtual_time
async def test_keep_freezes_the_turn_and_tags_the_tokens_after_the_resume_with_the_new_version():
    async with rollout_stack(llm_stream=True) as stack:
        stack.llm.cue(Interruptible(TURN, CUT))
        job = await stack.client.submit(shell_job())
        await until_held(stack.llm)
        await until_received(stack, CUT)
        state = await stack.client.pause_generation("keep")
        assert state.paused and state.in_flight == 1 and stack.llm.control == ["/pause?mode=keep"]  # frozen, not ended
        await stack.client.resume_generation(version=1)
        assert stack.llm.control[-1] == "/resume"
        stack.llm.release()  # the server goes on with the frozen request
        trajectory = await stack.client.result(job.job_id)
    assert stack.llm.requests[0]["stream"] is True and stack.llm.sampled[0].finish_reason == "stop"  # one request
    turn = trajectory.turns[0]
    assert turn.text == TURN and turn.finish_reason == "stop"
    assert turn.policy_version == 0 and turn.resumptions == [Resumption(offset=CUT, policy_version=1)]
    span = slice(turn.response_start, turn.response_start + turn.response_tokens)
    assert trajectory.response_ids[span] == stack.llm.sampled[0].token_ids
    assert trajectory.response_logprobs[span] == stack.llm.sampled[0].logprobs


@on_virtual_time
async def test_keep_needs_the_turns_streamed_and_says_how():
    async with rollout_stack() as stack:
        with pytest.raises(RolloutAPIError) as refused:
            await stack.client.pause_generation("keep")
        assert refused.value.status == 400 and "--llm-stream" in refused.value.message
        assert not (await stack.client.weight_update_state()).paused


@on_virtual_time
async def test_streamed_turns_carry_what_whole_ones_do():
    script = [bash_call("echo 1"), "all done"]
    async with rollout_stack(script=script, llm_stream=True) as streamed, rollout_stack(script=script) as whole:
        a = await streamed.client.run(shell_job())
        b = await whole.client.run(shell_job())
    assert all(r["stream"] is True for r in streamed.llm.requests) and not any(
        "stream" in r for r in whole.llm.requests
    )
    assert a.response_ids == b.response_ids and a.response_mask == b.response_mask
    assert [t.text for t in a.turns] == [t.text for t in b.turns] and a.reward == b.reward
    assert [t.finish_reason for t in a.turns] == [t.finish_reason for t in b.turns]


@on_virtual_time
async def test_a_pause_longer_than_an_episodes_budget_does_not_time_it_out():
    async with rollout_stack() as stack:
        stack.llm.cue(Hang(then=bash_call("echo 1")))
        job = await stack.client.submit(shell_job(timeout_s=60))
        await until_held(stack.llm)
        pause = asyncio.ensure_future(stack.client.pause_generation("drain", timeout_s=600))
        stack.llm.release()
        await pause
        barrier = stack.app[BARRIER]
        while barrier.state().waiting == 0:  # polled: the episode's tool runs before its next turn reaches the gate
            await asyncio.sleep(0.01)
        await asyncio.sleep(300)  # the pause, five times the episode's budget
        await stack.client.resume_generation(version=1)
        trajectory = await stack.client.result(job.job_id)
    assert trajectory.error is None and trajectory.timings.run_s >= 300


@on_virtual_time
async def test_the_barrier_is_in_the_metrics():
    async with rollout_stack() as stack:
        await stack.client.pause_generation("drain", timeout_s=60)
        held = await (await stack.http.get("/metrics")).text()
        await asyncio.sleep(10)  # held a while (virtual time)
        await stack.client.resume_generation(version=1)
        released = await (await stack.http.get("/metrics")).text()
        counted = stack.app[BARRIER].held_s()
    assert 'prorl_rollout_weight_update{figure="paused"} 1.0' in held
    assert 'prorl_rollout_weight_update{figure="paused"} 0.0' in released
    assert 'prorl_rollout_weight_update{figure="pauses"} 1.0' in released
    seconds = next(line for line in released.splitlines() if 'figure="held_seconds"' in line)
    assert float(seconds.split()[-1]) == pytest.approx(counted)  # the barrier's own count of its holds
