"""The service's HTTP API endpoint by endpoint: each one's answer when all is well and its 4xx answers (a bad body,
the wrong content type, an unknown job, a bad `wait`, a missing or wrong token), /healthz, /metrics and
/v1/status. The service is `create_app` with in-process stand-ins for the LLM server, the sandbox runtime and the
tokenizer (tests/fakes); aiohttp's test client sends the raw requests."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from prorl_adapter import __version__
from prorl_adapter.hooks import hookimpl
from prorl_adapter.trainer.client import RolloutAPIError, RolloutClient
from tests.fakes import (
    HANG,
    ScriptedLLM,
    Stack,
    bash_call,
    finish_call,
    on_virtual_time,
    rollout_stack,
    shell_job,
)

SCRIPT = [bash_call("echo hi"), finish_call("42")]


async def error_of(response) -> tuple[int, str]:
    body = await response.json()
    assert body["status"] == response.status  # every failure is {"error", "status"}
    return response.status, body["error"]


async def held_job(stack: Stack) -> str:
    """A job whose first LLM call is held: it stays `running` until the stand-in is released."""
    stack.llm.cue(HANG)
    job = await stack.client.submit(shell_job())
    await stack.llm.until(lambda: stack.llm.held == 1)
    return job.job_id


# -- health, metrics, status ------------------------------------------------------------------------------
@on_virtual_time
async def test_healthz_says_ok_with_the_version_and_nothing_degraded():
    async with rollout_stack() as stack:
        response = await stack.http.get("/healthz")
        assert response.status == 200
        assert await response.json() == {"ok": True, "version": __version__, "degraded": None}


@on_virtual_time
async def test_metrics_count_finished_jobs_requests_and_the_decoupled_figures():
    async with rollout_stack(script=SCRIPT) as stack:
        await stack.client.run(shell_job(), wait=60)
        await stack.client.set_policy_version(2)
        response = await stack.http.get("/metrics")
        assert response.status == 200 and response.content_type == "text/plain"
        text = await response.text()
    assert 'prorl_rollout_jobs_finished_total{error_class="",state="done",task="shell"} 1.0' in text
    assert "prorl_rollout_policy_version 2.0" in text
    assert 'prorl_rollout_decoupled{figure="produced"} 0.0' in text
    assert 'prorl_rollout_decoupled{figure="admission_lock_lapses"} 0.0' in text
    assert 'prorl_rollout_jobs_in_flight{state="running"} 0.0' in text
    # requests are counted by route template, never by the raw path (one label per job id)
    assert 'route="/v1/jobs/{id}/result",status="200"' in text and "prorl_rollout_degraded 0.0" in text


@on_virtual_time
async def test_status_shows_the_pipeline_the_llm_servers_and_the_policy_version():
    async with rollout_stack(script=SCRIPT) as stack:
        job_id = await held_job(stack)
        await stack.client.set_policy_version(5)
        response = await stack.http.get("/v1/status")
        assert response.status == 200
        status = await response.json()
        await stack.client.cancel(job_id)
    assert status["policy_version"] == 5 and status["degraded"] is None
    assert status["active"]["running"] == 1 and status["finished"] == {"done": 0, "failed": 0, "cancelled": 0}
    assert set(status["queues"]) == {"init", "run", "eval"}
    assert status["workers"] == {"init": 4, "run": 8, "eval": 4}
    [server] = status["llm_servers"]
    assert (server["url"], server["healthy"], server["in_flight"]) == (stack.llm.url, True, 1)


@on_virtual_time
async def test_the_tasks_and_the_plugins_the_service_runs_with_are_listed():
    plugins = {"staleness": {"mode": "drop", "max_staleness": 3}}
    async with rollout_stack(plugin_config=plugins) as stack:
        tasks = await (await stack.http.get("/v1/tasks")).json()
        described = await (await stack.http.get("/v1/plugins")).json()
    assert {"shell", "python_math", "swe", "relay"} <= set(tasks["tasks"])
    assert described["config"] == plugins
    hooks = {plugin["name"]: plugin["hooks"] for plugin in described["plugins"]}
    assert "prorl_trajectory_weight" in hooks["staleness"] and "prorl_register_tasks" in hooks["builtin_tasks"]


# -- jobs -------------------------------------------------------------------------------------------------
@on_virtual_time
async def test_a_job_is_submitted_watched_and_its_result_fetched():
    async with rollout_stack(script=SCRIPT) as stack:
        submitted = await stack.http.post("/v1/jobs", json=shell_job(job_id="j-1").model_dump(mode="json"))
        assert submitted.status == 202
        assert (await submitted.json())["job_id"] == "j-1"
        result = await stack.http.get("/v1/jobs/j-1/result", params={"wait": "60"})
        assert result.status == 200
        trajectory = await result.json()
        assert (trajectory["job_id"], trajectory["finish_reason"], trajectory["reward"]) == ("j-1", "finish", 1.0)
        job = await stack.http.get("/v1/jobs/j-1")
        assert job.status == 200
        status = await job.json()
        assert (status["state"], status["task"], status["error"]) == ("done", "shell", None)


@on_virtual_time
async def test_the_result_of_a_running_job_is_its_status_with_202_until_it_is_done():
    async with rollout_stack(script=SCRIPT) as stack:
        job_id = await held_job(stack)
        for wait in ("0", "30"):  # 30 virtual seconds of long poll: still running
            response = await stack.http.get(f"/v1/jobs/{job_id}/result", params={"wait": wait})
            assert response.status == 202 and (await response.json())["state"] == "running"
        polling = asyncio.create_task(stack.http.get(f"/v1/jobs/{job_id}/result", params={"wait": "600"}))
        stack.llm.release()
        response = await polling
        assert response.status == 200 and (await response.json())["finish_reason"] == "finish"


@on_virtual_time
async def test_a_job_is_cancelled_through_the_api():
    async with rollout_stack(script=SCRIPT) as stack:
        job_id = await held_job(stack)
        response = await stack.http.delete(f"/v1/jobs/{job_id}")
        assert response.status == 200
        status = await response.json()
        assert status["state"] == "cancelled" and status["error"]["error_class"] == "cancelled"


@pytest.mark.parametrize(
    ("body", "content_type", "status", "says"),
    [
        (b'{"task": "shell",', "application/json", 400, "invalid request body"),
        (b"", "application/json", 400, "a JSON body is required"),
        (b'{"task": "shell"}', "text/plain", 415, "Content-Type: application/json"),
        (b'{"task": "shell", "max_turn": 3}', "application/json", 400, "max_turn"),
        (b'{"task": "shell", "max_turns": 0}', "application/json", 400, "max_turns"),
        (b'{"task": "shell", "job_id": "a/b"}', "application/json", 400, "job_id"),
        (b'{"instance": {}}', "application/json", 400, "task"),
        (b'{"task": "shell", "attempt": 5}', "application/json", 400, "attempt and retry_of are set by the service"),
        (b'{"task": "shell", "retry_of": "p0"}', "application/json", 400, "attempt and retry_of"),
    ],
)
@on_virtual_time
async def test_a_bad_job_request_is_refused_with_what_is_wrong(body, content_type, status, says):
    async with rollout_stack() as stack:
        response = await stack.http.post("/v1/jobs", data=body, headers={"Content-Type": content_type})
        code, message = await error_of(response)
        assert code == status and says in message
        assert stack.sandbox.created == []


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/v1/jobs/nope"), ("GET", "/v1/jobs/nope/result"), ("DELETE", "/v1/jobs/nope")],
)
@on_virtual_time
async def test_an_unknown_job_is_404(method, path):
    async with rollout_stack() as stack:
        assert await error_of(await stack.http.request(method, path)) == (404, "no job 'nope'")


@pytest.mark.parametrize("wait", ["soon", "-1", "3601", "nan"])
@on_virtual_time
async def test_a_bad_wait_is_400(wait):
    async with rollout_stack(script=SCRIPT) as stack:
        job = await stack.client.submit(shell_job())
        code, message = await error_of(await stack.http.get(f"/v1/jobs/{job.job_id}/result", params={"wait": wait}))
        assert code == 400 and "wait" in message


# -- the policy version and the LLM servers ---------------------------------------------------------------
class VersionClaimingBackend:
    """A backend plugin loaded where it does not belong, in the service: it claims version 99 if asked."""

    asked = 0

    @hookimpl
    def prorl_backend_policy_version(self, batch: Any) -> int:
        VersionClaimingBackend.asked += 1
        return 99


@on_virtual_time
async def test_the_service_tags_turns_with_the_api_version_and_never_asks_a_backend():
    VersionClaimingBackend.asked = 0
    async with rollout_stack(SCRIPT, plugins=(f"{__name__}:VersionClaimingBackend",)) as stack:
        await stack.client.set_policy_version(3)
        trajectory = await stack.client.run(shell_job(), wait=600)
        assert (await stack.client.status()).policy_version == 3
    assert [turn.policy_version for turn in trajectory.turns] == [3, 3]
    assert VersionClaimingBackend.asked == 0  # the driver asks backends, in the trainer's process


@on_virtual_time
async def test_the_policy_version_is_set_and_raise_only_never_moves_it_back():
    async with rollout_stack() as stack:
        put = stack.http.put
        assert await (await put("/v1/policy-version", json={"version": 3})).json() == {"version": 3}
        assert await (await put("/v1/policy-version", json={"version": 2, "raise_only": True})).json() == {"version": 3}
        assert await (await put("/v1/policy-version", json={"version": 2})).json() == {"version": 2}
        for bad in ({"version": -1}, {"version": 1, "raise": True}, {}):
            assert (await error_of(await put("/v1/policy-version", json=bad)))[0] == 400


@on_virtual_time
async def test_llm_servers_are_listed_added_replaced_and_removed():
    async with rollout_stack() as stack, ScriptedLLM() as other:
        listed = await (await stack.http.get("/v1/llm-servers")).json()
        assert [s["url"] for s in listed["servers"]] == [stack.llm.url]

        added = await stack.http.post("/v1/llm-servers", json={"url": other.url})
        assert added.status == 201
        assert (await added.json())["healthy"] is True  # checked at once
        assert [s.url for s in await stack.client.llm_servers()] == [stack.llm.url, other.url]

        replaced = await stack.http.put("/v1/llm-servers", json={"urls": [other.url]})
        assert [s["url"] for s in (await replaced.json())["servers"]] == [other.url]
        removed = await stack.http.delete("/v1/llm-servers", params={"url": stack.llm.url})
        assert await removed.json() == {"url": stack.llm.url, "removed": False}  # gone already: not an error
        assert await stack.client.remove_llm_server(other.url) is True
        assert await stack.client.llm_servers() == []


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/llm-servers", {"url": "ftp://example.com"}),
        ("POST", "/v1/llm-servers", {"url": "http://a b"}),
        ("PUT", "/v1/llm-servers", {"urls": []}),
        ("DELETE", "/v1/llm-servers", None),
    ],
)
@on_virtual_time
async def test_a_bad_llm_server_request_is_400(method, path, body):
    async with rollout_stack() as stack:
        response = await stack.http.request(method, path, json=body)
        assert (await error_of(response))[0] == 400
        assert [s.url for s in await stack.client.llm_servers()] == [stack.llm.url]


# -- decoupled mode's endpoints ---------------------------------------------------------------------------
@on_virtual_time
async def test_the_decoupled_endpoints_answer_and_refuse_bad_bodies():
    async with rollout_stack(script=[finish_call()]) as stack:
        queued = await stack.http.post("/v1/prompts", json={"requests": [shell_job(job_id="p").model_dump()]})
        assert queued.status == 202 and set(await queued.json()) == {"upcoming"}
        batch = await stack.http.post("/v1/batches", json={"size": 1, "timeout_s": 600})
        assert batch.status == 200
        [item] = (await batch.json())["items"]
        ack = await stack.http.post("/v1/batches/ack", json={"ids": [item["id"]]})
        assert await ack.json() == {"acknowledged": 1}
        buffer = await (await stack.http.get("/v1/buffer")).json()
        assert (buffer["acked"], buffer["produced"], buffer["degraded"]) == (1, 1, None)

        for path, bad in [
            ("/v1/batches", {"size": 0}),
            ("/v1/batches", {"size": 1, "lease_s": 0}),
            ("/v1/batches/ack", {"ids": []}),
            ("/v1/prompts", {"requests": [{"task": "shell", "max_turns": -1}]}),
            ("/v1/prompts", {"requests": [{"task": "shell", "attempt": 1000}]}),
        ]:
            assert (await error_of(await stack.http.post(path, json=bad)))[0] == 400, (path, bad)


# -- who may call ----------------------------------------------------------------------------------------
@on_virtual_time
async def test_with_a_token_every_endpoint_but_healthz_needs_it():
    async with rollout_stack(script=SCRIPT, token="s3cret") as stack:
        assert (await stack.http.get("/healthz")).status == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path in [("GET", "/v1/status"), ("GET", "/metrics"), ("POST", "/v1/jobs")]:
                response = await stack.http.request(method, path, headers=headers, json={"task": "shell"})
                assert (await error_of(response))[0] == 401, (method, path, headers)
        assert stack.sandbox.created == []

        assert (await stack.client.run(shell_job(), wait=60)).reward == 1.0  # the client sends the token
        async with RolloutClient(stack.url, token="wrong") as stranger:
            with pytest.raises(RolloutAPIError) as refused:
                await stranger.status()
        assert refused.value.status == 401


@pytest.mark.parametrize(
    "headers", [{"Host": "attacker.example"}, {"Origin": "http://attacker.example"}], ids=["rebinding", "cross-site"]
)
@on_virtual_time
async def test_without_a_token_requests_a_browser_page_could_send_are_refused(headers):
    async with rollout_stack() as stack:
        body = json.dumps({"task": "shell"})
        response = await stack.http.post("/v1/jobs", data=body, headers={"Content-Type": "text/plain", **headers})
        assert (await error_of(response))[0] == 403
        assert stack.sandbox.created == []
