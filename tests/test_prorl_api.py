"""ProRL Agent's legacy API (prorl_api.py) on the in-process stand-ins: its calls with their shapes and status
codes, the /process result built from the trajectory (every message's token ids, joined, are the episode's ids),
sampling_params mapped key by key, job ids shared by samples, /cancel and /stop, data_source aliases, and the
LLM pool speaking SGLang's and ProRL's /generate (against the scripted LLM stand-in in those protocols)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from prorl_adapter.service.prorl_api import DEFAULT_MAX_ITERATIONS
from prorl_adapter.service.server import LLM
from tests.fakes import (
    CHECK,
    HANG,
    ScriptedLLM,
    bash_call,
    finish_call,
    on_virtual_time,
    rollout_stack,
    shell_job,
    tool_call,
)

SCRIPT = [bash_call("echo hi"), finish_call("42")]
SHELL_ROW = {"data_source": "shell", "goal": "reach the goal", "check": CHECK, "instance_id": "row-7"}


async def call(stack, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    response = await stack.http.request(method, path, json=body)
    return response.status, await response.json()


async def started(stack) -> None:
    assert await call(stack, "POST", "/start") == (200, {"status": "Server started successfully"})


@on_virtual_time
async def test_start_stop_and_status_answer_as_prorls_server():
    async with rollout_stack(script=SCRIPT) as stack:
        not_running = {"detail": "Server is not running. Please start the server first."}
        for method, path, body in [
            ("GET", "/status", None),
            ("POST", "/stop", None),
            ("POST", "/cancel", {"job_id": "x"}),
            ("POST", "/process", {"instance": SHELL_ROW}),
        ]:
            assert await call(stack, method, path, body) == (503, not_running), path
        await started(stack)
        assert await call(stack, "POST", "/start") == (400, {"detail": "Server is already running"})
        status, body = await call(stack, "GET", "/status")
        assert status == 200
        assert body == {
            "status": "running",
            "pending_jobs": 0,
            "running": True,
            "jobs": 0,
            "init": 0,
            "run": 0,
            "eval": 0,
        }
        assert await call(stack, "POST", "/stop") == (200, {"status": "Server stopped successfully"})
        assert (await call(stack, "GET", "/status"))[0] == 503


@on_virtual_time
async def test_process_answers_prorls_result_built_from_the_token_level_trajectory():
    async with rollout_stack(script=SCRIPT) as stack:
        await started(stack)
        sampling = {"temperature": 0.5, "max_iterations": 4, "token_level_generation": True, "top_k": 5}
        status, result = await call(
            stack, "POST", "/process", {"instance": {**SHELL_ROW, "trajectory_id": 3}, "sampling_params": sampling}
        )
        assert status == 200
        trajectory = await stack.client.result(result["job_id"], wait=10)

    assert [m["role"] for m in result["messages"]] == ["system", "user", "assistant", "tool", "assistant"]
    joined = [token for message in result["messages"] for token in message["token_ids"]]
    assert joined == trajectory.prompt_ids + trajectory.response_ids
    first, second = stack.llm.sampled
    assistants = [m for m in result["messages"] if m["role"] == "assistant"]
    assert [a["token_ids"] for a in assistants] == [first.token_ids, second.token_ids]
    assert [a["logprobs"] for a in assistants] == [first.logprobs, second.logprobs]
    assert [a["input_ids"] for a in assistants] == [first.prompt_ids, second.prompt_ids]  # each call's whole prompt
    assert assistants[0]["tool_calls"] == [{"name": "bash", "arguments": '{"command": "echo hi"}'}]
    assert all(m["input_ids"] is None and m["logprobs"] is None for m in result["messages"] if m["role"] != "assistant")
    assert "tool_calls" not in result["messages"][0]
    assert (result["instance_id"], result["trajectory_id"]) == ("row-7", 3)
    assert (result["resolved"], result["success"], result["finish"], result["end_properly"]) == (True,) * 4
    assert (result["error"], result["critical_error"], result["filter"]) == (None, None, False)
    assert [tool["function"]["name"] for tool in result["tools"]] == ["bash", "finish"]
    timing = result["timing"]
    assert timing["counted_elapsed"] == pytest.approx(timing["init_time"] + timing["run_time"] + timing["eval_time"])
    assert timing["timeout_triggered"] is False
    assert stack.llm.requests[0]["temperature"] == 0.5
    assert trajectory.labels["prorl_ignored"] == "top_k"  # not applied here, and said so; token_level_generation is
    assert trajectory.labels["prorl_data_source"] == "shell"


@on_virtual_time
async def test_sampling_params_become_turns_tokens_per_turn_and_context():
    script = [bash_call("echo 1"), bash_call("echo 2"), bash_call("echo 3"), finish_call()]
    async with rollout_stack(script=script) as stack:
        await started(stack)
        _, default = await call(stack, "POST", "/process", {"instance": SHELL_ROW})
        sampling = {"max_iterations": 3, "max_output_tokens": 40, "max_model_len": 100_000}
        _, asked = await call(stack, "POST", "/process", {"instance": SHELL_ROW, "sampling_params": sampling})
        too_small = await call(
            stack, "POST", "/process", {"instance": SHELL_ROW, "sampling_params": {"max_model_len": 10}}
        )
        bad = await call(stack, "POST", "/process", {"instance": SHELL_ROW, "sampling_params": {"temperature": "hot"}})

    assert sum(m["role"] == "assistant" for m in default["messages"]) == DEFAULT_MAX_ITERATIONS  # ProRL's default
    assert sum(m["role"] == "assistant" for m in asked["messages"]) == 3
    assert [r["max_tokens"] for r in stack.llm.requests[2:5]] == [40, 40, 40]
    assert asked["end_properly"] is False  # its last turn was cut at 40 tokens: ProRL's "length"
    status, result = too_small  # the prompt alone is over the context: the run fails, and is filtered
    assert (status, result["messages"], result["critical_error"], result["filter"]) == (200, [], "run", True)
    assert bad[0] == 400 and "temperature" in bad[1]["error"]


@on_virtual_time
async def test_samples_sharing_a_job_id_each_run_their_own_episode_and_cancel_names_them_all():
    async with rollout_stack(script=[HANG]) as stack:
        await started(stack)
        body = {"instance": SHELL_ROW, "job_id": "django__django-11099"}
        calls = [asyncio.create_task(call(stack, "POST", "/process", body)) for _ in range(3)]
        await stack.llm.until(lambda: stack.llm.held == 3)
        assert (await call(stack, "GET", "/status"))[1]["pending_jobs"] == 3
        assert await call(stack, "POST", "/cancel", {"job_id": "django__django-11099"}) == (
            200,
            {"status": "Cancel requested for job django__django-11099"},
        )
        answers = await asyncio.gather(*calls)
        stack.llm.release()
        unknown = await call(stack, "POST", "/cancel", {"job_id": "unknown"})
    assert len({result["job_id"] for _, result in answers}) == 3
    for status, result in answers:
        assert (status, result["success"], result["filter"], result["resolved"]) == (200, False, True, False)
    assert unknown == (200, {"status": "Cancel requested for job unknown"})


@on_virtual_time
async def test_stop_cancels_the_calls_in_flight_with_a_500():
    async with rollout_stack(script=[HANG]) as stack:
        await started(stack)
        pending = asyncio.create_task(call(stack, "POST", "/process", {"instance": SHELL_ROW}))
        await stack.llm.until(lambda: stack.llm.held == 1)
        assert (await call(stack, "POST", "/stop"))[0] == 200
        assert await pending == (500, {"detail": "Failed to process job: Server is stopping; job cancelled"})
        stack.llm.release()
        await stack.sandbox.until(lambda: not stack.sandbox.boxes)  # its sandbox is gone too


DEEPSCALER_ROW = {
    "data_source": "deepscaler",
    "prompt": '[{"content": "What is 17 * 23?", "role": "user"}]',  # as parquet rows keep it: a JSON string
    "reward_model": {"ground_truth": "391", "style": "rule"},
    "instance_id": "math-1",
}


@on_virtual_time
async def test_prorl_data_sources_map_to_tasks_and_rows_they_cannot_serve_are_a_400_naming_what_is_missing():
    script = [tool_call("python", code="print(17 * 23)"), finish_call(r"\boxed{391}")]
    async with rollout_stack(script=script) as stack:
        await started(stack)
        status, math = await call(stack, "POST", "/process", {"instance": DEEPSCALER_ROW})
        swe_gym_row = {"data_source": "swebench", "instance_id": "astropy__astropy-12907", "repo": "astropy/astropy"}
        swe = await call(stack, "POST", "/process", {"instance": swe_gym_row})
        bad_row = {
            **swe_gym_row,
            "files": "calc.py",
            "test_files": {"t.py": ""},
            "test_command": "pytest",
            "problem_statement": "x",
        }
        bad_swe = await call(stack, "POST", "/process", {"instance": bad_row})
        default = await call(stack, "POST", "/process", {"instance": {"instance_id": "no-source"}})
        coder = await call(stack, "POST", "/process", {"instance": {"data_source": "deepcoder", "prompt": "x"}})
        no_prompt = await call(stack, "POST", "/process", {"instance": {"data_source": "deepscaler"}})

    assert (status, math["resolved"], math["instance_id"]) == (200, True, "math-1")
    assert "What is 17 * 23?" in math["messages"][1]["content"]
    assert swe[0] == 400 and "'files'" in swe[1]["error"] and "astropy__astropy-12907" in swe[1]["error"]
    assert bad_swe[0] == 400 and "'files' must map each path to its content" in bad_swe[1]["error"]
    assert default[0] == 400 and "swebench" in default[1]["error"]  # ProRL's default data_source
    assert coder[0] == 400 and "'deepcoder' has no task here" in coder[1]["error"] and "deepscaler" in coder[1]["error"]
    assert no_prompt[0] == 400 and "'prompt'" in no_prompt[1]["error"]


@on_virtual_time
async def test_llm_servers_are_cleared_and_added_with_a_200_as_prorls_clients_expect():
    async with rollout_stack(script=SCRIPT) as stack:
        assert await call(stack, "POST", "/clear_llm_server") == (200, {"status": "Cleared all LLM server addresses"})
        assert await stack.client.llm_servers() == []
        address = stack.llm.url + "/v1"  # NeMo Gym sends the OpenAI base URL
        assert await call(stack, "POST", "/add_llm_server", {"address": address}) == (
            200,
            {"status": f"Added LLM server address: {address}"},
        )
        [server] = await stack.client.llm_servers()
        assert (server.url, server.protocol, server.healthy) == (stack.llm.url, "openai", True)
        assert (await call(stack, "POST", "/add_llm_server", {"address": "not a url"}))[0] == 400


@pytest.mark.parametrize("protocol", ["openai", "sglang", "prorl"])
@pytest.mark.parametrize("named", [False, True], ids=["probed", "named"])
@on_virtual_time
async def test_an_episode_runs_over_each_llm_protocol_with_the_ids_and_logprobs_it_sampled(protocol, named):
    async with ScriptedLLM(SCRIPT, protocol=protocol) as other, rollout_stack(script=SCRIPT) as stack:
        url = f"{protocol}+{other.url}" if named else other.url
        [server] = await stack.client.set_llm_servers([url])
        assert (server.protocol, server.healthy) == (protocol, True)
        trajectory = await stack.client.run(shell_job(), wait=60)

    first, second = [s for s in other.sampled if s.prompt_ids != [0]]  # not ProRL's one-token health checks
    assert trajectory.turns[0].text == first.text and trajectory.turns[0].tool_calls[0].name == "bash"
    start = trajectory.turns[1].response_start
    assert trajectory.response_ids[start:] == second.token_ids
    assert trajectory.response_logprobs[: len(first.logprobs)] == first.logprobs
    assert (trajectory.error, trajectory.reward) == (None, 1.0)
    assert stack.llm.sampled == []  # nothing went to the first server


@on_virtual_time
async def test_a_prorl_generate_server_that_stops_answering_is_marked_down():
    async with ScriptedLLM(SCRIPT, protocol="prorl") as other, rollout_stack(script=SCRIPT) as stack:
        await stack.client.set_llm_servers([other.url])
        other.down = True  # its /generate answers 503: the one-token health check fails
        await stack.app[LLM].check_health()
        [server] = await stack.client.llm_servers()
    assert (server.protocol, server.healthy) == ("prorl", False)


@on_virtual_time
async def test_a_null_is_the_default_a_stop_string_is_a_list_and_a_turn_may_fill_the_context():
    async with rollout_stack(script=SCRIPT) as stack:
        await started(stack)
        sampling = {"max_iterations": None, "stop": "</s>", "max_model_len": 3000}
        status, _ = await call(stack, "POST", "/process", {"instance": SHELL_ROW, "sampling_params": sampling})
    assert status == 200
    first = stack.llm.requests[0]
    assert first["stop"] == ["</s>"]
    prompt = len(stack.llm.sampled[0].prompt_ids)
    assert first["max_tokens"] == 3000 - prompt  # no per-turn limit asked for: the context left, as ProRL's


@on_virtual_time
async def test_one_base_url_is_one_server_and_a_named_protocol_is_kept():
    async with rollout_stack(script=SCRIPT) as stack:
        await stack.client.set_llm_servers([stack.llm.url + "/v1/"])
        await stack.client.add_llm_server(f"openai+{stack.llm.url}")
        [server] = await stack.client.llm_servers()
        assert (server.url, server.protocol, server.healthy) == (f"openai+{stack.llm.url}", "openai", True)
        assert await stack.client.remove_llm_server(stack.llm.url) is True
        assert await stack.client.llm_servers() == []


@on_virtual_time
async def test_a_route_that_answers_garbage_does_not_make_a_server_sglang():
    llm = ScriptedLLM(SCRIPT)

    async def not_json(request):
        return web.Response(body=b"\xff\xfe model_path", content_type="application/json")

    llm.app.router.add_get("/get_model_info", not_json)
    async with llm, rollout_stack(script=SCRIPT) as stack:
        [server] = await stack.client.set_llm_servers([llm.url])
    assert (server.protocol, server.healthy) == ("openai", True)
