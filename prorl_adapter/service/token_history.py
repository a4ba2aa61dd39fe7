"""An agent program's LLM calls, kept in token space: the prompt of each call, and the segments they make.

The token-history rule (docs/gateway.md). A chat request's messages are compared with the calls answered before
it in this episode. When they are an earlier call's messages, then that call's answer exactly as it was given
(content and tool calls; ids and formatting may differ), then anything new, the new call's prompt is that call's
prompt ids + its sampled ids + the ids of only the new messages (rendered with the chat template and taken as
the difference from the rendering without them). So the LLM sees the exact token history, and no sampled token
is ever re-tokenised: re-encoding a sampled text often gives other ids (the tiny test model samples
`<tool_call>` in pieces that encoding merges), which silently corrupts the policy gradient.

Anything else (an edited answer, a dropped or summarised message, other tools) is rendered and encoded whole,
and starts a new segment: segments are the maximal chains of calls in which each call's prompt extends the
previous call's prompt and response as tokens. Within a segment the new context is mask 0 and the sampled tokens
mask 1, so each segment trains on its own; every sampled token is in exactly one segment.

Memory is O(the episode's tokens), not O(calls x context): the ids live once, in the segments, as they are
recorded; a call keeps its span in its segment and a digest of its messages (a chain of hashes, one per message,
so a request's every prefix is compared in one pass).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..models import Resumption, Segment, ToolCall, Turn
from .chat import ChatTokenizer


def _text(content: Any) -> str:
    """A message's content as text: a string, or OpenAI content parts of type text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments
    return arguments


def canonical(message: dict[str, Any]) -> dict[str, Any]:
    """What of a message the chat template renders, in one form, for comparing histories: role, text, tool
    calls by name and parsed arguments, the tool message's name. Call ids are left out (templates do not render
    them, and harnesses renumber them). `tool_calls` were validated as function calls (openai_wire)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))} for c in calls
        ]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content, tool-call arguments as objects, and OpenAI's
    `developer` role as the `system` role the templates know."""
    out = {k: v for k, v in message.items() if k != "content"}
    out["content"] = _text(message.get("content"))
    if out.get("role") == "developer":
        out["role"] = "system"
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            for c in message["tool_calls"]
        ]
    return out


def message_digests(messages: list[dict[str, Any]]) -> list[str]:
    """digests[k] identifies messages[:k] (canonical forms): a chain, so every prefix costs one hash."""
    digests = [hashlib.sha256(b"").hexdigest()]
    for message in messages:
        step = digests[-1] + json.dumps(canonical(message), sort_keys=True)
        digests.append(hashlib.sha256(step.encode()).hexdigest())
    return digests


def tools_key(tools: list[dict] | None) -> str | None:
    return None if not tools else json.dumps(tools, sort_keys=True)


@dataclass
class Sampled:
    """One sampled answer, as the gateway got it from the LLM pool."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    policy_version: int  # that sampled its first token
    server: str
    finish_reason: str | None
    text: str
    generate_s: float
    resumptions: list[Resumption] = field(default_factory=list)  # where an interrupted call went on


@dataclass(frozen=True)
class ChatKey:
    """What a later chat request must repeat to extend a call: its messages, its tools, its answer."""

    digest: str  # of the call's messages
    messages: int  # how many
    tools: str | None
    reply: dict[str, Any]  # the canonical assistant message answered


@dataclass
class Call:
    """One answered call: its span in its segment, and what a later request is matched against."""

    segment: int
    response_start: int  # where its sampled ids start in the segment's response
    sampled: Sampled
    chat: ChatKey | None  # None for a plain completion
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_call_errors: list[str] = field(default_factory=list)

    @property
    def history_end(self) -> int:
        """How many of its segment's ids (prompt + response) are this call's prompt and answer."""
        return self.response_start + len(self.sampled.response_ids)


@dataclass
class CallLog:
    calls: list[Call] = field(default_factory=list)
    _segments: list[Segment] = field(default_factory=list)

    # -- prompts ----------------------------------------------------------------------------------------
    def chat_prompt(
        self, chat: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict] | None
    ) -> tuple[list[int], str]:
        """The prompt ids of a chat request by the token-history rule, and its messages' digest (to record
        with the call). Called on the tokenizer's thread."""
        rendered = [template_message(m) for m in messages]
        digests = message_digests(messages)
        parent = self._extended_call(messages, digests, tools_key(tools))
        if parent is not None:
            ids = self._extension(chat, parent, rendered, tools)
            if ids is not None:
                return ids, digests[-1]
        return chat.encode(chat.render(rendered, tools, add_generation_prompt=True)), digests[-1]

    def _extended_call(self, messages: list[dict[str, Any]], digests: list[str], tools: str | None) -> Call | None:
        """The latest call whose messages and answer start `messages`, with the same tools."""
        for call in reversed(self.calls):
            key = call.chat
            if key is None or key.tools != tools or len(messages) <= key.messages:
                continue
            if digests[key.messages] == key.digest and canonical(messages[key.messages]) == key.reply:
                return call
        return None

    def _extension(
        self, chat: ChatTokenizer, parent: Call, messages: list[dict[str, Any]], tools: list[dict] | None
    ) -> list[int] | None:
        """parent's history + the ids of what `messages` add after its answer; None where the template renders
        the earlier turns differently once more follow (then the history cannot be kept as it was sampled)."""
        n = parent.chat.messages + 1
        before = chat.render(messages[:n], tools, add_generation_prompt=False)
        after = chat.render(messages, tools, add_generation_prompt=True)
        closing = chat.eos_text + chat.after_eos
        if not after.startswith(before) or not before.endswith(closing):
            return None
        ids = parent.sampled.response_ids
        closed = bool(ids) and ids[-1] == chat.eos_id
        new_text = chat.after_eos + after[len(before) :]
        return self.history(parent) + chat.encode(new_text if closed else chat.eos_text + new_text)

    def history(self, call: Call) -> list[int]:
        """The call's prompt and answer, as ids."""
        segment = self._segments[call.segment]
        return segment.prompt_ids + segment.response_ids[: call.history_end]

    # -- recording --------------------------------------------------------------------------------------
    def record(
        self,
        sampled: Sampled,
        chat: ChatKey | None = None,
        tool_calls: list[ToolCall] | None = None,
        tool_call_errors: list[str] | None = None,
    ) -> Call:
        """Add the call to the segment whose whole history its prompt extends, or start a segment with it."""
        prompt = sampled.prompt_ids
        index = next((k for k, s in enumerate(self._segments) if _extends(prompt, s)), None)
        if index is None:
            self._segments.append(Segment(prompt_ids=prompt, response_ids=[], response_mask=[], response_logprobs=[]))
            index = len(self._segments) - 1
        segment = self._segments[index]
        context = prompt[len(segment.prompt_ids) + len(segment.response_ids) :]
        segment.response_ids += context
        segment.response_mask += [0] * len(context)
        segment.response_logprobs += [0.0] * len(context)
        start = len(segment.response_ids)
        segment.response_ids += sampled.response_ids
        segment.response_mask += [1] * len(sampled.response_ids)
        segment.response_logprobs += list(sampled.response_logprobs)
        call = Call(index, start, sampled, chat, list(tool_calls or []), list(tool_call_errors or []))
        self.calls.append(call)
        return call

    def segments(self) -> tuple[list[Segment], list[Turn]]:
        """The segments, in the order they began, and one turn per call."""
        turns = [
            Turn(
                index=index,
                segment=call.segment,
                policy_version=call.sampled.policy_version,
                resumptions=call.sampled.resumptions,
                llm_server=call.sampled.server,
                response_start=call.response_start,
                response_tokens=len(call.sampled.response_ids),
                finish_reason=call.sampled.finish_reason,
                text=call.sampled.text,
                tool_calls=call.tool_calls,
                tool_call_errors=call.tool_call_errors,
                generate_s=call.sampled.generate_s,
            )
            for index, call in enumerate(self.calls)
        ]
        return [s.model_copy(deep=True) for s in self._segments], turns


def _extends(prompt: list[int], segment: Segment) -> bool:
    """Whether `prompt` starts with the segment's whole history (its prompt and response so far)."""
    head, body = segment.prompt_ids, segment.response_ids
    n = len(head) + len(body)
    return len(prompt) >= n and prompt[: len(head)] == head and prompt[len(head) : n] == body
