"""A scripted LLM stand-in (NOT a model): the part of vLLM's OpenAI-compatible API that `LLMPool` uses
(GET /v1/models, POST /v1/completions with a token-id prompt and `return_token_ids`, `logprobs: 1`), answering
with texts chosen in advance, tokenised by the `CharChat` stand-in. With `protocol="sglang"` it speaks SGLang's
native API instead (GET /get_model_info and /health, POST /generate with `input_ids`, as SGLang documents them),
and with `protocol="prorl"` ProRL Agent's token-level POST /generate (`prompt_ids` in, `response_ids` and
`logprobs` out; no health route). `engine_metrics`, when set, is the Prometheus text its GET /metrics answers
(as vLLM's would; unset: 404; `HANG`: held until released).

Weight updates, as vLLM 0.32 and SGLang serve them: a pause (vLLM `POST /pause?mode=abort`, SGLang
`POST /pause_generation`) aborts the requests in flight and queues new ones until the resume (`/resume`,
`/continue_generation`); an abort (`/abort_requests`, `/abort_request`) aborts without pausing. An aborted request
answers with the tokens it had sampled and finish_reason "abort" (SGLang: `{"type": "abort"}`); a pause in
`keep` mode aborts nothing. `Interruptible` entries are the requests such an abort can catch mid-turn; every
control call is in `control`. A completion asked with `"stream": true` answers as vLLM streams it: one event per
token (its text, `token_ids` and logprob), the last with the finish reason, then `data: [DONE]`; an
`Interruptible` streams its first tokens at once.

Which text: answers cued with `cue(...)` go first, one per request, whatever the prompt. Otherwise the prompt
picks a script: `[script:NAME]` anywhere in it names one of `scripts` (else `script` is used), and the number
of assistant turns already in the prompt picks the entry; past the end of a script it calls `finish`. An entry
is a text (a turn closed by the end-of-turn token, as a sampled turn is), or `Reply`, `Fail`, `Garbage`, `HANG`.
`max_tokens` is honoured: a longer turn is cut there, with finish_reason "length".
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .chat import START, CharChat
from .standin import Fail, Hang, StandIn

SCRIPT = re.compile(r"\[script:([A-Za-z0-9_-]+)\]")


def tool_call(name: str, **arguments: Any) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def bash_call(command: str) -> str:
    return tool_call("bash", command=command)


def finish_call(answer: str = "done") -> str:
    return tool_call("finish", answer=answer)


@dataclass
class Reply:
    text: str
    closed: bool = True  # ends with the end-of-turn token, as a turn that stopped by itself does


@dataclass
class Garbage:
    """A 200 whose body is not a usable completion."""

    body: bytes = b'{"choices": [{"text": "no ids"}]}'


@dataclass(frozen=True)
class Interruptible:
    """A turn still being generated: held (like HANG) until an abort, which answers its first `sampled` tokens
    with finish_reason "abort", or until `release()`, which answers it whole. `text` is closed by the end-of-turn
    token."""

    text: str
    sampled: int


Answer = str | Reply | Fail | Garbage | Hang | Interruptible


@dataclass
class Sampled:
    """One answered completion: what the stand-in returned, for assertions."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str


class ScriptedLLM(StandIn):
    def __init__(
        self,
        script: list[Answer] | None = None,
        scripts: dict[str, list[Answer]] | None = None,
        model: str = "m",
        protocol: str = "openai",
    ) -> None:
        super().__init__()
        self.chat = CharChat()
        self.script = list(script or [])
        self.scripts = dict(scripts or {})
        self.model = model
        self.down = False  # every endpoint answers 503, as a server that is up but broken does
        self.models_body: bytes | None = None  # what GET /v1/models answers with 200 instead of the model list
        self.requests: list[dict[str, Any]] = []  # every /v1/completions body received
        self.sampled: list[Sampled] = []
        self.model_probes = 0
        self.engine_metrics: str | Hang | None = None  # what GET /metrics answers; None: 404
        self.metrics_reads = 0
        self._cued: list[Answer] = []
        self._tokens = 0
        self.paused = False
        self.pausable = True  # False: its pause route answers 404, as vLLM's does without VLLM_SERVER_DEV_MODE
        self.control: list[str] = []  # every pause, resume and abort asked, by route
        self._resumed = asyncio.Event()
        self._aborted = asyncio.Event()  # set, and replaced, by every abort
        routes = {
            "openai": [
                web.get("/v1/models", self._models),
                web.post("/v1/completions", self._complete),
                web.post("/pause", self._pause),
                web.post("/resume", self._resume),
                web.post("/abort_requests", self._abort),
            ],
            "sglang": [
                web.get("/get_model_info", self._sglang_info),
                web.get("/health", self._sglang_health),
                web.post("/generate", self._sglang_generate),
                web.post("/pause_generation", self._pause),
                web.post("/continue_generation", self._resume),
                web.post("/abort_request", self._abort),
            ],
            "prorl": [web.post("/generate", self._prorl_generate)],
        }
        self.app.router.add_routes([*routes[protocol], web.get("/metrics", self._metrics)])

    def cue(self, *answers: Answer) -> None:
        """Answer the next requests with these, in order, before any script."""
        self._cued += answers

    def _next(self, prompt_ids: list[int]) -> Answer:
        if self._cued:
            return self._cued.pop(0)
        prompt = self.chat.decode(prompt_ids)
        found = SCRIPT.search(prompt)
        script = self.scripts.get(found.group(1), self.script) if found else self.script
        turn = max(prompt.count(f"{START}assistant") - 1, 0)
        return script[turn] if turn < len(script) else finish_call()

    async def _metrics(self, request: web.Request) -> web.Response:
        self.metrics_reads += 1
        self.changed()
        if isinstance(self.engine_metrics, Hang):
            await self.hold()
        if not isinstance(self.engine_metrics, str):
            raise web.HTTPNotFound()
        return web.Response(text=self.engine_metrics, content_type="text/plain")

    # -- weight updates ---------------------------------------------------------------------------------------
    async def _pause(self, request: web.Request) -> web.Response:
        if not self.pausable:
            raise web.HTTPNotFound()
        self.control.append(f"{request.path_qs} {await request.text()}".strip())
        self.paused = True
        self._resumed = asyncio.Event()
        if request.query.get("mode") != "keep":
            self.abort()
        self.changed()
        return web.json_response({"status": "paused"})

    async def _resume(self, request: web.Request) -> web.Response:
        self.control.append(request.path)
        self.paused = False
        self._resumed.set()
        self.changed()
        return web.json_response({"status": "resumed"})

    async def _abort(self, request: web.Request) -> web.Response:
        self.control.append(f"{request.path} {await request.text()}".strip())
        self.abort()
        return web.json_response({"status": "aborted"})

    def abort(self) -> None:
        """Abort every request in flight (an `Interruptible` answers its sampled part; a queued one, nothing)."""
        self._aborted.set()
        self._aborted = asyncio.Event()
        self.changed()

    async def _until_aborted(self, other: asyncio.Event) -> bool:
        """Wait for `other` or an abort; True if it was the abort."""
        aborted = self._aborted
        waits = [asyncio.ensure_future(aborted.wait()), asyncio.ensure_future(other.wait())]
        self.held += 1
        self.changed()
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.held -= 1
            for wait in waits:
                wait.cancel()
        return aborted.is_set()

    async def _models(self, request: web.Request) -> web.Response:
        self.model_probes += 1
        self.changed()
        if self.down:
            return web.json_response({"error": "down"}, status=503)
        if self.models_body is not None:
            return web.Response(body=self.models_body, content_type="application/json")
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _sample(
        self, prompt_ids: list[int], max_tokens: int, stop: list[str] | None = None
    ) -> Sampled | web.Response:
        """The scripted answer to one request, or the failure the script says. A stop string ends it as vLLM's
        OpenAI server does: the ids up to the token that completes it, the text trimmed before it."""
        self.changed()
        if self.paused and await self._until_aborted(self._resumed):  # queued while paused, then aborted
            return self._record(Sampled(prompt_ids, [], [], "", "abort"))
        answer = self._next(prompt_ids)
        if self.down:
            answer = Fail(503, "down")
        if isinstance(answer, Interruptible):
            if await self._until_aborted(self._released):
                ids = self.chat.encode(answer.text)[: min(answer.sampled, max_tokens)]
                return self._record(Sampled(prompt_ids, ids, self._logprobs(len(ids)), self.chat.decode(ids), "abort"))
            answer = answer.text
        if isinstance(answer, Hang):
            await self.hold()
            answer = answer.then or finish_call()
        if isinstance(answer, Fail):
            return web.json_response({"error": {"message": answer.message}}, status=answer.status)
        if isinstance(answer, Garbage):
            return web.Response(body=answer.body, content_type="application/json")
        reply = answer if isinstance(answer, Reply) else Reply(answer)
        ids = self.chat.encode(reply.text) + ([self.chat.eos_id] if reply.closed else [])
        finish_reason = "stop"
        if len(ids) > max_tokens:
            ids, finish_reason = ids[:max_tokens], "length"
        text = self.chat.decode([i for i in ids if i != self.chat.eos_id])
        for end in range(1, len(ids) + 1) if stop else ():
            seen = self.chat.decode([i for i in ids[:end] if i != self.chat.eos_id])
            at = min((seen.find(s) for s in stop if s in seen), default=-1)
            if at >= 0:
                ids, text, finish_reason = ids[:end], seen[:at], "stop"
                break
        return self._record(Sampled(prompt_ids, ids, self._logprobs(len(ids)), text, finish_reason))

    def _logprobs(self, count: int) -> list[float]:
        logprobs = [-((self._tokens + i) % 97 + 1) / 100 for i in range(count)]  # distinct, never 0.0
        self._tokens += count
        return logprobs

    def _record(self, sampled: Sampled) -> Sampled:
        self.sampled.append(sampled)
        self.changed()
        return sampled

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        if body.get("stream"):
            return await self._stream(request, body)
        sampled = await self._sample(body["prompt"], body["max_tokens"], body.get("stop"))
        if isinstance(sampled, web.Response):
            return sampled
        choice = {
            "index": 0,
            "text": sampled.text,
            "token_ids": sampled.token_ids,
            "finish_reason": sampled.finish_reason,
            "logprobs": {"token_logprobs": sampled.logprobs},
        }
        return web.json_response({"choices": [choice]})

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await stream.prepare(request)
        events: list[tuple[list[int], list[float], str | None]] = []  # (ids, logprobs, finish reason) per event

        async def send(ids: list[int], finish: str | None) -> None:
            logprobs = self._logprobs(len(ids))
            choice = {
                "index": 0,
                "text": self.chat.decode(ids),
                "token_ids": ids,
                "finish_reason": finish,
                "logprobs": {"token_logprobs": logprobs},
            }
            events.append((ids, logprobs, finish))
            await stream.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())

        answer = self._cued[0] if self._cued else None
        if isinstance(answer, Interruptible):
            self._cued.pop(0)
            ids = [*self.chat.encode(answer.text), self.chat.eos_id]
            cut = min(answer.sampled, body["max_tokens"])
            for token in ids[:cut]:
                await send([token], None)
            if await self._until_aborted(self._released):
                await send([], "abort")
            else:
                rest = ids[cut : body["max_tokens"]]
                for token in rest:
                    await send([token], None)
                await send([], "stop" if len(ids) <= body["max_tokens"] else "length")
        else:
            sampled = await self._sample(body["prompt"], body["max_tokens"], body.get("stop"))
            if isinstance(sampled, web.Response):
                return sampled
            for token in sampled.token_ids:
                await send([token], None)
            await send([], sampled.finish_reason)
        ids = [token for chunk, _, _ in events for token in chunk]
        logprobs = [logprob for _, chunk, _ in events for logprob in chunk]
        self.sampled.append(Sampled(body["prompt"], ids, logprobs, self.chat.decode(ids), events[-1][2] or "stop"))
        self.changed()
        await stream.write(b"data: [DONE]\n\n")
        await stream.write_eof()
        return stream

    # -- SGLang's native API, as its docs give it ----------------------------------------------------------
    async def _sglang_info(self, request: web.Request) -> web.Response:
        self.model_probes += 1
        return web.json_response({"model_path": self.model, "tokenizer_path": self.model, "is_generation": True})

    async def _sglang_health(self, request: web.Request) -> web.Response:
        self.model_probes += 1
        return web.Response(status=503 if self.down else 200)

    async def _sglang_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        sampled = await self._sample(body["input_ids"], body["sampling_params"].get("max_new_tokens", 128))
        if isinstance(sampled, web.Response):
            return sampled
        finish = {"type": sampled.finish_reason}
        if sampled.finish_reason == "length":
            finish["length"] = len(sampled.token_ids)
        entries = [[lp, token, None] for lp, token in zip(sampled.logprobs, sampled.token_ids, strict=True)]
        meta = {"id": "0", "finish_reason": finish, "output_token_logprobs": entries}
        return web.json_response({"text": sampled.text, "output_ids": sampled.token_ids, "meta_info": meta})

    # -- ProRL Agent's token-level /generate -------------------------------------------------------------
    async def _prorl_generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        sampled = await self._sample(body["prompt_ids"], body["max_tokens"])
        if isinstance(sampled, web.Response):
            return sampled
        return web.json_response({"response_ids": sampled.token_ids, "logprobs": sampled.logprobs})
