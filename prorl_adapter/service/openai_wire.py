"""The OpenAI API's wire format, as far as the LLM gateway serves it: chat completions (tools, streaming),
completions and the model list.

These are OpenAI's types, not this project's contract (that is models.py), so they live beside the gateway.
Requests ignore fields they do not know: harnesses send many (`user`, `store`, `metadata`, penalties) that change
nothing here, and refusing them would break the promise that only the base URL and the key change. Fields that
would change what is sampled in ways a trajectory cannot record (`n` > 1) are refused with a 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: bool = False


class FunctionCallIn(_Lenient):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = Field("{}", description="JSON text (OpenAI's form) or an object")


class ToolCallIn(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """A message as a harness sends it: role, content (text or parts), tool calls, the tool's call id.
    `developer` is rendered as `system`, the role chat templates know."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Images, audio and files are refused, not dropped: the policy reads text only."""
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text":
                raise ValueError(f"content part {part.get('type')!r} is not served (the policy reads text only)")
        return content


class SamplingFields(_Lenient):
    model: str = Field("", description="any name: the episode's policy answers")
    max_tokens: int | None = Field(None, gt=0, description="at most this many tokens (and at most the job's)")
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = Field(1, description="one sample per call: each call is one turn of the trajectory")
    temperature: float | None = Field(None, description="ignored: the job's sampling settings hold")
    top_p: float | None = Field(None, description="ignored: the job's sampling settings hold")
    seed: int | None = None

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(SamplingFields):
    """Body of POST /gateway/{key}/v1/chat/completions."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"model": "policy", "messages": [{"role": "user", "content": "hi"}]}]},
    )

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None

    @field_validator("tools")
    @classmethod
    def _function_tools_only(cls, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for tool in tools or ():
            if tool.get("type", "function") != "function":
                raise ValueError(f"tool type {tool.get('type')!r} is not served; only function tools are")
        return tools

    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" leaves tool calls in the text')
    max_completion_tokens: int | None = Field(None, gt=0, description="the same as max_tokens")
    logprobs: bool = False


class CompletionRequest(SamplingFields):
    """Body of POST /gateway/{key}/v1/completions: a text prompt, or token ids (what keeps a history exact)."""

    model_config = ConfigDict(extra="ignore", json_schema_extra={"examples": [{"model": "policy", "prompt": [1, 2]}]})

    prompt: str | list[int] = Field(description="text (encoded here) or token ids (used as they are)")
    logprobs: int | None = Field(None, ge=0, le=1, description="1: the sampled tokens' logprobs")


# -- replies ----------------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text, as OpenAI sends it")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class TokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] = Field(description="the sampled token ids (vLLM's return_token_ids)")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] = Field(description="the exact prompt the policy saw")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    prompt_token_ids: list[int]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "prorl-rollout"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- errors -----------------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


class OpenAIError(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_error, server_error, ...")
    param: str | None = None
    code: str | None = None


class OpenAIErrorBody(BaseModel):
    """An error as OpenAI's API answers one, which its SDKs read."""

    error: OpenAIError

    @classmethod
    def of(cls, status: int, message: str, code: str | None = None) -> OpenAIErrorBody:
        kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        return cls(error=OpenAIError(message=message, type=kind, code=code))
