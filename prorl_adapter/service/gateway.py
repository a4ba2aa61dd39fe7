"""The LLM gateway: an OpenAI-compatible endpoint per episode, served in token space, every call recorded.

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
"""

from __future__ import annotations

import asyncio
import contextlib
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

from server_kit.connections import mark_credential_checked
from server_kit.errors import ApiError
from server_kit.openapi import API, Operation, Reply
from server_kit.webapp import json_api, json_response

from .. import __version__
from ..models import JobRequest, ToolCall
from .agent import sample
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
    SamplingFields,
    TokenLogprob,
    ToolCallOut,
    Usage,
)
from .token_history import CallLog, ChatKey, Sampled, canonical, tools_key
from .weight_barrier import WeightBarrier

SANDBOX_PORT = 8766  # where the gateway is on a sandbox's own loopback
CALLS_IN_FLIGHT = 4  # per episode; more wait for a slot
# Requests of one key in flight at most, counted from before the body is read: more are refused (429), so a
# sandbox cannot hold the gateway's connections in requests (a body trickled in, say) with the key it was given.
REQUESTS_PER_KEY = 2 * CALLS_IN_FLIGHT
MAX_BODY_BYTES = 4 * 1024 * 1024  # a call's body: messages of a long context, far from the service's 16 MiB


class GatewayError(ApiError):
    """A call the gateway refuses; `status` is the HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class GatewayEpisode:
    key: str
    job_id: str
    request: JobRequest
    log: CallLog = field(default_factory=CallLog)
    pin: Pin = field(default_factory=Pin)
    calls_started: int = 0
    requests_open: int = 0  # requests with this key being read or answered (`_known_key`)
    open: bool = True
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(CALLS_IN_FLIGHT))

    def base_url(self) -> str:
        """As the program sees it: the forwarded port on the sandbox's loopback."""
        return f"http://127.0.0.1:{SANDBOX_PORT}/gateway/{self.key}/v1"


class Gateway:
    def __init__(self, llm: LLMPool, chat: ChatTokenizer, barrier: WeightBarrier) -> None:
        self.llm = llm
        self.chat = chat
        self.barrier = barrier  # every call waits while a weight update holds it, and is tagged by its version
        self._episodes: dict[str, GatewayEpisode] = {}

    @property
    def model(self) -> str:
        """The model id the gateway answers with: the policy's tokenizer's name."""
        return Path(self.chat.name).name or "policy"

    def open(self, job_id: str, request: JobRequest) -> GatewayEpisode:
        episode = GatewayEpisode(secrets.token_urlsafe(32), job_id, request)
        self._episodes[episode.key] = episode
        return episode

    def close(self, episode: GatewayEpisode) -> None:
        """The episode's run is over: its key is refused from now on, and calls still in flight are not recorded."""
        episode.open = False
        self._episodes.pop(episode.key, None)

    def episode(self, key: str) -> GatewayEpisode:
        episode = self._episodes.get(key)
        if episode is None:
            raise GatewayError(404, "no running episode has this key (it is another's, made up, or its run is over)")
        return episode

    # -- calls ------------------------------------------------------------------------------------------
    async def chat_completion(self, episode: GatewayEpisode, body: ChatCompletionRequest) -> ChatCompletion:
        async with self._call_slot(episode):
            messages = [m.model_dump(exclude_none=True) for m in body.messages]
            tools = body.tools or None
            try:
                size = text_size(messages, tools)
                prompt_ids, digest = await self.chat.off_loop(
                    episode.log.chat_prompt, self.chat, messages, tools, size=size
                )
            except (TemplateError, TypeError, ValueError, KeyError) as exc:  # what the template could not render
                raise GatewayError(400, f"the chat template cannot render these messages: {exc}") from exc
            sampled = await self._sample(episode, prompt_ids, body.max_completion_tokens or body.max_tokens, body)
            parsed = parse_tool_calls(sampled.text) if body.tool_choice != "none" else None
            calls = parsed.calls if parsed else []
            out_calls = [
                ToolCallOut(
                    id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=c.name, arguments=json.dumps(c.arguments)),
                )
                for c in calls
            ]
            content = strip_tool_calls(sampled.text) if calls else sampled.text
            message = AssistantMessage(content=content or (None if calls else ""), tool_calls=out_calls or None)
            key = ChatKey(digest, len(messages), tools_key(tools), canonical(message.model_dump(exclude_none=True)))
            self._record(episode, sampled, key, calls, parsed.errors if parsed else [])
        logprobs = None
        if body.logprobs:
            pieces = await self.chat.off_loop(
                self.chat.token_texts, sampled.response_ids, size=len(sampled.response_ids)
            )
            logprobs = ChoiceLogprobs(
                content=[TokenLogprob(token=t, logprob=p) for t, p in zip(pieces, sampled.response_logprobs)]
            )
        finish = "tool_calls" if calls else _finish(sampled.finish_reason)
        choice = ChatChoice(message=message, finish_reason=finish, logprobs=logprobs, token_ids=sampled.response_ids)
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=body.model or self.model,
            choices=[choice],
            usage=_usage(sampled),
            prompt_token_ids=sampled.prompt_ids,
        )

    async def completion(self, episode: GatewayEpisode, body: CompletionRequest) -> Completion:
        async with self._call_slot(episode):
            if isinstance(body.prompt, str):
                prompt_ids = await self.chat.off_loop(self.chat.encode, body.prompt, size=len(body.prompt))
            else:
                prompt_ids = list(body.prompt)
            sampled = await self._sample(episode, prompt_ids, body.max_tokens, body)
            self._record(episode, sampled)
        logprobs = None
        if body.logprobs:
            pieces = await self.chat.off_loop(
                self.chat.token_texts, sampled.response_ids, size=len(sampled.response_ids)
            )
            logprobs = CompletionLogprobs(tokens=pieces, token_logprobs=sampled.response_logprobs)
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

    async def _sample(
        self, episode: GatewayEpisode, prompt_ids: list[int], max_tokens: int | None, body: SamplingFields
    ) -> Sampled:
        job = episode.request
        room = job.max_context_tokens - len(prompt_ids)
        if room <= 0:
            limit = job.max_context_tokens
            raise GatewayError(400, f"the prompt is {len(prompt_ids)} tokens; max_context_tokens is {limit}")
        sampling = job.sampling.model_copy(
            update={
                "max_tokens": min(job.sampling.max_tokens, max_tokens or job.sampling.max_tokens, room),
                "stop": [*job.sampling.stop, *body.stops()],
            }
        )
        try:
            sampled = await sample(self.llm, self.chat, prompt_ids, sampling, episode.pin, self.barrier)
        except LLMUnavailable as exc:
            raise GatewayError(503, f"no LLM server can answer now: {exc}") from exc
        except LLMRequestError as exc:
            raise GatewayError(400, f"the LLM server refused the request: {exc}") from exc
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

    @staticmethod
    def _record(
        episode: GatewayEpisode,
        sampled: Sampled,
        chat: ChatKey | None = None,
        calls: list[ToolCall] | None = None,
        errors: list[str] | None = None,
    ) -> None:
        if not episode.open:  # answered after the run ended: the trajectory is already built without it
            raise GatewayError(404, "the episode's run ended while this call was sampled; it was not recorded")
        episode.log.record(sampled, chat, calls, errors)


def refuse_spent(episode: GatewayEpisode) -> None:
    """GatewayError (400) once the episode has started all the calls its turn limit allows."""
    if episode.calls_started >= episode.request.max_turns:
        raise GatewayError(400, f"this episode's turn limit is reached: max_turns={episode.request.max_turns}")


def _finish(reason: str | None) -> str:
    return "length" if reason == "length" else "stop"


def _usage(sampled: Sampled) -> Usage:
    prompt, completion = len(sampled.prompt_ids), len(sampled.response_ids)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# -- HTTP -----------------------------------------------------------------------------------------------
GATEWAY = web.AppKey("gateway", Gateway)


def _episode(request: web.Request) -> GatewayEpisode:
    return request.app[GATEWAY].episode(request.match_info["key"])


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


def _usage_wanted(body: ChatCompletionRequest | CompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


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
_STREAM = "JSON; with `stream: true`, text/event-stream chunks as OpenAI sends them, ending with `data: [DONE]`"

OPERATIONS = (
    Operation(
        "GET",
        "/gateway/{key}/v1/models",
        gateway_models,
        "LLM gateway: the model that answers (the episode's policy)",
        (Reply(200, "", ModelList),),
        errors={404: REFUSED[404]},
        path_parameters=KEY,
        public=True,
        tag="gateway",
    ),
    Operation(
        "POST",
        "/gateway/{key}/v1/chat/completions",
        gateway_chat_completions,
        "LLM gateway: one chat turn, sampled in token space and recorded in the episode",
        (Reply(200, _STREAM, ChatCompletion),),
        errors={**REFUSED, 503: "no LLM server can answer now (OpenAI clients retry it)"},
        body=ChatCompletionRequest,
        path_parameters=KEY,
        public=True,
        tag="gateway",
    ),
    Operation(
        "POST",
        "/gateway/{key}/v1/completions",
        gateway_completions,
        "LLM gateway: one completion of a text or token-id prompt, recorded in the episode",
        (Reply(200, _STREAM, Completion),),
        errors={**REFUSED, 503: "no LLM server can answer now (OpenAI clients retry it)"},
        body=CompletionRequest,
        path_parameters=KEY,
        public=True,
        tag="gateway",
    ),
)


GATEWAY_API = API(
    name="gateway",
    program="prorl-rollout",
    title="prorl-rollout: the LLM gateway",
    version=__version__,
    description="OpenAI-compatible calls of agent programs, one base URL per episode (`/gateway/{key}/v1`), served "
    "in token space and recorded in the episode's trajectory. Served on the rollout service's gateway port, which "
    "sandboxes reach through the runtime's forward; see docs/gateway.md.",
    default_port=0,
    operations=OPERATIONS,
)


def create_gateway_app(requests: Counter) -> web.Application:
    """The gateway's application: its paths only. `app[GATEWAY]` is set by the service once its pipeline runs,
    before this application starts. A key no running episode holds is refused before the body is read, so a
    caller without one costs nothing but the request line. The key is the credential: only a request whose key
    was checked admits its connection (connections.py), not one for the OpenAPI document."""
    return json_api(GATEWAY_API, None, MAX_BODY_BYTES, requests, gates=[_known_key], credentialed=True)


@web.middleware
async def _known_key(request: web.Request, handler) -> web.StreamResponse:
    """What refuses a call whatever its body says, decided before the body is read (up to MAX_BODY_BYTES of it,
    parsed): a key no running episode holds (404; a finished episode's key is forgotten when its run ends), and
    a generation beyond the episode's turn limit (400), and a request beyond the key's REQUESTS_PER_KEY in flight
    (429). The connection of a refused call is not kept alive."""
    key = request.match_info.get("key")
    if key is None:
        return await handler(request)
    episode = request.app[GATEWAY].episode(key)  # 404 for any other
    if request.method == "POST":  # the generating calls
        refuse_spent(episode)
    if episode.requests_open >= REQUESTS_PER_KEY:
        raise GatewayError(429, f"this episode's key has {REQUESTS_PER_KEY} requests in flight already")
    mark_credential_checked(request)
    episode.requests_open += 1
    try:
        return await handler(request)
    finally:
        episode.requests_open -= 1
