"""The LLM gateway: an endpoint per episode, served in token space, every call recorded.

An agent program (JobRequest.agent) gets `OPENAI_BASE_URL=http://127.0.0.1:8766/gateway/<key>/v1` in its sandbox,
where port 8766 is forwarded by the runtime (sandbox_runtime/forwards.py) to this gateway and nothing else is
reachable. The gateway is an application of its own on a port of its own (`--gateway-port`), serving these paths
only: the sandbox's code can reach the gateway, never the service's job, batch or policy-version API. The key is
random, made when the episode's run starts and refused once it ends: it is both the credential and the episode's
identity, so no bearer token is needed, and a call can only ever land in its own episode's record.

Each chat call's prompt is built by the token-history rule (token_history.py) and sampled through the LLM pool
as the built-in agent loop samples (balancing, health, failover, the policy version of the moment); the answer
carries text, parsed `tool_calls` and the exact ids. Sampling settings are the job's: a harness's temperature
or top_p would make the recorded logprobs those of another policy, so they are ignored; its max_tokens and stop
strings are honoured. A streamed call is sampled whole, then sent as chunks (docs/gateway.md).

OpenAI's Responses API and Anthropic's Messages API are translations to and from the chat messages
(responses_wire.py, anthropic_wire.py): every protocol's call is one `chat_turn`, so they share the token-history
rule, the limits and the recording, and one harness may mix them in an episode. Errors come in each protocol's
own shape (`_error_shape`), so that each SDK raises its usual exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from jinja2 import TemplateError
from prometheus_client import Counter
from pydantic import BaseModel, ValidationError

from server_kit.connections import mark_credential_checked
from server_kit.errors import ApiError
from server_kit.openapi import API, Operation, Reply
from server_kit.webapp import json_api, json_response

from .. import __version__
from ..models import JobRequest, ToolCall
from . import anthropic_wire, responses_wire
from .agent import sample
from .anthropic_wire import (
    AnthropicErrorBody,
    CountTokensRequest,
    MessageObject,
    MessagesQuery,
    MessagesRequest,
    TokenCount,
)
from .chat import ChatTokenizer, parse_tool_calls, strip_tool_calls, text_size
from .llm import LLMPool, LLMRequestError, LLMUnavailable, Pin
from .openai_wire import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    FunctionCall,
    ModelCard,
    ModelList,
    OpenAIErrorBody,
    TokenLogprob,
    ToolCallOut,
    Usage,
)
from .records import Conversation, Records
from .responses_wire import ResponseObject, ResponsesRequest, ResponseStore, ResponseUsage
from .token_history import CallLog, ChatKey, Sampled, canonical, tools_key
from .weight_barrier import WeightBarrier
from .wire import event_bytes

SANDBOX_PORT = 8766  # where the gateway is on a sandbox's own loopback
CALLS_IN_FLIGHT = 4  # per episode; more wait for a slot
# Requests of one key in flight at most, counted from before the body is read: more are refused (429), so a
# sandbox cannot hold the gateway's connections in requests (a body trickled in, say) with the key it was given.
REQUESTS_PER_KEY = 2 * CALLS_IN_FLIGHT
# The artifact that counts the requests the gateway refused from an episode's sandbox, as text ("3").
REFUSED_ARTIFACT = "gateway_refused"
TURN_LIMIT = "turn_limit_reached"  # the code of a call past max_turns
LLM_REFUSED = "llm_server_refused"  # the code of a call the LLM server refused (a 4xx of its own)
COUNTS_PER_TURN = 4  # count_tokens calls an episode may make per turn of its limit
MAX_BODY_BYTES = 4 * 1024 * 1024  # a call's body: messages of a long context, far from the service's 16 MiB


class GatewayError(ApiError):
    """A call the gateway refuses; `status` is the HTTP status, `code` what OpenAI's clients read."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


@dataclass
class GatewayEpisode:
    key: str
    job_id: str
    request: JobRequest
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:16])  # names this run in records, unlike the key
    log: CallLog = field(default_factory=CallLog)
    pin: Pin = field(default_factory=Pin)
    calls_started: int = 0
    counts: int = 0  # count_tokens calls answered or in flight
    requests_open: int = 0  # requests with this key being read or answered (`_known_key`)
    refused: int = 0  # requests with this key the gateway refused (`_known_key`; the trajectory's REFUSED_ARTIFACT)
    told_turn_limit: bool = False  # a call past max_turns was answered: the next ones count as refused
    open: bool = True
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CALLS_IN_FLIGHT))
    responses: ResponseStore = field(default_factory=ResponseStore)  # what `previous_response_id` continues
    # When the program's time is up (time.monotonic()): a call still sampling then is cut, so that no generation
    # outlives the run it belongs to (nothing else bounds one: llm.CONNECT_TIMEOUT_S).
    deadline: float | None = None
    # Why a call of the episode went unanswered for an LLM outage (the first one): the program ran without its
    # policy, so how it ended says nothing of the policy (agent_program.py fails the run as the outage's).
    outage: str | None = None

    def base_url(self) -> str:
        """As the program sees it: the forwarded port on the sandbox's loopback."""
        return f"http://127.0.0.1:{SANDBOX_PORT}/gateway/{self.key}/v1"

    def anthropic_base_url(self) -> str:
        """As Anthropic's SDK takes it (it adds `/v1/messages`)."""
        return f"http://127.0.0.1:{SANDBOX_PORT}/gateway/{self.key}"


@dataclass
class ChatTurn:
    """One call answered, as chat messages: what every protocol's answer is made from."""

    sampled: Sampled
    content: str  # the text, without the tool calls
    calls: list[ToolCall]
    stop: str | None = None  # the stop string that ended it, where the protocol's answer leaves it out

    @property
    def finish(self) -> str:
        """OpenAI's finish reason: tool_calls, length or stop."""
        return "tool_calls" if self.calls else _finish(self.sampled.finish_reason)


class Gateway:
    def __init__(self, llm: LLMPool, chat: ChatTokenizer, barrier: WeightBarrier) -> None:
        self.llm = llm
        self.chat = chat
        self.barrier = barrier  # every call waits while a weight update holds it, and is tagged by its version
        self.records: Records | None = None  # the service's records (`--record`), which keep every answered call
        self._episodes: dict[str, GatewayEpisode] = {}

    @property
    def model(self) -> str:
        """The model id the gateway answers with: the policy's tokenizer's name."""
        return Path(self.chat.name).name or "policy"

    def open(self, job_id: str, request: JobRequest, time_s: float | None = None) -> GatewayEpisode:
        """A run's episode and its key; `time_s`: how long its calls may go on."""
        deadline = None if time_s is None else time.monotonic() + time_s
        episode = GatewayEpisode(secrets.token_urlsafe(32), job_id, request, deadline=deadline)
        self._episodes[episode.key] = episode
        return episode

    def close(self, episode: GatewayEpisode) -> None:
        """The episode's run is over: its key is refused from now on, and calls still in flight are not recorded."""
        episode.open = False
        self._episodes.pop(episode.key, None)

    def episode(self, key: str, unknown_status: int = 404) -> GatewayEpisode:
        """The running episode `key` names; else a GatewayError of `unknown_status` (401 for a key sent as an API
        key, in a header, as a vendor answers a wrong one)."""
        episode = self._episodes.get(key)
        if episode is None:
            message = "no running episode has this key (it is another's, made up, or its run is over)"
            raise GatewayError(unknown_status, message)
        return episode

    # -- calls ----------------------------------------------------------------------------------------
    async def chat_turn(
        self,
        episode: GatewayEpisode,
        messages: list[dict],
        tools: list[dict] | None,
        *,
        parse_calls: bool,
        max_tokens: int | None,
        stops: list[str],
        protocol: str,
        cut_stop: bool = False,
    ) -> ChatTurn:
        """One call of any protocol, translated to chat `messages` and `tools`: its prompt by the token-history
        rule, sampled, its tool calls parsed (unless `parse_calls` is off: they stay in the text) and recorded.
        With `cut_stop`, the answer ends before the stop string that ended it (Anthropic's rule; OpenAI's chat
        answers keep it, as the sampled ids do)."""
        async with self._call_slot(episode):
            prompt_ids, digest = await self._chat_prompt(episode, messages, tools)
            sampled = await self._sample(episode, prompt_ids, max_tokens, stops)
            stop = _matched_stop(sampled, stops, self.chat.eos_id) if cut_stop else None
            text = sampled.text[: sampled.text.find(stop)] if stop is not None else sampled.text
            parsed = parse_tool_calls(text) if parse_calls else None
            calls = parsed.calls if parsed else []
            content = strip_tool_calls(text) if calls else text
            reply = {"role": "assistant", "content": content}
            reply["tool_calls"] = [{"function": {"name": c.name, "arguments": c.arguments}} for c in calls]
            key = ChatKey(digest, len(messages), tools_key(tools), canonical(reply))
            errors = parsed.errors if parsed else []
            self._record(episode, protocol, sampled, key, calls, errors, (messages, tools, reply))
        return ChatTurn(sampled, content, calls, stop)

    async def chat_completion(self, episode: GatewayEpisode, body: ChatCompletionRequest) -> ChatCompletion:
        turn = await self.chat_turn(
            episode,
            [m.model_dump(exclude_none=True) for m in body.messages],
            body.tools or None,
            parse_calls=body.tool_choice != "none",
            max_tokens=body.max_completion_tokens or body.max_tokens,
            stops=body.stops(),
            protocol="chat",
        )
        out_calls = [
            ToolCallOut(id=_call_id(), function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)))
            for c in turn.calls
        ]
        message = AssistantMessage(content=turn.content or (None if out_calls else ""), tool_calls=out_calls or None)
        logprobs = ChoiceLogprobs(content=await self._token_logprobs(turn.sampled)) if body.logprobs else None
        sampled = turn.sampled
        choice = ChatChoice(
            message=message, finish_reason=turn.finish, logprobs=logprobs, token_ids=sampled.response_ids
        )
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model or self.model,
            choices=[choice],
            usage=_usage(sampled),
            prompt_token_ids=sampled.prompt_ids,
        )

    async def response(self, episode: GatewayEpisode, body: ResponsesRequest) -> ResponseObject:
        """A Responses API call: its input after the items of the response it continues, as chat messages."""
        messages = episode.responses.conversation(body.previous_response_id)
        messages += responses_wire.chat_messages(responses_wire.input_items(body))
        if not messages:
            raise GatewayError(400, "input: no message to answer")
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools = responses_wire.chat_tools(body.tools)
        turn = await self.chat_turn(
            episode,
            system + messages,
            tools,
            parse_calls=body.tool_choice != "none",
            max_tokens=body.max_output_tokens,
            stops=[],
            protocol="responses",
        )
        logprobs = None
        if responses_wire.LOGPROBS in (body.include or []):
            logprobs = [t.model_dump() for t in await self._token_logprobs(turn.sampled)]
        calls = [(_call_id(), c.name, json.dumps(c.arguments)) for c in turn.calls]
        cut = turn.finish == "length"
        output = responses_wire.output_items(turn.content, calls, logprobs, cut)
        answer_id = responses_wire.response_id()
        if body.store:
            answer = {"role": "assistant", "content": turn.content}
            if calls:
                answer["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": a}} for i, n, a in calls
                ]
            episode.responses.add(answer_id, [*messages, answer])
        sampled = turn.sampled
        prompt, completion = len(sampled.prompt_ids), len(sampled.response_ids)
        return ResponseObject(
            id=answer_id,
            created_at=int(time.time()),
            status="incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            model=body.model or self.model,
            output=output,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            previous_response_id=body.previous_response_id,
            store=body.store,
            tool_choice=body.tool_choice or "auto",
            tools=body.tools or [],
            usage=ResponseUsage(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion),
            prompt_token_ids=sampled.prompt_ids,
            token_ids=sampled.response_ids,
        )

    async def message(self, episode: GatewayEpisode, body: MessagesRequest) -> MessageObject:
        """An Anthropic Messages call, as chat messages."""
        messages, tools = _anthropic_chat(body)
        turn = await self.chat_turn(
            episode,
            messages,
            tools,
            parse_calls=(body.tool_choice or {}).get("type") != "none",
            max_tokens=body.max_tokens,
            stops=body.stop_sequences or [],
            protocol="messages",
            cut_stop=True,
        )
        sampled = turn.sampled
        if turn.calls:
            reason = "tool_use"
        elif turn.finish == "length":
            reason = "max_tokens"
        else:
            reason = "stop_sequence" if turn.stop is not None else "end_turn"
        calls = [(anthropic_wire.tool_use_id(), c.name, c.arguments) for c in turn.calls]
        return MessageObject(
            id=anthropic_wire.message_id(),
            model=body.model or self.model,
            content=anthropic_wire.content_blocks(turn.content, calls),
            stop_reason=reason,
            stop_sequence=turn.stop if reason == "stop_sequence" else None,
            usage=anthropic_wire.MessageUsage(
                input_tokens=len(sampled.prompt_ids), output_tokens=len(sampled.response_ids)
            ),
            prompt_token_ids=sampled.prompt_ids,
            token_ids=sampled.response_ids,
        )

    async def count_tokens(self, episode: GatewayEpisode, body: CountTokensRequest) -> TokenCount:
        """The prompt a Messages call with this body would be given now (by the token-history rule), counted. It
        spends no turn, but takes a call slot and a count of the episode's few (COUNTS_PER_TURN a turn): the
        tokenizer every episode shares is not a sandbox's to keep busy."""
        if episode.counts >= COUNTS_PER_TURN * episode.request.max_turns:
            limit = COUNTS_PER_TURN * episode.request.max_turns
            raise GatewayError(400, f"this episode's count_tokens limit is reached: {limit} ({COUNTS_PER_TURN} a turn)")
        episode.counts += 1
        messages, tools = _anthropic_chat(body)
        async with episode.slots:
            prompt_ids, _ = await self._chat_prompt(episode, messages, tools)
        return TokenCount(input_tokens=len(prompt_ids))

    async def completion(self, episode: GatewayEpisode, body: CompletionRequest) -> Completion:
        async with self._call_slot(episode):
            if isinstance(body.prompt, str):
                prompt_ids = await self.chat.off_loop(self.chat.encode, body.prompt, size=len(body.prompt))
            else:
                prompt_ids = list(body.prompt)
            sampled = await self._sample(episode, prompt_ids, body.max_tokens, body.stops())
            self._record(episode, "completions", sampled)
        logprobs = None
        if body.logprobs:
            pieces = await self._token_logprobs(sampled)
            logprobs = CompletionLogprobs(tokens=[p.token for p in pieces], token_logprobs=sampled.response_logprobs)
        choice = CompletionChoice(
            text=sampled.text,
            finish_reason=_finish(sampled.finish_reason),
            logprobs=logprobs,
            token_ids=sampled.response_ids,
        )
        return Completion(
            id=f"cmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model or self.model,
            choices=[choice],
            usage=_usage(sampled),
            prompt_token_ids=sampled.prompt_ids,
        )

    @contextlib.asynccontextmanager
    async def _call_slot(self, episode: GatewayEpisode) -> AsyncIterator[None]:
        """A call counts against the episode's turns, and waits for one of its few slots: a program (or whatever
        else runs in its sandbox) cannot put hundreds of generations in flight at the cost of other episodes."""
        refuse_spent(episode)
        episode.calls_started += 1
        async with episode.slots:
            yield

    async def _chat_prompt(
        self, episode: GatewayEpisode, messages: list[dict], tools: list[dict] | None
    ) -> tuple[list[int], str]:
        try:
            size = text_size(messages, tools)
            return await self.chat.off_loop(episode.log.chat_prompt, self.chat, messages, tools, size=size)
        except (TemplateError, TypeError, ValueError, KeyError) as exc:  # what the template could not render
            raise GatewayError(400, f"the chat template cannot render these messages: {exc}") from exc

    async def _token_logprobs(self, sampled: Sampled) -> list[TokenLogprob]:
        pieces = await self.chat.off_loop(self.chat.token_texts, sampled.response_ids, size=len(sampled.response_ids))
        return [TokenLogprob(token=t, logprob=p) for t, p in zip(pieces, sampled.response_logprobs, strict=True)]

    async def _sample(
        self, episode: GatewayEpisode, prompt_ids: list[int], max_tokens: int | None, stops: list[str]
    ) -> Sampled:
        job = episode.request
        room = job.max_context_tokens - len(prompt_ids)
        if room <= 0:
            # Anthropic's words and OpenAI's code for it: harnesses compact their history when they see them
            limit = job.max_context_tokens
            message = f"prompt is too long: {len(prompt_ids)} tokens > {limit} maximum (the job's max_context_tokens)"
            raise GatewayError(400, message, code="context_length_exceeded")
        sampling = job.sampling.model_copy(
            update={
                "max_tokens": min(job.sampling.max_tokens, max_tokens or job.sampling.max_tokens, room),
                "stop": [*job.sampling.stop, *stops],
            }
        )
        left = None if episode.deadline is None else max(episode.deadline - time.monotonic(), 0.0)
        try:
            async with asyncio.timeout(left):
                sampled = await sample(self.llm, self.chat, prompt_ids, sampling, episode.pin, self.barrier)
        except TimeoutError as exc:
            raise GatewayError(504, "the episode's time is up (its job's time budget): the call was cut") from exc
        except LLMUnavailable as exc:
            if exc.outage and episode.outage is None:
                episode.outage = str(exc)
            raise GatewayError(503, f"no LLM server can answer now: {exc}") from exc
        except LLMRequestError as exc:
            raise GatewayError(400, f"the LLM server refused the request: {exc}", code=LLM_REFUSED) from exc
        generation = sampled.generation
        return Sampled(
            prompt_ids=prompt_ids,
            response_ids=generation.token_ids,
            response_logprobs=generation.logprobs,
            policy_version=sampled.policy_version,
            resumptions=sampled.resumptions,
            server=generation.server,
            finish_reason=generation.finish_reason,
            text=generation.text or "",
            generate_s=generation.seconds,
        )

    def _record(
        self,
        episode: GatewayEpisode,
        protocol: str,
        sampled: Sampled,
        chat: ChatKey | None = None,
        calls: list[ToolCall] | None = None,
        errors: list[str] | None = None,
        conversation: Conversation | None = None,
    ) -> None:
        """Into the episode's log, and into the service's records (`--record`) whether or not the episode still
        runs: a call answered after its run ended is in no trajectory, and refused (404)."""
        recorded = None
        if episode.open:
            recorded = len(episode.log.calls), episode.log.record(sampled, chat, calls, errors)
        if self.records is not None:
            parsed = (list(calls or []), list(errors or []))
            self.records.call(episode.job_id, episode.run_id, protocol, sampled, recorded, parsed, conversation)
        if recorded is None:  # answered after the run ended: the trajectory is already built without it
            raise GatewayError(404, "the episode's run ended while this call was sampled; it was not recorded")


def refuse_spent(episode: GatewayEpisode) -> None:
    """GatewayError (400) once the episode has started all the calls its turn limit allows."""
    if episode.calls_started >= episode.request.max_turns:
        message = f"this episode's turn limit is reached: max_turns={episode.request.max_turns}"
        raise GatewayError(400, message, code=TURN_LIMIT)


def _anthropic_chat(body: CountTokensRequest) -> tuple[list[dict], list[dict] | None]:
    return anthropic_wire.chat_messages(body.system, body.messages), anthropic_wire.chat_tools(body.tools)


def _matched_stop(sampled: Sampled, stops: list[str], eos_id: int) -> str | None:
    """Which of `stops` ended the answer, if one did: the one whose first occurrence in its text (the ids' own,
    stop string included: agent.sample) ends first, as the server stops at the first it completes (the longer
    of two that end together)."""
    ids = sampled.response_ids
    if sampled.finish_reason != "stop" or not stops or (ids and ids[-1] == eos_id):
        return None
    text = sampled.text
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    return min(found)[2] if found else None  # the first completed; of two ending there, the one begun first


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(sampled: Sampled) -> Usage:
    prompt, completion = len(sampled.prompt_ids), len(sampled.response_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- HTTP -----------------------------------------------------------------------------------------------
GATEWAY = web.AppKey("gateway", Gateway)


HEADER_KEYED = "/gateway/v1/"  # paths whose key comes in a header, as SDKs send their API key


def _episode(request: web.Request) -> GatewayEpisode:
    """The running episode a gateway call names: by the key in its path (a 404 where none runs), or, under
    HEADER_KEYED, in `x-api-key` (Anthropic's SDK) or `Authorization: Bearer` (OpenAI's) (a 401 where none runs)."""
    key = request.match_info.get("key")
    if key is not None:
        return request.app[GATEWAY].episode(key)
    bearer = request.headers.get("Authorization", "")
    key = request.headers.get("x-api-key") or (bearer[len("Bearer ") :] if bearer.startswith("Bearer ") else "")
    if not key:
        raise GatewayError(401, "no key: send the episode's key as x-api-key or Authorization: Bearer, or in the path")
    return request.app[GATEWAY].episode(key, unknown_status=401)


async def gateway_models(request: web.Request) -> web.Response:
    _episode(request)
    gateway = request.app[GATEWAY]
    return json_response(ModelList(data=[ModelCard(id=gateway.model, created=int(time.time()))]))


async def gateway_chat_completions(request: web.Request, body: ChatCompletionRequest) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    answer = await gateway.chat_completion(_episode(request), body)
    if not body.stream:
        return json_response(answer)
    return await _stream(
        request, _chat_chunks(answer, include_usage=bool(body.stream_options and body.stream_options.include_usage))
    )


async def gateway_completions(request: web.Request, body: CompletionRequest) -> web.StreamResponse:
    gateway = request.app[GATEWAY]
    answer = await gateway.completion(_episode(request), body)
    if not body.stream:
        return json_response(answer)
    return await _stream(
        request,
        _completion_chunks(answer, include_usage=bool(body.stream_options and body.stream_options.include_usage)),
    )


async def gateway_responses(request: web.Request, body: ResponsesRequest) -> web.StreamResponse:
    answer = await request.app[GATEWAY].response(_episode(request), body)
    if not body.stream:
        return json_response(answer)
    return await _events(request, responses_wire.stream_events(answer))


async def gateway_messages(request: web.Request, body: MessagesRequest, query: MessagesQuery) -> web.StreamResponse:
    answer = await request.app[GATEWAY].message(_episode(request), body)
    if not body.stream:
        return json_response(answer)
    return await _events(request, anthropic_wire.stream_events(answer))


async def gateway_count_tokens(request: web.Request, body: CountTokensRequest, query: MessagesQuery) -> web.Response:
    return json_response(await request.app[GATEWAY].count_tokens(_episode(request), body))


async def _events(request: web.Request, events: list[tuple[str, dict]]) -> web.StreamResponse:
    """Named server-sent events, as the Responses and Messages APIs stream (no `[DONE]`)."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for event, data in events:
        await response.write(event_bytes(event, data))
    await response.write_eof()
    return response


async def _stream(request: web.Request, chunks: list[dict]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks:
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _chat_chunks(answer: ChatCompletion, include_usage: bool) -> list[dict]:
    """The answer as OpenAI's stream of chunks: the role, the text, the tool calls, the finish reason."""
    choice = answer.choices[0]
    head = {"id": answer.id, "object": "chat.completion.chunk", "created": answer.created, "model": answer.model}

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, **extra}]}

    chunks = [chunk({"role": "assistant", "content": ""})]
    if choice.message.content:
        logprobs = choice.logprobs.model_dump() if choice.logprobs else None
        chunks.append(chunk({"content": choice.message.content}, logprobs=logprobs))
    for index, call in enumerate(choice.message.tool_calls or []):
        chunks.append(chunk({"tool_calls": [{"index": index, **call.model_dump()}]}))
    chunks.append(chunk({}, choice.finish_reason, token_ids=choice.token_ids))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage.model_dump()})
    return chunks


def _completion_chunks(answer: Completion, include_usage: bool) -> list[dict]:
    choice = answer.choices[0]
    head = {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model}
    chunks = [
        {**head, "choices": [{"index": 0, "text": choice.text, "finish_reason": None, "logprobs": None}]},
        {
            **head,
            "choices": [{"index": 0, "text": "", "finish_reason": choice.finish_reason, "token_ids": choice.token_ids}],
        },
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": answer.usage.model_dump()})
    return chunks


KEY = {"key": {"type": "string", "description": "the episode's key, as OPENAI_API_KEY gives it", "maxLength": 128}}
REFUSED = {
    404: "no running episode has this key",
    429: f"this key has {REQUESTS_PER_KEY} requests in flight already",
    400: "the turn limit or the context is used up, or the LLM server refused it",
}
GENERATING = {**REFUSED, 503: "no LLM server can answer now (the SDKs retry it)"}
_STREAM = "JSON; with `stream: true`, text/event-stream chunks as OpenAI sends them, ending with `data: [DONE]`"
_EVENTS = "JSON; with `stream: true`, text/event-stream events as {} streams them"


def _operation(method: str, suffix: str, handler, summary: str, replies, errors, **more) -> Operation:
    return Operation(
        method,
        f"/gateway/{{key}}/v1{suffix}",
        handler,
        summary,
        replies,
        errors=errors,
        path_parameters=KEY,
        public=True,
        tag="gateway",
        **more,
    )


KEYED_OPERATIONS = (
    _operation(
        "GET",
        "/models",
        gateway_models,
        "LLM gateway: the model that answers (the episode's policy)",
        (Reply(200, "", ModelList),),
        {404: REFUSED[404]},
        error_model=OpenAIErrorBody,
    ),
    _operation(
        "POST",
        "/chat/completions",
        gateway_chat_completions,
        "LLM gateway: one chat turn, sampled in token space and recorded in the episode",
        (Reply(200, _STREAM, ChatCompletion),),
        GENERATING,
        body=ChatCompletionRequest,
        error_model=OpenAIErrorBody,
    ),
    _operation(
        "POST",
        "/completions",
        gateway_completions,
        "LLM gateway: one completion of a text or token-id prompt, recorded in the episode",
        (Reply(200, _STREAM, Completion),),
        GENERATING,
        body=CompletionRequest,
        error_model=OpenAIErrorBody,
    ),
    _operation(
        "POST",
        "/responses",
        gateway_responses,
        "LLM gateway: one turn of OpenAI's Responses API, translated to the chat the policy's template renders",
        (Reply(200, _EVENTS.format("OpenAI's Responses API"), ResponseObject),),
        GENERATING,
        body=ResponsesRequest,
        error_model=OpenAIErrorBody,
    ),
    _operation(
        "POST",
        "/messages",
        gateway_messages,
        "LLM gateway: one turn of Anthropic's Messages API, translated to the chat the policy's template renders",
        (Reply(200, _EVENTS.format("Anthropic's Messages API"), MessageObject),),
        GENERATING,
        body=MessagesRequest,
        query=MessagesQuery,
        error_model=AnthropicErrorBody,
    ),
    _operation(
        "POST",
        "/messages/count_tokens",
        gateway_count_tokens,
        "LLM gateway: the prompt tokens a Messages call would be given now (nothing sampled or recorded)",
        (Reply(200, "", TokenCount),),
        {404: REFUSED[404], 429: REFUSED[429], 400: "the template cannot render these messages"},
        body=CountTokensRequest,
        query=MessagesQuery,
        error_model=AnthropicErrorBody,
    ),
)


def _header_keyed(op: Operation) -> Operation:
    """The same call with the key in a header, at /gateway/v1/...: how SDKs send an API key to a base URL."""
    suffix = op.path.split("/v1", 1)[1]

    async def handler(request: web.Request, **arguments) -> web.StreamResponse:
        return await op.handler(request, **arguments)

    handler.__name__ = f"{op.handler.__name__}_key_in_header"
    errors = {**op.errors, 401: "no key sent (x-api-key or Authorization: Bearer)"}
    return dataclasses.replace(
        op,
        path=HEADER_KEYED + suffix.lstrip("/"),
        handler=handler,
        summary=op.summary + " (the key as x-api-key or Authorization: Bearer)",
        errors=errors,
        path_parameters={},
    )


OPERATIONS = KEYED_OPERATIONS + tuple(_header_keyed(op) for op in KEYED_OPERATIONS)


GATEWAY_API = API(
    name="gateway",
    program="prorl-rollout",
    title="prorl-rollout: the LLM gateway",
    version=__version__,
    description="The LLM calls of agent programs, one base URL per episode (`/gateway/{key}/v1`, or `/gateway/v1` "
    "with the key as `x-api-key` or `Authorization: Bearer`), in OpenAI's chat completions, completions and Responses "
    "APIs and Anthropic's Messages API, served in token space and recorded in the episode's trajectory. Errors come "
    "in each protocol's own shape. Served on the rollout service's gateway port, which sandboxes reach through the "
    "runtime's forward; see docs/gateway.md.",
    default_port=0,
    operations=OPERATIONS,
)


def create_gateway_app(requests: Counter) -> web.Application:
    """The gateway's application: its paths only. `app[GATEWAY]` is set by the service once its pipeline runs,
    before this application starts. A key no running episode holds is refused before the body is read, so a
    caller without one costs nothing but the request line. The key is the credential: only a request whose key
    was checked admits its connection (connections.py), not one for the OpenAPI document."""
    return json_api(
        GATEWAY_API, None, MAX_BODY_BYTES, requests, gates=[_known_key], credentialed=True, error_shape=_error_shape
    )


def _error_shape(request: web.Request, status: int, message: str, code: str | None) -> BaseModel:
    """Every error of a gateway call in its protocol's own shape (Anthropic's for /messages, OpenAI's for the
    rest), so that each SDK raises its usual exception."""
    if "/v1/messages" in request.path:
        return AnthropicErrorBody.of(status, message)
    return OpenAIErrorBody.of(status, message, code)


@web.middleware
async def _known_key(request: web.Request, handler) -> web.StreamResponse:
    """What refuses a call whatever its body says, decided before the body is read (up to MAX_BODY_BYTES of it,
    parsed): a key no running episode holds (404, or 401 for a key in a header; a finished episode's key is
    forgotten when its run ends), and
    a generation beyond the episode's turn limit (400), and a request beyond the key's REQUESTS_PER_KEY in flight
    (429). The connection of a refused call is not kept alive."""
    if request.match_info.http_exception is not None:  # no such path or method: its 404 or 405, as any server's
        return await handler(request)
    if "key" not in request.match_info and not request.path.startswith(HEADER_KEYED):  # the OpenAPI document
        return await handler(request)
    episode = _episode(request)
    try:
        if request.method == "POST" and not request.path.endswith("/count_tokens"):  # the generating calls
            refuse_spent(episode)
        if episode.requests_open >= REQUESTS_PER_KEY:
            raise GatewayError(429, f"this episode's key has {REQUESTS_PER_KEY} requests in flight already")
        mark_credential_checked(request)
        episode.requests_open += 1
        try:
            return await handler(request)
        finally:
            episode.requests_open -= 1
    except (ApiError, ValidationError) as exc:
        if _refusal(exc, episode):
            episode.refused += 1
        raise


def _refusal(exc: ApiError | ValidationError, episode: GatewayEpisode) -> bool:
    """Whether the gateway refused what the episode's sandbox sent it through the forward: a 4xx (a flood of
    requests, a field or tool it does not serve, a body it cannot read, a turn past the limit after the first
    such), not what an honest harness meets: a full context (it compacts on it), its first call past the turn limit
    (it learns of the limit so), the LLM server's own 4xx, nor a call answered after the run ended (404)."""
    if isinstance(exc, ValidationError):
        return True
    if exc.code == TURN_LIMIT and not episode.told_turn_limit:
        episode.told_turn_limit = True
        return False
    return 400 <= exc.status < 500 and exc.status != 404 and exc.code not in ("context_length_exceeded", LLM_REFUSED)
