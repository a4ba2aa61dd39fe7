"""A scripted LLM stand-in (NOT a model): the part of vLLM's OpenAI-compatible API that `LLMPool` uses
(GET /v1/models, POST /v1/completions with a token-id prompt and `return_token_ids`, `logprobs: 1`), answering
with texts chosen in advance, tokenised by the `CharChat` stand-in. With `protocol="sglang"` it speaks SGLang's
native API instead (GET /get_model_info and /health, POST /generate with `input_ids`, as SGLang documents them),
and with `protocol="prorl"` ProRL Agent's token-level POST /generate (`prompt_ids` in, `response_ids` and
`logprobs` out; no health route). `engine_metrics`, when set, is the Prometheus text its GET /metrics answers
(as vLLM's would; unset: 404; `HANG`: held until released).

Which text: answers cued with `cue(...)` go first, one per request, whatever the prompt. Otherwise the prompt
picks a script: `[script:NAME]` anywhere in it names one of `scripts` (else `script` is used), and the number
of assistant turns already in the prompt picks the entry; past the end of a script it calls `finish`. An entry
is a text (a turn closed by the end-of-turn token, as a sampled turn is), or `Reply`, `Fail`, `Garbage`, `HANG`.
`max_tokens` is honoured: a longer turn is cut there, with finish_reason "length".
"""

from __future__ import annotations

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


Answer = str | Reply | Fail | Garbage | Hang


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
        routes = {
            "openai": [web.get("/v1/models", self._models), web.post("/v1/completions", self._complete)],
            "sglang": [
                web.get("/get_model_info", self._sglang_info),
                web.get("/health", self._sglang_health),
                web.post("/generate", self._sglang_generate),
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
        answer = self._next(prompt_ids)
        if self.down:
            answer = Fail(503, "down")
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
        logprobs = [-((self._tokens + i) % 97 + 1) / 100 for i in range(len(ids))]  # distinct, never 0.0
        self._tokens += len(ids)
        sampled = Sampled(prompt_ids, ids, logprobs, text, finish_reason)
        self.sampled.append(sampled)
        self.changed()
        return sampled

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
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
