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
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..models import Segment, ToolCall, Turn
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
    them, and harnesses renumber them)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": _text(message.get("content"))}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {"name": c.get("function", c).get("name"), "arguments": _arguments(c.get("function", c).get("arguments"))}
            for c in calls
            if isinstance(c, dict)
        ]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as chat templates read it: text content, tool-call arguments as objects."""
    out = {k: v for k, v in message.items() if k != "content"}
    out["content"] = _text(message.get("content"))
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
            if isinstance(c, dict) and isinstance(c.get("function"), dict)
            else c
            for c in message["tool_calls"]
        ]
    return out


@dataclass
class Call:
    """One answered LLM call of the episode."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    messages: list[dict[str, Any]] | None  # canonical; None for a plain completion
    tools: str | None  # the tools, as canonical JSON
    reply: dict[str, Any] | None  # the canonical assistant message answered
    policy_version: int
    server: str
    finish_reason: str | None
    text: str
    tool_calls: list[ToolCall]
    generate_s: float

    @property
    def history(self) -> list[int]:
        return self.prompt_ids + self.response_ids


@dataclass
class CallLog:
    calls: list[Call] = field(default_factory=list)

    def chat_prompt(self, chat: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """The prompt ids of a chat request, by the token-history rule. Called on the tokenizer's thread."""
        rendered_messages = [template_message(m) for m in messages]
        parent = self._extended_call(messages, tools)
        if parent is not None:
            ids = self._extension(chat, parent, rendered_messages, tools)
            if ids is not None:
                return ids
        return chat.encode(chat.render(rendered_messages, tools, add_generation_prompt=True))

    def _extended_call(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> Call | None:
        """The latest call whose messages and answer start `messages`, with the same tools."""
        wanted = [canonical(m) for m in messages]
        key = tools_key(tools)
        for call in reversed(self.calls):
            if call.messages is None or call.tools != key or len(wanted) <= len(call.messages):
                continue
            n = len(call.messages)
            if wanted[:n] == call.messages and wanted[n] == call.reply:
                return call
        return None

    @staticmethod
    def _extension(
        chat: ChatTokenizer, parent: Call, messages: list[dict[str, Any]], tools: list[dict] | None
    ) -> list[int] | None:
        """parent's history + the ids of what `messages` add after its answer; None where the template renders
        the earlier turns differently once more follow (then the history cannot be kept as it was sampled)."""
        n = len(parent.messages or []) + 1
        before = chat.render(messages[:n], tools, add_generation_prompt=False)
        after = chat.render(messages, tools, add_generation_prompt=True)
        closing = chat.eos_text + chat.after_eos
        if not after.startswith(before) or not before.endswith(closing):
            return None
        closed = bool(parent.response_ids) and parent.response_ids[-1] == chat.eos_id
        new_text = chat.after_eos + after[len(before) :]
        return parent.history + chat.encode(new_text if closed else chat.eos_text + new_text)

    def record(self, call: Call) -> int:
        self.calls.append(call)
        return len(self.calls) - 1

    def segments(self) -> tuple[list[Segment], list[Turn]]:
        """The calls as segments (maximal chains of token extension, in call order) and one turn per call."""
        segments: list[Segment] = []
        tails: dict[int, int] = {}  # segment index -> length of its history so far, for the prefix test
        turns: list[Turn] = []
        for index, call in enumerate(self.calls):
            target = next(
                (
                    k
                    for k, seg in enumerate(segments)
                    if len(call.prompt_ids) >= tails[k]
                    and call.prompt_ids[: tails[k]] == seg.prompt_ids + seg.response_ids
                ),
                None,
            )
            if target is None:
                segments.append(
                    Segment(prompt_ids=call.prompt_ids, response_ids=[], response_mask=[], response_logprobs=[])
                )
                target = len(segments) - 1
                tails[target] = len(call.prompt_ids)
            seg = segments[target]
            context = call.prompt_ids[tails[target] :]
            seg.response_ids += context + call.response_ids
            seg.response_mask += [0] * len(context) + [1] * len(call.response_ids)
            seg.response_logprobs += [0.0] * len(context) + list(call.response_logprobs)
            tails[target] = len(seg.prompt_ids) + len(seg.response_ids)
            turns.append(
                Turn(
                    index=index,
                    segment=target,
                    policy_version=call.policy_version,
                    llm_server=call.server,
                    response_start=len(seg.response_ids) - len(call.response_ids),
                    response_tokens=len(call.response_ids),
                    finish_reason=call.finish_reason,
                    text=call.text,
                    tool_calls=call.tool_calls,
                    generate_s=call.generate_s,
                )
            )
        return segments, turns


def tools_key(tools: list[dict] | None) -> str | None:
    return None if not tools else json.dumps(tools, sort_keys=True)
