"""The wire formats the LLM pool speaks, one class each: how to ask a server for one turn in token space, how to
read its answer, and how to tell that it serves.

- `openai`: vLLM's OpenAI-compatible `/v1/completions` with a token-id prompt (`return_token_ids`, `logprobs: 1`).
- `sglang`: SGLang's native `/generate` (`input_ids` in; `output_ids` and `meta_info.output_token_logprobs` out).
- `prorl`: ProRL Agent's token-level `/generate` (`prompt_ids` in; `response_ids` and `logprobs` out), as served by
  NeMo-RL's vLLM workers for ProRL.

A server's URL may name its protocol (`sglang+http://host:port`); a plain `http://` URL is probed (`detect`). Every
answer is validated by a model: a malformed 200 is the server's failure, like a 5xx, and the episode fails over.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, Field, StrictInt, ValidationError

from server_kit.errors import DownstreamError, ProrlError
from server_kit.openapi import describe_validation

from ..models import SamplingParams


class MalformedAnswer(DownstreamError):
    """A server answered 200 with something that is not an answer of its protocol."""


class UnsupportedRequest(ProrlError):
    """The request asks for what the server's protocol cannot say (a regex over the ProRL protocol, say)."""


@dataclass
class Sampled:
    token_ids: list[int]
    logprobs: list[float]
    text: str | None  # None where the protocol returns ids only: the caller decodes them
    finish_reason: str | None
    aborted: bool = False  # the server stopped it before it ended (a pause, an abort): the ids are a beginning


def _validated(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise MalformedAnswer(f"malformed answer: {describe_validation(exc)[:300]}") from None


def _same_length(ids: list[int], logprobs: list[float]) -> None:
    if len(ids) != len(logprobs):
        raise MalformedAnswer(f"malformed answer: {len(ids)} ids but {len(logprobs)} logprobs")


Request = tuple[str, str, dict | None]  # method, path, JSON body


class Protocol(ABC):
    name: ClassVar[str]
    needs_model: ClassVar[bool] = False  # its requests name the served model, read by the health check
    streams: ClassVar[bool] = False  # it can stream a turn's tokens as they are sampled (`stream_request`)

    @abstractmethod
    def health_request(self) -> Request:
        """The request that tells whether the server serves."""

    def read_health(self, body: bytes) -> str | None:
        """Check the health answer (MalformedAnswer if it is none); the served model's name where it says it."""
        return None

    def detect_requests(self) -> list[Request]:
        """What tells a server of this protocol from the others when its URL does not say: its health check,
        unless the protocol has a route that only it serves."""
        return [self.health_request()]

    def read_detect(self, body: bytes) -> str | None:
        """Check a detection answer like a health answer (MalformedAnswer: not this protocol)."""
        return self.read_health(body)

    @abstractmethod
    def generate_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        """(path, JSON body) of a request for one turn."""

    @abstractmethod
    def parse(self, body: bytes) -> Sampled: ...

    def stream_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        """(path, JSON body) of a request for one turn whose tokens come as server-sent events."""
        raise UnsupportedRequest(f"the {self.name} protocol is not read as a stream here")

    def parse_event(self, data: bytes) -> Sampled | None:
        """One event's tokens (the `data:` of a server-sent event); None at the stream's end."""
        raise UnsupportedRequest(f"the {self.name} protocol is not read as a stream here")

    # -- weight updates (weight_barrier.py) ------------------------------------------------------------------
    def pause_request(self, mode: str) -> Request:
        """The request that pauses the server's generation with its in-flight requests aborted (`mode`: the
        barrier's). UnsupportedRequest where the protocol cannot."""
        raise UnsupportedRequest(f"the {self.name} protocol has no way to abort generation: use mode 'drain'")

    def resume_request(self) -> Request:
        raise UnsupportedRequest(f"the {self.name} protocol cannot pause, so cannot resume")

    def abort_request(self) -> Request:
        """The request that aborts every request in flight at the server (paused or not)."""
        raise UnsupportedRequest(f"the {self.name} protocol has no abort")


# -- vLLM's OpenAI-compatible completions ----------------------------------------------------------------
class _Model(BaseModel):
    id: str


class _Models(BaseModel):
    """What this client needs of /v1/models: the served model's name."""

    data: list[_Model] = Field(min_length=1)


class _Logprobs(BaseModel):
    token_logprobs: list[float]


class _Choice(BaseModel):
    text: str
    token_ids: list[StrictInt]
    logprobs: _Logprobs
    finish_reason: str | None = None


class _Completion(BaseModel):
    choices: list[_Choice] = Field(min_length=1)


class _EventChoice(BaseModel):
    text: str = ""
    token_ids: list[StrictInt] = Field(default_factory=list)
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None


class _Event(BaseModel):
    choices: list[_EventChoice]  # empty in a usage-only event


class OpenAICompletions(Protocol):
    name = "openai"

    needs_model = True

    def health_request(self) -> Request:
        return "GET", "/v1/models", None

    def read_health(self, body: bytes) -> str | None:
        return _validated(_Models, body).data[0].id

    def generate_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.stop:
            body["stop"] = sampling.stop
        if sampling.regex:
            body["structured_outputs"] = {"regex": sampling.regex}
        return "/v1/completions", body

    def parse(self, body: bytes) -> Sampled:
        choice = _validated(_Completion, body).choices[0]
        _same_length(choice.token_ids, choice.logprobs.token_logprobs)
        aborted = choice.finish_reason == "abort"  # vLLM's reason for a request aborted by a pause or an abort
        return Sampled(choice.token_ids, choice.logprobs.token_logprobs, choice.text, choice.finish_reason, aborted)

    streams = True

    def stream_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        path, body = self.generate_request(prompt_ids, sampling, model)
        return path, {**body, "stream": True}  # each event carries its new tokens' ids and logprobs

    def parse_event(self, data: bytes) -> Sampled | None:
        if data == b"[DONE]":
            return None
        choices = _validated(_Event, data).choices
        if not choices:
            return Sampled([], [], "", None)
        choice = choices[0]
        logprobs = choice.logprobs.token_logprobs if choice.logprobs is not None else []
        _same_length(choice.token_ids, logprobs)
        aborted = choice.finish_reason == "abort"
        return Sampled(choice.token_ids, logprobs, choice.text, choice.finish_reason, aborted)

    # vLLM serves these with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/rl/online/api_router.py). A paused server
    # queues new requests until its resume; `keep` freezes the requests in flight, which go on at the resume.
    def pause_request(self, mode: str) -> Request:
        return "POST", f"/pause?mode={mode}", None

    def resume_request(self) -> Request:
        return "POST", "/resume", None

    def abort_request(self) -> Request:
        # Pausing again in abort mode aborts what reached the server after its pause (queued there); measured on
        # vLLM 0.32, where `/abort_requests` was not seen to.
        return self.pause_request("abort")


# -- SGLang's native /generate ---------------------------------------------------------------------------
class _SGLangFinish(BaseModel):
    type: str


class _SGLangMeta(BaseModel):
    # Each entry is [logprob, token id, token text or null].
    output_token_logprobs: list[tuple[float, StrictInt, str | None]]
    finish_reason: _SGLangFinish | None = None


class _SGLangAnswer(BaseModel):
    text: str
    output_ids: list[StrictInt] | None = None  # older servers leave it out: the ids are in the logprobs too
    meta_info: _SGLangMeta


class _SGLangModelInfo(BaseModel):
    model_path: str


class SGLangGenerate(Protocol):
    name = "sglang"

    def health_request(self) -> Request:
        return "GET", "/health", None

    def detect_requests(self) -> list[Request]:
        # SGLang serves an OpenAI-compatible /v1/models too, but its completions return no token ids: its own
        # model-info route (renamed in newer versions) tells it apart, and is asked for first.
        return [("GET", "/get_model_info", None), ("GET", "/model_info", None)]

    def read_detect(self, body: bytes) -> str | None:
        _validated(_SGLangModelInfo, body)
        return None

    def generate_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "skip_special_tokens": False,
            "no_stop_trim": True,  # the stop string stays in the text, as the sampled ids have it
        }
        if sampling.seed is not None:
            params["sampling_seed"] = sampling.seed
        if sampling.stop:
            params["stop"] = sampling.stop
        if sampling.regex:
            params["regex"] = sampling.regex
        return "/generate", {"input_ids": prompt_ids, "sampling_params": params, "return_logprob": True}

    def parse(self, body: bytes) -> Sampled:
        answer = _validated(_SGLangAnswer, body)
        entries = answer.meta_info.output_token_logprobs
        ids = answer.output_ids if answer.output_ids is not None else [entry[1] for entry in entries]
        logprobs = [entry[0] for entry in entries]
        _same_length(ids, logprobs)
        if any(entry[1] != token for entry, token in zip(entries, ids, strict=True)):
            raise MalformedAnswer("malformed answer: output_ids and output_token_logprobs name different tokens")
        finish = answer.meta_info.finish_reason
        reason = finish.type if finish is not None else None
        # Its text keeps the stop token's text (no_stop_trim, special tokens kept): the ids are decoded instead,
        # as for every protocol that answers with ids, so a turn's text is the same whatever the server.
        return Sampled(ids, logprobs, None, reason, reason == "abort")

    # SGLang's weight-update routes (python/sglang/srt/entrypoints/http_server.py): a paused server holds new
    # requests until it continues. Its `in_place` pause would be `keep`, but its stream is not read here.
    def pause_request(self, mode: str) -> Request:
        if mode != "abort":
            raise UnsupportedRequest(f"the sglang protocol is paused in abort mode only here, not {mode!r}")
        return "POST", "/pause_generation", {"mode": "abort"}

    def resume_request(self) -> Request:
        return "POST", "/continue_generation", {}

    def abort_request(self) -> Request:
        return "POST", "/abort_request", {"rid": "", "abort_all": True}


# -- ProRL Agent's token-level /generate -----------------------------------------------------------------
class _ProRLAnswer(BaseModel):
    response_ids: list[StrictInt]
    # ProRL's own client accepts an answer without logprobs; a trainer cannot (its importance weights would be
    # computed against zeros), so here they are required.
    logprobs: list[float]


class ProRLGenerate(Protocol):
    name = "prorl"

    def health_request(self) -> Request:
        # The protocol has no health route: one token of generation is the check (as SGLang's /health_generate),
        # a request like every other (its servers index each key they read).
        return "POST", *self.generate_request([0], SamplingParams(max_tokens=1), None)

    def read_health(self, body: bytes) -> str | None:
        self.parse(body)
        return None

    def generate_request(self, prompt_ids: list[int], sampling: SamplingParams, model: str | None) -> tuple[str, dict]:
        if sampling.stop or sampling.regex:
            raise UnsupportedRequest("ProRL's /generate protocol has no stop strings or regex: drop them for this task")
        body = {
            "prompt_ids": prompt_ids,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "skip_special_tokens": False,
        }
        return "/generate", body

    def parse(self, body: bytes) -> Sampled:
        answer = _validated(_ProRLAnswer, body)
        _same_length(answer.response_ids, answer.logprobs)
        return Sampled(answer.response_ids, answer.logprobs, None, None)


# A plain URL is probed in this order (SGLang first: see its detect_requests).
PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (SGLangGenerate(), OpenAICompletions(), ProRLGenerate())}


def split_url(url: str) -> tuple[str | None, str]:
    """(the protocol a URL names, or None; the server's base URL). `sglang+http://h:8000` -> ("sglang", "http://h:8000").
    An OpenAI base URL ending in /v1 names the same server as the URL without it."""
    protocol, plus, rest = url.partition("+")
    named = protocol if plus and protocol in PROTOCOLS else None
    base = (rest if named else url).rstrip("/")
    return named, base.removesuffix("/v1")
