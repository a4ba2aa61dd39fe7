"""Back-pressure between the stages (init_gate.py): whatever the backlog, init makes a sandbox only when the run
stage can take its episode, so the live sandboxes stay within the run limit plus the margin plus the eval
workers'. The service is the real one, the runtime and the LLM server in-process stand-ins, time virtual."""

from __future__ import annotations

import asyncio

from tests.fakes import HANG, finish_call, on_virtual_time, rollout_stack, shell_job

RUN, INIT, EVAL, AHEAD = 8, 4, 4, 2
BACKLOG = 1000


async def gate(stack) -> dict:
    return (await stack.client.status()).init_gate.model_dump()


async def until_gate(stack, condition) -> dict:
    """The gate's state once `condition` holds of it, read again every virtual half second (the service says
    nothing to a stand-in when its counts change)."""
    while not condition(state := await gate(stack)):
        await asyncio.sleep(0.5)
    return state


@on_virtual_time
async def test_a_backlog_of_a_thousand_jobs_keeps_the_live_sandboxes_within_the_bound():
    workers = {"max_run_workers": RUN, "max_init_workers": INIT, "max_eval_workers": EVAL, "init_ahead": AHEAD}
    async with rollout_stack(script=[finish_call("42")], pipeline=workers) as stack:
        stack.llm.cue(*[HANG] * RUN)  # the first episodes hold the run stage full
        for start in range(0, BACKLOG, 250):
            await stack.client.submit(shell_job(num_samples=250, job_id=f"backlog-{start}"))
        await stack.llm.until(lambda: stack.llm.held == RUN)
        # The run stage is full and the margin made ready: init makes no more, and every init worker waits.
        await stack.sandbox.until(lambda: len(stack.sandbox.boxes) == RUN + AHEAD)
        state = await gate(stack)
        assert (state["bound"], state["running"], state["ahead"]) == (RUN + AHEAD, RUN, AHEAD)
        status = await stack.client.status()
        assert status.queues["init"] >= BACKLOG - RUN - AHEAD - INIT

        stack.llm.release()
        ids = [f"backlog-{start}.{i}" for start in range(0, BACKLOG, 250) for i in range(250)]
        results = [await stack.client.result(job_id, wait=3600) for job_id in ids]
        assert (await gate(stack))["ahead"] == 0  # init workers waiting for jobs hold none

    assert all(r.error is None and r.reward == 1.0 for r in results), [r.error for r in results if r.error][:3]
    assert len(stack.sandbox.created) == BACKLOG and not stack.sandbox.boxes
    # every sandbox alive at once: in the run stage, made ready for it, or with an eval worker
    assert stack.sandbox.peak <= RUN + AHEAD + EVAL


@on_virtual_time
async def test_a_stalled_eval_stage_holds_init_back_too():
    workers = {"max_run_workers": RUN, "max_init_workers": INIT, "max_eval_workers": EVAL, "init_ahead": AHEAD}
    async with rollout_stack(script=[finish_call("42")], pipeline=workers) as stack:
        stack.sandbox.cue("run", *[HANG] * 200)  # every grading waits
        await stack.client.submit(shell_job(num_samples=200, job_id="stalled"))
        # Episodes run and wait for an eval worker, each holding its sandbox: they count, and init stops.
        await until_gate(stack, lambda state: state["waiting_for_eval"] == RUN + AHEAD)
        assert stack.sandbox.held == EVAL and len(stack.sandbox.boxes) == RUN + AHEAD + EVAL
        state = await gate(stack)
        assert (state["ahead"], state["running"], state["waiting"]) == (0, 0, INIT)
        stack.sandbox.uncue("run")  # the next gradings answer at once
        stack.sandbox.release()
        results = [await stack.client.result(f"stalled.{i}", wait=3600) for i in range(200)]
    assert all(r.error is None for r in results)
    assert stack.sandbox.peak <= RUN + AHEAD + EVAL
