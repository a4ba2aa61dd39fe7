"""The LLM gateway's other protocols, OpenAI's Responses API and Anthropic's Messages API, called with the official
SDKs as harnesses call them, against the in-process rig (the LLM stand-in of tests/fakes, which samples a script;
the real parts, vLLM and bwrap sandboxes, are in integration_tests/test_gateway_protocols.py)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import anthropic
import openai
import pytest

from prorl_adapter.models import JobRequest
from prorl_adapter.service.responses_wire import ResponseStore
from prorl_adapter.service.server import PIPELINE

from .fakes.llm import bash_call
from .fakes.rigs import rollout_stack

BASH = {
    "name": "bash",
    "description": "Run a bash command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
RESPONSES_TOOLS = [{"type": "function", **BASH}]
ANTHROPIC_TOOLS = [{"name": BASH["name"], "description": BASH["description"], "input_schema": BASH["parameters"]}]
SYSTEM = "You run commands."


def open_episode(stack, **request):
    return stack.app[PIPELINE].gateway.open("job-1", JobRequest(task="shell", **request))


@contextlib.asynccontextmanager
async def openai_client(stack, episode) -> AsyncIterator[openai.AsyncOpenAI]:
    base = str(stack.gateway.make_url(f"/gateway/{episode.key}/v1"))
    async with openai.AsyncOpenAI(base_url=base, api_key=episode.key, max_retries=0) as client:
        yield client


@contextlib.asynccontextmanager
async def anthropic_client(stack, key: str, base: str | None = None) -> AsyncIterator[anthropic.AsyncAnthropic]:
    """As ANTHROPIC_BASE_URL gives it: the key in the path (as the sandbox's environment has it), or not."""
    url = str(stack.gateway.make_url(base if base is not None else f"/gateway/{key}"))
    async with anthropic.AsyncAnthropic(base_url=url, api_key=key, max_retries=0) as client:
        yield client


def ids(answer) -> tuple[list[int], list[int]]:
    """The exact prompt and sampled ids an answer carries beside the protocol's own fields."""
    return answer.model_extra["prompt_token_ids"], answer.model_extra["token_ids"]


# -- Responses ----------------------------------------------------------------------------------------------
async def test_responses_tool_use_continued_by_previous_response_id_extends_the_token_history():
    async with rollout_stack(script=[bash_call("ls"), "all done"]) as stack:
        episode = open_episode(stack)
        async with openai_client(stack, episode) as client:
            first = await client.responses.create(
                model="policy", instructions=SYSTEM, input="list the files", tools=RESPONSES_TOOLS
            )
            assert first.status == "completed" and first.usage.output_tokens == len(ids(first)[1])
            [call] = first.output
            assert (
                call.type == "function_call" and call.name == "bash" and json.loads(call.arguments) == {"command": "ls"}
            )
            second = await client.responses.create(
                model="policy",
                instructions=SYSTEM,
                previous_response_id=first.id,
                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a.txt"}],
                tools=RESPONSES_TOOLS,
            )
        assert second.output_text == "all done" and second.previous_response_id == first.id
        prompt, sampled = ids(first)
        assert ids(second)[0][: len(prompt) + len(sampled)] == prompt + sampled
        segments, turns = episode.log.segments()
        assert len(segments) == 1 and [t.tool_calls[0].name for t in turns[:1]] == ["bash"]


async def test_responses_history_sent_back_whole_extends_it_as_well():
    """A harness that stores nothing (Codex sends `store: false` and its whole history each time)."""
    async with rollout_stack(script=[bash_call("ls"), "all done"]) as stack:
        episode = open_episode(stack)
        async with openai_client(stack, episode) as client:
            question = [{"role": "user", "content": "list the files"}]
            first = await client.responses.create(model="p", input=question, tools=RESPONSES_TOOLS, store=False)
            output = [item.model_dump(exclude_none=True) for item in first.output]
            result = {"type": "function_call_output", "call_id": output[0]["call_id"], "output": "a.txt"}
            second = await client.responses.create(
                model="p", input=[*question, *output, result], tools=RESPONSES_TOOLS, store=False
            )
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                await client.responses.create(model="p", input="go on", previous_response_id=first.id)
        prompt, sampled = ids(first)
        assert ids(second)[0][: len(prompt) + len(sampled)] == prompt + sampled
        assert len(episode.log.segments()[0]) == 1


async def test_a_streamed_response_is_the_responses_event_sequence_the_sdk_assembles():
    async with rollout_stack(script=["I will look.\n" + bash_call("pwd")]) as stack:
        episode = open_episode(stack)
        async with (
            openai_client(stack, episode) as client,
            client.responses.stream(model="p", input="where am I?", tools=RESPONSES_TOOLS) as stream,
        ):
            kinds = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    message, call = final.output
    assert message.content[0].text == "I will look." and json.loads(call.arguments) == {"command": "pwd"}
    assert len(episode.log.calls) == 1


async def test_a_response_cut_by_max_output_tokens_is_incomplete_and_logprobs_come_when_asked():
    async with rollout_stack(script=["a long answer that goes on"]) as stack:
        episode = open_episode(stack)
        async with openai_client(stack, episode) as client:
            answer = await client.responses.create(
                model="p", input="talk", max_output_tokens=4, include=["message.output_text.logprobs"]
            )
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    [part] = answer.output[0].content
    assert [round(p.logprob, 6) for p in part.logprobs] == [
        round(p, 6) for p in episode.log.calls[0].sampled.response_logprobs
    ]
    assert len(ids(answer)[1]) == 4


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "web_search"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "wizard"),
        ({"input": "x", "previous_response_id": "resp_made_up"}, "resp_made_up"),
        ({"input": "x", "conversation": "conv_1"}, "conversation"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "o", "schema": {}}}}, "json_schema"),
        ({"input": []}, "no message"),
    ],
)
async def test_what_responses_cannot_take_is_openais_400_naming_it(request_fields, named):
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        async with openai_client(stack, episode) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.responses.create(model="p", **request_fields)
    assert named in raised.value.message and raised.value.body["type"] == "invalid_request_error"
    assert episode.log.calls == []


# -- Messages -----------------------------------------------------------------------------------------------
async def test_messages_tool_use_and_an_error_result_extend_the_token_history():
    async with rollout_stack(script=[bash_call("ls"), "it failed"]) as stack:
        episode = open_episode(stack)
        async with anthropic_client(stack, episode.key) as client:
            question = {"role": "user", "content": "list the files"}
            first = await client.messages.create(
                model="p", max_tokens=200, system=SYSTEM, messages=[question], tools=ANTHROPIC_TOOLS
            )
            assert first.stop_reason == "tool_use"
            [use] = first.content
            assert use.type == "tool_use" and use.name == "bash" and use.input == {"command": "ls"}
            result = {"type": "tool_result", "tool_use_id": use.id, "content": "ls: denied", "is_error": True}
            second = await client.messages.create(
                model="p",
                max_tokens=200,
                system=[{"type": "text", "text": SYSTEM}],
                messages=[
                    question,
                    {"role": "assistant", "content": first.content},
                    {"role": "user", "content": [result]},
                ],
                tools=ANTHROPIC_TOOLS,
            )
    assert second.stop_reason == "end_turn" and second.content[0].text == "it failed"
    prompt, sampled = ids(first)
    assert ids(second)[0][: len(prompt) + len(sampled)] == prompt + sampled
    assert "Error: ls: denied" in stack.chat.decode(ids(second)[0][len(prompt) + len(sampled) :])
    assert second.usage.input_tokens == len(ids(second)[0]) and len(episode.log.segments()[0]) == 1


async def test_a_streamed_message_is_anthropics_event_sequence_the_sdk_assembles():
    async with rollout_stack(script=["Looking.\n" + bash_call("pwd")]) as stack:
        episode = open_episode(stack)
        async with (
            anthropic_client(stack, episode.key) as client,
            client.messages.stream(
                model="p", max_tokens=200, messages=[{"role": "user", "content": "where?"}], tools=ANTHROPIC_TOOLS
            ) as stream,
        ):
            kinds = [event.type async for event in stream]
            final = await stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    text, use = final.content
    assert text.text == "Looking." and use.input == {"command": "pwd"} and final.stop_reason == "tool_use"


async def test_stop_sequences_and_max_tokens_are_anthropics_stop_reasons():
    """ "D" and "END" are completed by the same token: the one begun first ended the turn, as the server saw it."""
    async with rollout_stack(script=["one two END three", "a long answer that goes on"]) as stack:
        episode = open_episode(stack)
        async with anthropic_client(stack, episode.key) as client:
            stopped = await client.messages.create(
                model="p",
                max_tokens=100,
                stop_sequences=["D", "END", "never"],
                messages=[{"role": "user", "content": "a"}],
            )
            cut = await client.messages.create(model="p", max_tokens=3, messages=[{"role": "user", "content": "b"}])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "END"
    assert stopped.content[0].text == "one two "
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


async def test_count_tokens_is_the_next_calls_prompt_and_spends_no_turn():
    async with rollout_stack(script=["hello"]) as stack:
        episode = open_episode(stack, max_turns=1)
        messages = [{"role": "user", "content": "hi"}]
        async with anthropic_client(stack, episode.key) as client:
            counted = await client.messages.count_tokens(model="p", messages=messages, tools=ANTHROPIC_TOOLS)
            again = await client.messages.count_tokens(model="p", messages=messages, tools=ANTHROPIC_TOOLS)
            answer = await client.messages.create(model="p", max_tokens=50, messages=messages, tools=ANTHROPIC_TOOLS)
            with pytest.raises(anthropic.BadRequestError, match="max_turns=1"):
                await client.messages.create(model="p", max_tokens=50, messages=messages)
    assert counted.input_tokens == again.input_tokens == answer.usage.input_tokens


async def test_the_key_works_as_x_api_key_or_a_bearer_on_the_gateway_base_url():
    async with rollout_stack(script=["hello", "hello"]) as stack:
        episode = open_episode(stack)
        async with anthropic_client(stack, episode.key, base="/gateway") as client:
            answer = await client.messages.create(model="p", max_tokens=20, messages=[{"role": "user", "content": "x"}])
        assert answer.content[0].text == "hello"
        async with anthropic_client(stack, "made-up", base="/gateway") as client:  # a wrong API key, as vendors say
            with pytest.raises(anthropic.AuthenticationError) as raised:
                await client.messages.create(model="p", max_tokens=20, messages=[{"role": "user", "content": "x"}])
        error = raised.value.body["error"]
        assert error["type"] == "authentication_error" and "no running episode has this key" in error["message"]
        url = str(stack.gateway.make_url("/gateway"))
        async with anthropic.AsyncAnthropic(base_url=url, auth_token=episode.key, max_retries=0) as bearer:
            answer = await bearer.messages.create(model="p", max_tokens=20, messages=[{"role": "user", "content": "y"}])
        assert answer.content[0].text == "hello"  # ANTHROPIC_AUTH_TOKEN: the key as a bearer
        keyless = await stack.gateway.post("/gateway/v1/messages", json={"model": "p", "max_tokens": 5, "messages": []})
        body = await keyless.json()
        assert keyless.status == 401 and body["error"]["type"] == "authentication_error" and "x-api-key" in str(body)


@pytest.mark.parametrize(
    ("request_fields", "named"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ],
)
async def test_what_messages_cannot_take_is_anthropics_400_naming_it(request_fields, named):
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        async with anthropic_client(stack, episode.key) as client:
            with pytest.raises(anthropic.BadRequestError) as raised:  # the fields as sent, whatever the SDK's types
                await client.messages.create(
                    model="p", max_tokens=10, messages=[{"role": "user", "content": "x"}], extra_body=request_fields
                )
    assert named in raised.value.message and raised.value.body["error"]["type"] == "invalid_request_error"
    assert episode.log.calls == []


# -- one token space ----------------------------------------------------------------------------------------
async def test_a_harness_mixing_protocols_records_one_history():
    """A chat call answered with a tool call, then the same conversation as Anthropic messages: one segment."""
    async with rollout_stack(script=[bash_call("ls"), "done"]) as stack:
        episode = open_episode(stack)
        tools = [{"type": "function", "function": BASH}]
        question = {"role": "user", "content": "list the files"}
        first = await stack.gateway.post(
            f"/gateway/{episode.key}/v1/chat/completions", json={"messages": [question], "tools": tools}
        )
        chat_answer = await first.json()
        [call] = chat_answer["choices"][0]["message"]["tool_calls"]
        async with anthropic_client(stack, episode.key) as client:
            use = {
                "type": "tool_use",
                "id": call["id"],
                "name": "bash",
                "input": json.loads(call["function"]["arguments"]),
            }
            result = {"type": "tool_result", "tool_use_id": call["id"], "content": "a.txt"}
            second = await client.messages.create(
                model="p",
                max_tokens=100,
                messages=[question, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}],
                tools=ANTHROPIC_TOOLS,
            )
    history = chat_answer["prompt_token_ids"] + chat_answer["choices"][0]["token_ids"]
    assert ids(second)[0][: len(history)] == history
    segments, turns = episode.log.segments()
    assert len(segments) == 1 and len(turns) == 2 and turns[1].text == "done"


async def test_the_beta_messages_call_claude_code_makes_is_served():
    """Claude Code calls `/v1/messages?beta=true` (the SDK's beta client)."""
    async with rollout_stack(script=["hello"]) as stack:
        episode = open_episode(stack)
        async with anthropic_client(stack, episode.key) as client:
            answer = await client.beta.messages.create(
                model="p", max_tokens=20, messages=[{"role": "user", "content": "x"}], betas=["some-beta-2025"]
            )
    assert answer.content[0].text == "hello" and len(episode.log.calls) == 1


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "image_url"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "custom"),
    ],
)
async def test_chat_calls_with_images_or_other_tools_are_refused_naming_them(fields, named):
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack)
        async with openai_client(stack, episode) as client:
            with pytest.raises(openai.BadRequestError) as raised:
                await client.chat.completions.create(
                    **{"model": "p", "messages": [{"role": "user", "content": "x"}], **fields}
                )
    assert named in raised.value.message and episode.log.calls == []


async def test_count_tokens_has_a_limit_of_its_own():
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack, max_turns=1)
        messages = [{"role": "user", "content": "hi"}]
        async with anthropic_client(stack, episode.key) as client:
            counts = [await client.messages.count_tokens(model="p", messages=messages) for _ in range(4)]
            with pytest.raises(anthropic.BadRequestError, match="count_tokens limit"):
                await client.messages.count_tokens(model="p", messages=messages)
    assert len({c.input_tokens for c in counts}) == 1


async def test_a_full_context_is_each_protocols_context_error():
    """Harnesses compact their history on OpenAI's code and Anthropic's words for it."""
    async with rollout_stack(script=["x"]) as stack:
        episode = open_episode(stack, max_context_tokens=8)
        long = [{"role": "user", "content": "a question far longer than eight tokens"}]
        async with openai_client(stack, episode) as client:
            with pytest.raises(openai.BadRequestError) as chat_error:
                await client.chat.completions.create(model="p", messages=long)
        async with anthropic_client(stack, episode.key) as client:
            with pytest.raises(anthropic.BadRequestError) as messages_error:
                await client.messages.create(model="p", max_tokens=5, messages=long)
    assert chat_error.value.code == "context_length_exceeded"
    assert messages_error.value.body["error"]["message"].startswith("prompt is too long: ")


def test_a_history_sent_whole_each_turn_is_stored_once():
    """The Responses SDKs store by default; a harness sending its whole history each turn must not cost it once
    per turn, and every response stays continuable."""
    store = ResponseStore()
    conversation: list[dict] = []
    for turn in range(50):
        conversation += [{"role": "user", "content": f"q{turn}"}, {"role": "assistant", "content": f"a{turn}"}]
        store.add(f"resp_{turn}", list(conversation))
    kept = sum(len(added) for _, added in store._responses.values())
    assert kept == len(conversation) == 100
    assert store.conversation("resp_49") == conversation and store.conversation("resp_3") == conversation[:8]
    store.add("resp_branch", [*conversation[:4], {"role": "user", "content": "else"}])  # continues resp_1
    assert store._responses["resp_branch"] == ("resp_1", [{"role": "user", "content": "else"}])


async def test_a_streamed_cut_response_starts_in_progress_and_ends_incomplete():
    async with rollout_stack(script=["a long answer that goes on"]) as stack:
        episode = open_episode(stack)
        async with (
            openai_client(stack, episode) as client,
            client.responses.stream(model="p", input="talk", max_output_tokens=3) as stream,
        ):
            events = [event async for event in stream]
    assert events[0].response.incomplete_details is None and events[0].response.status == "in_progress"
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].status == "incomplete"
