"""Anthropic's Messages API, as far as the LLM gateway serves it: a translation to and from the chat messages the
policy's template renders (docs/gateway.md, "Other protocols").

`system` (a string or text blocks) becomes the system message; a user message's `tool_result` blocks become tool
messages (in order, an error result's text after "Error: "), its text blocks one user message; an assistant
message's text and `tool_use` blocks one assistant message with tool calls (`thinking` blocks are skipped: the
policy's reasoning is in its sampled text). The answer's text and tool calls become a `text` block and
`tool_use` blocks, which translate back to exactly the assistant message the call recorded, so a harness sending
its history back extends the episode's token history as a chat harness does.

Not served, and refused with a 400 naming them: server tools (web search, code execution, Anthropic's versioned
client tools such as `bash_20250124`), images and documents. Text blocks of one message are joined by newlines.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .wire import WireError, chat_function, refuse_unserved

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
}  # and api_error for the rest of 5xx: overloaded_error goes with 529, which the gateway never answers


class MessagesQuery(BaseModel):
    """Anthropic's SDK asks its beta features' endpoints with `?beta=true` (Claude Code does): the same call."""

    model_config = ConfigDict(extra="forbid")

    beta: bool | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """Body of POST /gateway/{key}/v1/messages/count_tokens: what a message call would send, without sampling."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={"examples": [{"model": "policy", "messages": [{"role": "user", "content": "hi"}]}]},
    )

    model: str = Field("", description="any name: the episode's policy answers")
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = Field(None, description="client tools ({name, description, input_schema})")
    tool_choice: dict[str, Any] | None = Field(None, description='{"type": "none"} leaves tool calls in the text')


class MessagesRequest(CountTokensRequest):
    """Body of POST /gateway/{key}/v1/messages. Fields a harness sends that change nothing here (`metadata`,
    `thinking`, `service_tier`, ...) are accepted and ignored, as are its sampling settings: the job's hold."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "examples": [{"model": "policy", "max_tokens": 256, "messages": [{"role": "user", "content": "hi"}]}]
        },
    )

    max_tokens: int = Field(gt=0, description="at most this many tokens (and at most the job's)")
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, description="ignored: the job's sampling settings hold")
    top_p: float | None = Field(None, description="ignored: the job's sampling settings hold")
    top_k: int | None = Field(None, description="ignored: the job's sampling settings hold")

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: Any) -> Any:
        return refuse_unserved(body, UNSERVED)


UNSERVED = {
    "mcp_servers": "MCP servers run on Anthropic's side; give the harness's own tools instead",
    "container": "code execution containers run on Anthropic's side",
    "output_format": "the policy's answer is free text",
}


class MessageUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessageObject(BaseModel):
    """A message as the Messages API returns it, with the exact token ids beside (as the chat endpoint gives
    them)."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: Literal["end_turn", "tool_use", "max_tokens", "stop_sequence"] | None
    stop_sequence: str | None = None
    usage: MessageUsage
    prompt_token_ids: list[int] = Field(default_factory=list, description="the exact prompt the policy saw")
    token_ids: list[int] = Field(default_factory=list, description="the sampled token ids")


class TokenCount(BaseModel):
    input_tokens: int


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Client tools in the chat form the template and the chat endpoint take."""
    out = []
    for index, tool in enumerate(tools or []):
        kind = tool.get("type", "custom")
        if kind != "custom" or "input_schema" not in tool:
            raise WireError(
                f"tools[{index}]: {kind!r} is not served; only client tools with an input_schema are "
                "(server tools and Anthropic's versioned tools run on Anthropic's side)"
            )
        out.append(chat_function(index, tool, tool["input_schema"]))
    return out or None


def chat_messages(system: str | list[dict[str, Any]] | None, messages: list[AnthropicMessage]) -> list[dict]:
    """The chat messages `system` and `messages` make."""
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _joined("system", system)})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out.append(_assistant(where, blocks))
            continue
        texts: list[str] = []
        for block in blocks:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result":
                if texts:  # text before a result stays before it
                    out.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                out.append(_tool_message(where, block))
            elif kind == "text":
                texts.append(str(block.get("text", "")))
            else:
                raise WireError(f"{where}: content block {kind!r} is not served (the policy reads text only)")
        if texts or not blocks:
            out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant(where: str, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    texts, calls = [], []
    for block in blocks:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            name, arguments = block.get("name"), block.get("input", {})
            if not isinstance(name, str) or not name or not isinstance(arguments, dict):
                raise WireError(f"{where}: a tool_use block needs a name and an input object")
            calls.append(
                {"id": block.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}}
            )
        elif kind in ("thinking", "redacted_thinking"):
            continue  # the policy's reasoning is in its sampled text; another model's is not this policy's
        else:
            raise WireError(f"{where}: content block {kind!r} is not served in an assistant message")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_message(where: str, block: dict[str, Any]) -> dict[str, Any]:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise WireError(f"{where}: a tool_result block needs its tool_use_id")
    content = block.get("content") or ""
    text = content if isinstance(content, str) else _joined(where, content)
    return {"role": "tool", "tool_call_id": call_id, "content": f"Error: {text}" if block.get("is_error") else text}


def _joined(where: str, content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise WireError(f"{where}: content block {kind!r} is not served (the policy reads text only)")
        texts.append(str(block.get("text", "")))
    return "\n".join(texts)


def content_blocks(content: str, calls: list[tuple[str, str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The answer as content blocks: its text (where it has any), then one `tool_use` per (id, name, input)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    blocks += [{"type": "tool_use", "id": i, "name": name, "input": arguments} for i, name, arguments in calls]
    return blocks


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


class AnthropicError(BaseModel):
    type: str = Field(description="invalid_request_error, not_found_error, rate_limit_error, overloaded_error, ...")
    message: str


class AnthropicErrorBody(BaseModel):
    """An error as Anthropic's API answers one, which its SDK reads."""

    type: Literal["error"] = "error"
    error: AnthropicError

    @classmethod
    def of(cls, status: int, message: str) -> AnthropicErrorBody:
        kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return cls(error=AnthropicError(type=kind, message=message))


# -- streaming ----------------------------------------------------------------------------------------------
def stream_events(message: MessageObject) -> list[tuple[str, dict[str, Any]]]:
    """The whole answer as the Messages API streams it: (event type, data) pairs."""
    start = message.model_copy(
        update={
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": message.usage.model_copy(update={"output_tokens": 0}),
        }
    )
    events: list[dict[str, Any]] = [{"type": "message_start", "message": start.model_dump()}, {"type": "ping"}]
    for index, block in enumerate(message.content):
        if block["type"] == "text":
            events += [
                {"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}},
                {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": block["text"]}},
            ]
        else:
            events += [
                {"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
                },
            ]
        events.append({"type": "content_block_stop", "index": index})
    events += [
        {
            "type": "message_delta",
            "delta": {"stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence},
            "usage": {"output_tokens": message.usage.output_tokens},
        },
        {"type": "message_stop"},
    ]
    return [(event["type"], event) for event in events]
