"""OpenAI's Responses API, as far as the LLM gateway serves it: a translation to and from the chat messages the
policy's template renders (docs/gateway.md, "Other protocols").

A request's `input` (a string, or items: messages, `function_call`, `function_call_output`), after the messages of
the response it continues (`previous_response_id`, kept by the episode), becomes chat messages: `instructions` the
system message, a message item a message of its role, consecutive `function_call` items the tool calls of one
assistant message (after the assistant's text, where the item before them was its message), a
`function_call_output` a tool message. The answer's text and tool calls become a `message` item and
`function_call` items, which translate back to exactly the assistant message the call recorded, so that a
harness sending its history back extends the episode's token history as a chat harness does.

Not served, and refused with a 400 naming them: hosted tools (web search, file search, computer use, MCP, code
interpreter, custom grammars), images and files in the input, references to stored items. Reasoning items are
skipped: the policy's own reasoning is in the text it sampled.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .wire import WireError, chat_function, refuse_unserved

LOGPROBS = "message.output_text.logprobs"  # what `include` names to get the sampled tokens' logprobs


class ResponsesRequest(BaseModel):
    """Body of POST /gateway/{key}/v1/responses. Fields a harness sends that change nothing here (`store`,
    `metadata`, `reasoning`, `text`, `truncation`, `user`, ...) are accepted and ignored, as are its sampling
    settings: the job's hold."""

    model_config = ConfigDict(
        extra="ignore", json_schema_extra={"examples": [{"model": "policy", "input": "list the files"}]}
    )

    model: str = Field("", description="any name: the episode's policy answers")
    input: str | list[dict[str, Any]] = Field(description="text (one user message) or items")
    instructions: str | None = Field(None, description="the system message (not carried over from a previous one)")
    tools: list[dict[str, Any]] | None = Field(None, description="function tools ({type, name, parameters, ...})")
    tool_choice: str | dict[str, Any] | None = Field(None, description='"none" leaves tool calls in the text')
    max_output_tokens: int | None = Field(None, gt=0, description="at most this many tokens (and at most the job's)")
    previous_response_id: str | None = Field(None, description="a response of this episode that this one continues")
    store: bool = Field(True, description="false: this response cannot be continued by previous_response_id")
    stream: bool = False
    include: list[str] | None = Field(None, description=f"{LOGPROBS!r}: the sampled tokens' logprobs")
    parallel_tool_calls: bool | None = None
    temperature: float | None = Field(None, description="ignored: the job's sampling settings hold")
    top_p: float | None = Field(None, description="ignored: the job's sampling settings hold")

    @model_validator(mode="before")
    @classmethod
    def _served(cls, body: Any) -> Any:
        if isinstance(body, dict) and isinstance(body.get("text"), dict):
            kind = (body["text"].get("format") or {}).get("type", "text")
            if kind != "text":
                raise ValueError(f"text.format {kind!r} is not served: the policy's answer is free text")
        return refuse_unserved(body, UNSERVED)


UNSERVED = {
    "conversation": "the gateway keeps no conversations; send the items, or previous_response_id",
    "prompt": "the gateway keeps no prompt templates; send the instructions and input",
    "background": "each call is answered in the episode, while it waits",
}


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens: int
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})
    total_tokens: int


class ResponseObject(BaseModel):
    """A response as the Responses API returns it, with the exact token ids beside (as the chat endpoint gives
    them)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    error: None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    prompt_token_ids: list[int] = Field(default_factory=list, description="the exact prompt the policy saw")
    token_ids: list[int] = Field(default_factory=list, description="the sampled token ids")


@dataclass
class ResponseStore:
    """One episode's responses that a later call may continue (`previous_response_id`), as chat messages (text
    only, whatever else the items held; the instructions are not kept, as OpenAI keeps them not). Each response
    keeps only what it adds to the longest stored conversation it extends, so a harness that sends its whole
    history every turn with `store` on (the SDKs' default) costs the conversation once, not once per turn."""

    _responses: dict[str, tuple[str | None, list[dict[str, Any]]]] = field(default_factory=dict)
    _ends: dict[str, str] = field(default_factory=dict)  # a stored conversation's digest -> its response

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The messages of `response_id`'s conversation (its input and answer after all it continued)."""
        parts = []
        while response_id is not None:
            if response_id not in self._responses:
                raise WireError(f"previous_response_id {response_id!r}: no stored response of this episode")
            response_id, added = self._responses[response_id]
            parts.append(added)
        return [message for added in reversed(parts) for message in added]

    def add(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        digests = _running_digests(conversation)
        start, previous = max(((k, self._ends[d]) for k, d in enumerate(digests) if d in self._ends), default=(0, None))
        self._responses[response_id] = (previous, conversation[start:])
        self._ends[digests[-1]] = response_id


def _running_digests(messages: list[dict[str, Any]]) -> list[str]:
    """digests[k] identifies messages[:k], exactly (ids included)."""
    digests = [hashlib.sha256(b"").hexdigest()]
    for message in messages:
        digests.append(hashlib.sha256((digests[-1] + json.dumps(message, sort_keys=True)).encode()).hexdigest())
    return digests


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat form the template and the chat endpoint take."""
    out = []
    for index, tool in enumerate(tools or []):
        kind = tool.get("type")
        if kind != "function":
            raise WireError(f"tools[{index}]: type {kind!r} is not served; only function tools are")
        out.append(chat_function(index, tool, tool.get("parameters") or {"type": "object", "properties": {}}))
    return out or None


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat messages `items` make."""
    messages: list[dict[str, Any]] = []
    calls_join: dict[str, Any] | None = None  # the assistant message the next function_call items belong to
    for index, item in enumerate(items):
        if not isinstance(item, dict):
            raise WireError(f"input[{index}]: an item is an object")
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": _role(index, item), "content": _text(index, item.get("content"))}
            messages.append(message)
            calls_join = message if message["role"] == "assistant" else None
        elif kind == "function_call":
            call = _function_call(index, item)
            if calls_join is None:
                calls_join = {"role": "assistant", "content": ""}
                messages.append(calls_join)
            calls_join.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise WireError(f"input[{index}]: a function_call_output needs its call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _text(index, item.get("output"))})
            calls_join = None
        elif kind == "reasoning":
            continue  # the policy's reasoning is in its sampled text; another model's is not this policy's
        else:
            raise WireError(
                f"input[{index}]: item type {kind!r} is not served (messages, function_call and "
                "function_call_output are)"
            )
    return messages


def _role(index: int, item: dict[str, Any]) -> str:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise WireError(f"input[{index}]: role {role!r} is not one of user, assistant, system, developer")
    return role


def _text(index: int, content: Any) -> str:
    """A message's content (a string or text parts) or a function output as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise WireError(f"input[{index}]: content is a string or a list of parts")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            texts.append(str(part.get("text", "")))
        elif kind == "refusal":
            texts.append(str(part.get("refusal", "")))
        else:
            raise WireError(f"input[{index}]: content part {kind!r} is not served (the policy reads text only)")
    return "".join(texts)


def _function_call(index: int, item: dict[str, Any]) -> dict[str, Any]:
    name, arguments = item.get("name"), item.get("arguments", "{}")
    if not isinstance(name, str) or not name or not isinstance(arguments, str):
        raise WireError(f"input[{index}]: a function_call needs a name and arguments as JSON text")
    return {
        "id": item.get("call_id") or item.get("id"),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def output_items(
    content: str, calls: list[tuple[str, str, str]], logprobs: list[dict] | None, cut: bool = False
) -> list[dict]:
    """The answer as output items: its text as a message (where it has text, or no calls; `incomplete` where the
    turn was `cut` at its token limit), then one `function_call` per (call_id, name, arguments)."""
    items: list[dict[str, Any]] = []
    if content or not calls:
        part: dict[str, Any] = {"type": "output_text", "text": content, "annotations": []}
        if logprobs is not None:
            part["logprobs"] = logprobs
        items.append(
            {
                "type": "message",
                "id": _id("msg"),
                "status": "incomplete" if cut else "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for call_id, name, arguments in calls:
        items.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call_id,
                "name": name,
                "arguments": arguments,
                "status": "completed",
            }
        )
    return items


def response_id() -> str:
    return _id("resp")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- streaming ----------------------------------------------------------------------------------------------
def stream_events(response: ResponseObject) -> list[tuple[str, dict[str, Any]]]:
    """The whole answer as the Responses API streams it: (event type, data) pairs, numbered in order."""
    start = response.model_copy(
        update={
            "status": "in_progress",
            "output": [],
            "usage": None,
            "incomplete_details": None,
            "prompt_token_ids": [],
            "token_ids": [],
        }
    )
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": start.model_dump()},
        {"type": "response.in_progress", "response": start.model_dump()},
    ]
    for index, item in enumerate(response.output):
        events += _item_events(index, item)
    final = "response.completed" if response.status == "completed" else "response.incomplete"
    events.append({"type": final, "response": response.model_dump()})
    return [(event["type"], {**event, "sequence_number": n}) for n, event in enumerate(events)]


def _item_events(index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    at = {"output_index": index, "item_id": item["id"]}
    if item["type"] == "function_call":
        return [
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": {**item, "arguments": "", "status": "in_progress"},
            },
            {"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]},
            {
                "type": "response.function_call_arguments.done",
                **at,
                "name": item["name"],
                "arguments": item["arguments"],
            },
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]
    [part] = item["content"]
    empty = {**part, "text": ""}
    empty.pop("logprobs", None)
    delta: dict[str, Any] = {"type": "response.output_text.delta", **at, "content_index": 0, "delta": part["text"]}
    delta["logprobs"] = part.get("logprobs", [])
    return [
        {
            "type": "response.output_item.added",
            "output_index": index,
            "item": {**item, "status": "in_progress", "content": []},
        },
        {"type": "response.content_part.added", **at, "content_index": 0, "part": empty},
        delta,
        {
            "type": "response.output_text.done",
            **at,
            "content_index": 0,
            "text": part["text"],
            "logprobs": part.get("logprobs", []),
        },
        {"type": "response.content_part.done", **at, "content_index": 0, "part": part},
        {"type": "response.output_item.done", "output_index": index, "item": item},
    ]
