"""The pipeline through the service's API: a job's path init -> run -> eval, what its trajectory holds, and how it
ends when it is cancelled, runs out of time, or cannot get a sandbox. The service is the real one; the LLM
server, the sandbox runtime and the tokenizer are in-process stand-ins (tests/fakes), and time is virtual."""

from __future__ import annotations

import asyncio

import pytest

from prorl_adapter.service.pipeline import RELEASE_WAIT_S
from prorl_plugins.tasks.clean_check import check_script
from tests.fakes import (
    CHECK,
    HANG,
    Fail,
    Hang,
    Stack,
    bash_call,
    finish_call,
    on_virtual_time,
    rollout_stack,
    shell_job,
)

OBSERVATION = "hi\n[exit code 0]"  # what the bash tool makes of `echo hi` answered by the stand-in's shell


def hold(stack: Stack, stage: str) -> None:
    """Make the next job's `stage` wait until released: sandbox creation, the first LLM call, or eval's check."""
    if stage == "init":
        stack.sandbox.cue("create", HANG)
    elif stage == "run":
        stack.llm.cue(HANG)
    else:
        stack.sandbox.cue("run", HANG)


async def until_held(stack: Stack, stage: str) -> None:
    standin = stack.llm if stage == "run" else stack.sandbox
    await standin.until(lambda: standin.held == 1)


async def no_sandbox_left(stack: Stack) -> None:
    stack.sandbox.release()  # a creation held in init completes now: the service must delete what it gets
    await stack.sandbox.until(lambda: stack.sandbox.created and not stack.sandbox.boxes)


@pytest.mark.parametrize(("check_exit", "reward"), [(0, 1.0), (1, 0.0)])
@on_virtual_time
async def test_a_job_goes_init_run_eval_and_its_trajectory_holds_what_was_sampled_and_what_the_tools_said(
    check_exit, reward
):
    async with rollout_stack(script=[bash_call("echo hi"), finish_call("42")]) as stack:
        stack.sandbox.exit_codes[check_script(CHECK)] = check_exit  # what the shell task runs (clean_check)
        trajectory = await stack.client.run(shell_job(labels={"group": "g1"}), wait=60)

    first, second = stack.llm.sampled
    tool_ids = stack.chat.tool_turn_ids([{"role": "tool", "content": OBSERVATION}], closed_by_eos=True)
    assert trajectory.response_ids == first.token_ids + tool_ids + second.token_ids
    assert trajectory.response_mask == [1] * len(first.token_ids) + [0] * len(tool_ids) + [1] * len(second.token_ids)
    assert trajectory.response_logprobs == first.logprobs + [0.0] * len(tool_ids) + second.logprobs
    # Token in, token out: each turn's prompt is the whole context as ids, nothing decoded and re-encoded.
    assert first.prompt_ids == trajectory.prompt_ids
    assert second.prompt_ids == trajectory.prompt_ids + first.token_ids + tool_ids
    assert "reach the goal" in stack.chat.decode(trajectory.prompt_ids)

    assert (trajectory.finish_reason, trajectory.num_turns, trajectory.filter, trajectory.error) == (
        "finish",
        2,
        False,
        None,
    )
    assert (trajectory.reward, trajectory.reward_components["outcome"]) == (reward, reward)
    assert [turn.observation for turn in trajectory.turns] == [OBSERVATION, ""]
    assert trajectory.turns[0].tool_calls[0].arguments == {"command": "echo hi"}
    assert trajectory.labels == {"group": "g1"}

    # init creates the sandbox, run uses it, eval first ends the agent's processes and then checks, and the
    # sandbox is deleted at the end.
    [box] = stack.sandbox.created
    assert stack.sandbox.ops(box.id) == ["create", "exec", "kill", "run", "delete"]
    assert ("exec", box.id, "default: echo hi") in stack.sandbox.log
    assert ("run", box.id, check_script(CHECK)) in stack.sandbox.log
    assert stack.sandbox.boxes == {}
    assert box.labels["job_id"] == trajectory.job_id and box.labels["prorl_service"] == "unit-tests"
    assert box.ttl_s is not None  # the runtime reaps it even if the service dies with the job


@pytest.mark.parametrize(("stage", "state"), [("init", "init"), ("run", "running"), ("eval", "evaluating")])
@on_virtual_time
async def test_a_job_cancelled_in_any_stage_ends_cancelled_leaves_no_sandbox_and_the_next_job_runs(stage, state):
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        hold(stack, stage)
        job = await stack.client.submit(shell_job())
        await until_held(stack, stage)
        assert (await stack.client.job(job.job_id)).state == state

        cancelled = await stack.client.cancel(job.job_id)
        assert cancelled.state == "cancelled" and cancelled.error.error_class == "cancelled"
        trajectory = await stack.client.result(job.job_id, wait=0)
        assert trajectory.filter and trajectory.finish_reason == "error"
        assert trajectory.error.error_class == "cancelled"
        await no_sandbox_left(stack)
        assert (await stack.client.cancel(job.job_id)).state == "cancelled"  # cancelling again changes nothing

        healthy = await stack.client.run(shell_job(), wait=60)
        assert (healthy.reward, healthy.filter) == (1.0, False)
        await no_sandbox_left(stack)


@pytest.mark.parametrize("stage", ["init", "run", "eval"])
@on_virtual_time
async def test_a_job_out_of_time_in_any_stage_fails_with_timeout_and_releases_its_sandbox(stage):
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        hold(stack, stage)  # held for good: only the job's budget (virtual seconds) ends it
        trajectory = await stack.client.run(shell_job(timeout_s=120), wait=3600)
        assert trajectory.error.error_class == "timeout" and trajectory.filter
        assert "120" in trajectory.error.message
        # the cut is on the record: which budget, where it is set, its limit, and how far in
        cut = trajectory.cut
        assert (cut.budget, cut.setting, cut.limit) == (f"{stage}_timeout", "timeout_s", 120)
        assert 120 <= cut.used < 121
        await no_sandbox_left(stack)
        status = await stack.client.status()
        assert status.finished["failed"] == 1 and sum(status.active.values()) == 0


@on_virtual_time
async def test_an_episode_cut_by_its_turn_or_context_limit_records_the_cut_and_one_that_ends_none():
    async with rollout_stack(script=[bash_call("echo hi")] * 3) as stack:
        turns = await stack.client.run(shell_job(max_turns=2), wait=60)
        context = await stack.client.run(shell_job(max_context_tokens=800), wait=60)
        stack.llm.script = [finish_call()]
        whole = await stack.client.run(shell_job(), wait=60)
    assert turns.cut.model_dump() == {"budget": "max_turns", "setting": "max_turns", "limit": 2, "used": 2}
    assert (context.finish_reason, context.cut.budget, context.cut.setting) == (
        "max_context",
        "max_context",
        "max_context_tokens",
    )
    assert context.cut.limit == 800 and context.cut.used == len(context.prompt_ids) + len(context.response_ids)
    assert not turns.filter and whole.cut is None


@on_virtual_time
async def test_a_turn_longer_than_ten_minutes_is_not_cut_by_any_default_the_user_did_not_set():
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        stack.llm.cue(HANG)
        job = await stack.client.submit(shell_job(timeout_s=3600))
        await stack.llm.until(lambda: stack.llm.held == 1)
        await asyncio.sleep(900)  # virtual: a long-context turn still generating (it was cut at 600 s)
        stack.llm.release()
        trajectory = await stack.client.result(job.job_id, wait=60)
    assert (trajectory.reward, trajectory.error, trajectory.cut) == (1.0, None, None)
    assert trajectory.timings.run_s >= 900


@on_virtual_time
async def test_a_sandbox_delete_that_never_answers_does_not_hold_the_result_back():
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        stack.sandbox.cue("delete", HANG)
        # the sandbox client gives a delete 120 s; the result waits RELEASE_WAIT_S (10 s) of it at most
        trajectory = await stack.client.run(shell_job(), wait=RELEASE_WAIT_S + 5)
        assert (trajectory.reward, trajectory.error) == (1.0, None)
        assert stack.sandbox.held == 1 and len(stack.sandbox.boxes) == 1  # the delete goes on meanwhile
        await no_sandbox_left(stack)  # and deletes the sandbox once the runtime answers


@on_virtual_time
async def test_submitting_a_job_id_again_gives_back_that_job_and_runs_nothing_new():
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        body = shell_job(job_id="episode-7").model_dump(mode="json")
        first = await stack.http.post("/v1/jobs", json=body)
        again = await stack.http.post("/v1/jobs", json=body)
        assert (first.status, again.status) == (202, 200)
        assert (await first.json())["job_id"] == (await again.json())["job_id"] == "episode-7"
        trajectory = await stack.client.result("episode-7", wait=60)
        after = await stack.http.post("/v1/jobs", json=body)
        assert after.status == 200 and (await after.json())["state"] == "done"
        assert (await stack.client.result("episode-7", wait=0)) == trajectory
    assert len(stack.sandbox.created) == 1 and len(stack.llm.sampled) == 2


@on_virtual_time
async def test_an_unknown_task_is_refused_and_names_the_known_ones():
    async with rollout_stack() as stack:
        response = await stack.http.post("/v1/jobs", json={"task": "no-such-task"})
        assert response.status == 400
        message = (await response.json())["error"]
        assert "no-such-task" in message and "shell" in message
        assert stack.sandbox.created == [] and stack.llm.requests == []


@on_virtual_time
async def test_status_counts_jobs_by_state_while_they_run_and_once_they_finish():
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        assert (await stack.client.run(shell_job(), wait=60)).reward == 1.0

        stack.sandbox.cue("create", Fail(500), Fail(500))  # both init attempts fail
        failed = await stack.client.run(shell_job(), wait=60)
        assert failed.error.error_class == "init" and "no sandbox after 2 attempts" in failed.error.message

        stack.llm.cue(HANG)
        job = await stack.client.submit(shell_job())
        await stack.llm.until(lambda: stack.llm.held == 1)
        running = await stack.client.status()
        assert running.active["running"] == 1 and sum(running.active.values()) == 1
        await stack.client.cancel(job.job_id)

        status = await stack.client.status()
    assert status.finished == {"done": 1, "failed": 1, "cancelled": 1}
    assert sum(status.active.values()) == 0 and sum(status.queues.values()) == 0
    assert [server.url for server in status.llm_servers] == [stack.llm.url]


@on_virtual_time
async def test_init_retries_on_another_sandbox_runtime_when_one_cannot_create():
    async with rollout_stack(script=[finish_call()], sandbox_runtimes=2) as stack:
        broken, working = stack.sandboxes
        broken.cue("create", Fail(503, "out of capacity"))
        job = await stack.client.submit(shell_job())
        trajectory = await stack.client.result(job.job_id, wait=60)
        assert (trajectory.reward, trajectory.filter) == (1.0, False)
        assert (await stack.client.job(job.job_id)).attempts == 2
        assert broken.boxes == {} and len(working.created) == 1 and working.boxes == {}


@on_virtual_time
async def test_each_turn_is_tagged_with_the_policy_version_current_when_it_was_sampled():
    script = [Hang(then=bash_call("echo hi")), bash_call("echo again"), finish_call()]
    async with rollout_stack(script=script) as stack:
        job = await stack.client.submit(shell_job())
        await stack.llm.until(lambda: stack.llm.held == 1)
        assert await stack.client.set_policy_version(3) == 3  # while turn 0 is being sampled
        stack.llm.release()
        trajectory = await stack.client.result(job.job_id, wait=60)
    assert [turn.policy_version for turn in trajectory.turns] == [0, 3, 3]
    assert (trajectory.policy_version_min, trajectory.policy_version_max) == (0, 3)


@on_virtual_time
async def test_a_request_the_llm_server_refuses_fails_the_job_not_the_service():
    async with rollout_stack(script=[bash_call("echo hi"), finish_call()]) as stack:
        stack.llm.cue(Fail(400, "prompt has a token id out of range"))
        failed = await stack.client.run(shell_job(), wait=60)
        assert failed.error.error_class == "run" and "out of range" in failed.error.message and failed.filter
        assert (await stack.client.run(shell_job(), wait=60)).reward == 1.0
        assert stack.sandbox.boxes == {}


@on_virtual_time
async def test_a_job_cancelled_while_queued_never_gets_a_sandbox():
    async with rollout_stack(script=[finish_call()], pipeline={"max_init_workers": 1}) as stack:
        hold(stack, "init")
        first = await stack.client.submit(shell_job())
        await until_held(stack, "init")
        queued = await stack.client.submit(shell_job())  # the only init worker is busy
        assert (await stack.client.job(queued.job_id)).state == "queued"
        assert (await stack.client.cancel(queued.job_id)).state == "cancelled"
        stack.sandbox.release()
        assert (await stack.client.result(first.job_id, wait=60)).reward == 1.0
        assert [box.labels["job_id"] for box in stack.sandbox.created] == [first.job_id]
        assert (await stack.client.result(queued.job_id, wait=0)).error.error_class == "cancelled"


@on_virtual_time
async def test_time_spent_waiting_in_a_queue_is_not_charged_to_the_budget():
    async with rollout_stack(script=[finish_call()], pipeline={"max_run_workers": 1}) as stack:
        stack.llm.cue(HANG)
        slow = await stack.client.submit(shell_job())
        await stack.llm.until(lambda: stack.llm.held == 1)
        waiting = await stack.client.submit(shell_job(timeout_s=30))
        asyncio.get_running_loop().call_later(100.0, stack.llm.release)  # the only run worker is busy for 100 s
        trajectory = await stack.client.result(waiting.job_id, wait=600)
        assert (trajectory.error, trajectory.reward) == (None, 1.0)
        assert (await stack.client.result(slow.job_id, wait=60)).error is None


@on_virtual_time
async def test_a_caller_that_gives_up_waiting_cancels_its_job():
    async with rollout_stack(script=[finish_call()]) as stack:
        stack.llm.cue(HANG)
        with pytest.raises(TimeoutError):
            await stack.client.run(shell_job(job_id="impatient"), wait=30)
        assert (await stack.client.job("impatient")).state == "cancelled"
        await no_sandbox_left(stack)


@on_virtual_time
async def test_episodes_running_at_once_each_keep_their_own_context_and_sandbox():
    scripts = {
        "left": [Hang(then=bash_call("echo left")), finish_call("L")],
        "right": [bash_call("echo right"), bash_call("echo right again"), finish_call("R")],
    }
    async with rollout_stack(scripts=scripts) as stack:
        left = await stack.client.submit(shell_job("left"))
        await stack.llm.until(lambda: stack.llm.held == 1)
        right = await stack.client.submit(shell_job("right"))  # runs to the end while left is held
        right_trajectory = await stack.client.result(right.job_id, wait=60)
        stack.llm.release()
        left_trajectory = await stack.client.result(left.job_id, wait=60)
    for trajectory, words in [(left_trajectory, ["left"]), (right_trajectory, ["right", "right again"])]:
        commands = [c.arguments["command"] for turn in trajectory.turns for c in turn.tool_calls if c.name == "bash"]
        assert commands == [f"echo {word}" for word in words]
        assert [turn.observation for turn in trajectory.turns[:-1]] == [f"{word}\n[exit code 0]" for word in words]
        assert stack.chat.decode(trajectory.response_ids).count("echo") == len(words)
    box = next(box.id for box in stack.sandbox.created if box.labels["job_id"] == left.job_id)
    assert [detail for op, on, detail in stack.sandbox.log if (op, on) == ("exec", box)] == ["default: echo left"]
