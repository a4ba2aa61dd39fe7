"""The LLM gateway's HTTP surface and the GRPO groups of one submission, against the in-process rig (the LLM
and sandbox stand-ins of tests/fakes; the real parts are in integration_tests/test_gateway.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.server import PIPELINE

from .fakes.llm import bash_call
from .fakes.rigs import rollout_stack, shell_job

USER = [{"role": "user", "content": "list the files"}]


def open_episode(stack, **request):
    return stack.app[PIPELINE].gateway.open("job-1", JobRequest(task="shell", **request))


async def chat(stack, key: str, **body):
    return await stack.gateway.post(f"/gateway/{key}/v1/chat/completions", json={"model": "any", **body})


async def test_a_chat_turn_answers_with_tool_calls_and_the_next_extends_its_ids():
    async with rollout_stack(script=[bash_call("ls"), "all done"]) as stack:
        episode = open_episode(stack)
        first = await chat(stack, episode.key, messages=USER)
        assert first.status == 200
        answer = await first.json()
        message = answer["choices"][0]["message"]
        assert answer["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
        [call] = message["tool_calls"]
        assert call["function"]["name"] == "bash" and json.loads(call["function"]["arguments"]) == {"command": "ls"}
        history = answer["prompt_token_ids"] + answer["choices"][0]["token_ids"]
        sent_back = [*USER, message, {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]
        second = await (await chat(stack, episode.key, messages=sent_back)).json()
        assert second["prompt_token_ids"][: len(history)] == history
        assert second["choices"][0] == {**second["choices"][0], "finish_reason": "stop"}
        assert second["choices"][0]["message"]["content"] == "all done"
        segments, turns = episode.log.segments()
        assert len(segments) == 1 and len(turns) == 2 and turns[0].tool_calls[0].name == "bash"


async def test_a_streamed_turn_is_openais_chunks_ending_with_done():
    async with rollout_stack(script=[bash_call("pwd")]) as stack:
        episode = open_episode(stack)
        reply = await chat(stack, episode.key, messages=USER, stream=True, stream_options={"include_usage": True})
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/event-stream")
        events = [line[len("data: ") :] for line in (await reply.text()).splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        calls = [
            c["choices"][0]["delta"]["tool_calls"]
            for c in chunks
            if c["choices"] and "tool_calls" in c["choices"][0]["delta"]
        ]
        assert calls[0][0]["function"]["name"] == "bash" and calls[0][0]["index"] == 0
        finishes = [
            c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        assert finishes == ["tool_calls"]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


async def test_a_completion_of_token_ids_returns_text_ids_and_logprobs():
    async with rollout_stack(script=["hello"]) as stack:
        episode = open_episode(stack)
        prompt = stack.chat.encode("say hello")
        reply = await stack.gateway.post(
            f"/gateway/{episode.key}/v1/completions", json={"model": "m", "prompt": prompt, "logprobs": 1}
        )
        assert reply.status == 200
        answer = await reply.json()
        choice = answer["choices"][0]
        assert answer["prompt_token_ids"] == prompt and stack.chat.decode(choice["token_ids"]).startswith("hello")
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
        models = await (await stack.gateway.get(f"/gateway/{episode.key}/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["char-chat"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"messages": []}, "messages"),
        ({"messages": USER, "n": 2}, "n"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": "hello"}, "messages"),
    ],
)
async def test_bad_calls_are_a_400_and_nothing_is_recorded(body, message):
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        reply = await chat(stack, episode.key, **body)
        assert reply.status == 400 and message in (await reply.json())["error"]["message"]
        assert episode.log.calls == [] and stack.llm.sampled == []


async def test_fields_a_harness_sends_that_change_nothing_are_accepted():
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        extra = {"user": "u", "store": False, "metadata": {"a": "b"}, "presence_penalty": 0.0, "temperature": 0.2}
        assert (await chat(stack, episode.key, messages=USER, **extra)).status == 200
        assert stack.llm.requests[-1]["temperature"] == 1.0  # the job's sampling settings hold


async def test_the_turn_limit_and_the_context_are_the_jobs():
    async with rollout_stack(script=["x", "y"]) as stack:
        episode = open_episode(stack, max_turns=1)
        assert (await chat(stack, episode.key, messages=USER)).status == 200
        over = await chat(stack, episode.key, messages=USER)
        assert over.status == 400 and "max_turns=1" in (await over.json())["error"]["message"]
        small = open_episode(stack, max_context_tokens=5)
        full = await chat(stack, small.key, messages=USER)
        assert full.status == 400 and "max_context_tokens" in (await full.json())["error"]["message"]


async def test_a_call_over_the_turn_limit_is_refused_before_its_body_is_read():
    """Headers announcing 4 MiB and no body at all: the refusal comes without waiting for it (before the fix, the
    gateway read and parsed the whole body, so this client, which never sends it, got no answer)."""
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack, max_turns=1)
        assert (await chat(stack, episode.key, messages=USER)).status == 200
        reader, writer = await asyncio.open_connection(stack.gateway.host, stack.gateway.port)
        try:
            path = f"/gateway/{episode.key}/v1/chat/completions"
            writer.write(
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {4 * 1024 * 1024}\r\n\r\n".encode()
            )
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=30)
            length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))[15:])
            body = json.loads(await asyncio.wait_for(reader.readexactly(length), timeout=30))
        finally:
            writer.close()
        assert head.startswith(b"HTTP/1.1 400 ") and "max_turns=1" in body["error"]["message"]
        assert episode.calls_started == 1  # the refused call counted no turn


async def test_keys_of_no_running_episode_are_refused_and_no_token_is_needed_for_the_gateway():
    async with rollout_stack(script=["x"], token="secret") as stack:
        episode = open_episode(stack)
        assert (await chat(stack, episode.key, messages=USER)).status == 200  # the key is the credential
        assert (await stack.http.get("/v1/status")).status == 401  # the rest of the API keeps its token
        stack.app[PIPELINE].gateway.close(episode)
        after = await chat(stack, episode.key, messages=USER)
        assert after.status == 404 and len(episode.log.calls) == 1
        assert (await chat(stack, "made-up-key", messages=USER)).status == 404


async def test_the_gateways_port_serves_the_gateway_and_nothing_else():
    """What a sandbox's code reaches through its forward: the gateway's paths, never the service's API (jobs,
    batches, the policy version), with or without the service's token."""
    async with rollout_stack(script=["x"]) as stack:
        for method, path in (("GET", "/v1/status"), ("POST", "/v1/jobs"), ("PUT", "/v1/policy-version")):
            assert (await stack.gateway.request(method, path, json={})).status == 404
        episode = open_episode(stack)
        assert (await stack.http.post(f"/gateway/{episode.key}/v1/chat/completions", json={})).status == 404


async def test_one_submission_of_num_samples_is_one_group_and_idempotent():
    async with rollout_stack() as stack:
        request = shell_job(job_id="row-7", num_samples=3, sampling={"seed": 10})
        first = await stack.http.post("/v1/jobs", json=request.model_dump(mode="json"))
        status = await first.json()
        assert first.status == 202 and status["samples"] == ["row-7.0", "row-7.1", "row-7.2"]
        trajectories = [await stack.client.result(job_id, wait=60) for job_id in status["samples"]]
        assert {t.group for t in trajectories} == {"row-7"}
        seeds = [r["seed"] for r in stack.llm.requests]
        assert sorted(set(seeds)) == [10, 11, 12]  # one seed per sample, or they would all be one episode
        again = await stack.http.post("/v1/jobs", json=request.model_dump(mode="json"))
        assert again.status == 200 and (await again.json())["samples"] == status["samples"]


async def test_a_group_conflicting_with_an_existing_job_is_refused_whole():
    async with rollout_stack() as stack:
        await stack.client.run(shell_job(job_id="g.1"), wait=60)
        before = len(stack.app[PIPELINE].jobs)
        reply = await stack.http.post("/v1/jobs", json=shell_job(job_id="g", num_samples=2).model_dump(mode="json"))
        assert reply.status == 409 and "g.1" in (await reply.json())["error"]
        assert len(stack.app[PIPELINE].jobs) == before  # g.0 was not queued either


async def test_decoupled_prompts_with_num_samples_are_one_group_each():
    async with rollout_stack() as stack:
        assert await stack.client.enqueue_prompts([shell_job(num_samples=2), shell_job(num_samples=2)]) == 4
        batch = await stack.client.take_batch(4, timeout=60)
        groups = [item.group for item in batch.items]
        assert len(batch.items) == 4 and len(set(groups)) == 2 and all(groups.count(g) == 2 for g in groups)


@pytest.mark.parametrize(
    "calls",
    [[{"function": None}], [{"function": "bash"}], [{"id": "a"}], [{"function": {"arguments": "{}"}}]],
)
async def test_malformed_tool_calls_sent_back_are_a_400(calls):
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        messages = [*USER, {"role": "assistant", "content": None, "tool_calls": calls}]
        reply = await chat(stack, episode.key, messages=messages)
        assert reply.status == 400 and "tool_calls" in (await reply.json())["error"]["message"]
        assert episode.log.calls == []


async def test_the_developer_role_is_rendered_as_system():
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        answer = await (await chat(stack, episode.key, messages=[{"role": "developer", "content": "be brief"}])).json()
        assert "<|im_start|>system\nbe brief" in stack.chat.decode(answer["prompt_token_ids"])


async def test_a_call_without_a_running_episodes_key_is_refused_before_its_body_is_read():
    async with rollout_stack(script=["x"]) as stack:
        reply = await stack.gateway.post("/gateway/nobody/v1/chat/completions", data=b"not json at all")
        assert reply.status == 404  # not the body's 400: no key, nothing parsed


async def test_an_episode_has_a_few_calls_in_flight_and_the_rest_wait():
    from prorl_adapter.service.gateway import CALLS_IN_FLIGHT

    from .fakes.standin import HANG

    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        stack.llm.cue(*[HANG] * CALLS_IN_FLIGHT)
        calls = [asyncio.ensure_future(chat(stack, episode.key, messages=USER)) for _ in range(CALLS_IN_FLIGHT + 2)]
        await stack.llm.until(lambda: stack.llm.held == CALLS_IN_FLIGHT)
        while episode.calls_started < len(calls):  # the other two are in the gateway (no event tells it)
            await asyncio.sleep(0.01)
        assert stack.llm.held == CALLS_IN_FLIGHT and len(stack.llm.requests) == CALLS_IN_FLIGHT  # two wait
        stack.llm.release()
        assert [r.status for r in await asyncio.gather(*calls)] == [200] * len(calls)
        assert len(episode.log.calls) == len(calls)
