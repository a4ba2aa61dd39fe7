"""The conversation in token space: the chat template applied locally, tool turns appended as token ids.

The prompt is rendered once with the model's own chat template. After that, the policy's sampled ids are
appended as they came back from the server, and each tool turn is appended as the ids of exactly the text
the template would put between the assistant's turn and the next one. That text is found once, by
rendering a short fixed conversation with and without a tool message and taking the difference, so each
turn costs one tokenization of the observation, not a re-render of the whole history.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from server_kit.errors import ProrlError

from ..models import ToolCall

T = TypeVar("T")

# Work on at most this many characters (or token ids) is done on the event loop: about a millisecond here
# (measured: 0.3 ms to encode a 1,161-character prompt), less than a hand-off to the tokenizer's thread costs in
# wake-ups (the thread's, then the loop's: 0.2-0.3 ms of CPU each on these virtual machines, bench_rollout).
INLINE_SIZE = 4096

_DUMMY = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


class TokenizerError(ProrlError, ValueError):
    """The tokenizer cannot serve the loop: it does not load, or its chat template is not one the loop can use.
    The message names the tokenizer; the service's start-up says which flag gives it (--tokenizer)."""


class ChatTokenizer:
    def __init__(self, name_or_path: str) -> None:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" banner
        from transformers import AutoTokenizer  # heavy import, paid once per process

        self.name = name_or_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except Exception as exc:  # a broken file fails transformers with anything: KeyError, OSError, Exception
            said = " ".join(f"{type(exc).__name__}: {exc}".split())
            raise TokenizerError(f"tokenizer {name_or_path!r} cannot be loaded ({said})") from exc
        if not self.tokenizer.chat_template:
            raise TokenizerError(f"tokenizer {name_or_path!r} has no chat template")
        self.eos_id: int = self.tokenizer.eos_token_id
        self.eos_text: str = self.tokenizer.eos_token
        self.vocab_size = len(self.tokenizer)  # every id it can decode, added tokens included
        rendered = self.render(_DUMMY, tools=None, add_generation_prompt=False)
        end = rendered.rfind(self.eos_text) if self.eos_text else -1
        if end < 0:
            raise TokenizerError(
                f"the chat template of tokenizer {name_or_path!r} does not end an assistant turn with the eos token"
            )
        # What the template writes after the eos that closes an assistant turn (ChatML: a newline).
        self.after_eos = rendered[end + len(self.eos_text) :]
        self._dummy_rendered = rendered
        # Whether the template lays tools out (Qwen2.5's does). SmolLM2's ignores them: `render` then describes
        # them in the system message itself, so that a model is never handed tools it cannot see.
        probe = [{"type": "function", "function": {"name": "probe_tool", "parameters": {"type": "object"}}}]
        self.takes_tools = "probe_tool" in self._apply(_DUMMY, probe, add_generation_prompt=False)
        # One thread for the service's large tokenisations: a megabyte prompt takes seconds, which must not stall
        # the event loop. The lock keeps the tokenizer to one caller at a time (it is not safe to share between
        # threads): small work runs on the loop only while the thread is not using it.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._lock = threading.Lock()

    async def off_loop(self, work: Callable[..., T], *args: Any, size: int | None = None) -> T:
        """`work(*args)` (one of this tokenizer's methods), on the tokenizer's own thread; work of a known `size`
        (characters to tokenize, ids to decode) up to INLINE_SIZE is done here at once if the tokenizer is free."""
        if size is not None and size <= INLINE_SIZE and self._lock.acquire(blocking=False):
            try:
                return work(*args)
            finally:
                self._lock.release()
        return await asyncio.get_running_loop().run_in_executor(self._thread, self._locked, work, *args)

    def _locked(self, work: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return work(*args)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        """The conversation as the model's template writes it. For a template without tools, the tools and the
        hermes call syntax go into the system message and an assistant's calls into its text (`with_tools_in_text`),
        which is what the loop and the gateway then parse."""
        if tools and not self.takes_tools:
            messages, tools = with_tools_in_text(messages, tools), None
        return self._apply(messages, tools, add_generation_prompt)

    def _apply(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's own text, as OpenAI's logprobs name tokens."""
        return self.tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]], closed_by_eos: bool) -> list[int]:
        """Ids that follow a sampled assistant turn: its closing, the tool messages, the next turn's opening.

        `closed_by_eos` says whether the sampled ids already end with the eos token; if the turn was cut
        (max_tokens), the eos is added here, as a template token the policy did not sample.
        """
        with_tools = self.render(_DUMMY + tool_messages, tools=None, add_generation_prompt=True)
        if not with_tools.startswith(self._dummy_rendered):
            raise ValueError("the chat template re-renders earlier turns when a tool message follows")
        text = self.after_eos + with_tools[len(self._dummy_rendered) :]
        return self.encode(text if closed_by_eos else self.eos_text + text)


def describe_tools(tools: list[dict]) -> str:
    """The tools and the hermes call syntax, as Qwen2.5's template writes them into its system message."""
    listing = "\n".join(json.dumps(tool) for tool in tools)
    return (
        f"# Tools\n\nYou may call the functions below. Their signatures:\n<tools>\n{listing}\n</tools>\n\n"
        "For each call, write a JSON object with the function's name and arguments inside <tool_call></tool_call> "
        'tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-object>}\n</tool_call>'
    )


def with_tools_in_text(messages: list[dict[str, Any]], tools: list[dict]) -> list[dict[str, Any]]:
    """`messages` for a template that knows no tools: the tools described at the end of the system message (one
    is put first where there is none), and each assistant's tool calls written into its text as the hermes
    blocks it would have sampled. Earlier messages render the same whatever follows them, as the token history
    needs (token_history.py)."""
    description = describe_tools(tools)
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system":
        out[0]["content"] = f"{out[0].get('content') or ''}\n\n{description}"
    else:
        out.insert(0, {"role": "system", "content": description})
    for message in out:
        calls = message.pop("tool_calls", None) if message.get("role") == "assistant" else None
        if calls:
            blocks = [
                "<tool_call>\n"
                + json.dumps({"name": c["function"]["name"], "arguments": c["function"].get("arguments", {})})
                + "\n</tool_call>"
                for c in calls
            ]
            message["content"] = "\n".join([t for t in [message.get("content") or ""] if t] + blocks)
    return out


def text_size(messages: list[dict[str, Any]], tools: list[dict] | None = None) -> int:
    """About how many characters rendering `messages` with `tools` gives: the size `off_loop` weighs."""
    return sum(len(str(m.get("content") or "")) for m in messages) + (len(json.dumps(tools)) if tools else 0)


@dataclass
class ParsedCalls:
    calls: list[ToolCall]
    errors: list[str]


_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> ParsedCalls:
    """Tool calls in a policy turn: hermes `<tool_call>{json}</tool_call>` blocks, or one OpenAI-style JSON
    object (`{"name", "arguments"}` or `{"tool_calls": [{"function": {...}}]}`) making up the whole turn.

    What cannot be parsed becomes an error message for the agent, never an exception.
    """
    calls: list[ToolCall] = []
    errors: list[str] = []
    blocks = _TOOL_CALL.findall(text)
    if not blocks:
        if "<tool_call>" in text:
            return ParsedCalls([], ["a <tool_call> was opened but never closed with </tool_call>"])
        stripped = text.replace("<|im_end|>", "").strip()
        if stripped.startswith("{"):
            blocks = [stripped]
    for index, block in enumerate(blocks, 1):
        try:
            payload = json.loads(block)
        except ValueError as exc:
            errors.append(f"tool call {index} is not valid JSON ({exc}): {block.strip()[:200]}")
            continue
        for item in payload.get("tool_calls", [payload]) if isinstance(payload, dict) else [payload]:
            call, error = _to_call(item.get("function", item) if isinstance(item, dict) else item)
            if error:
                errors.append(f"tool call {index}: {error}")
            else:
                calls.append(call)
    return ParsedCalls(calls, errors)


def strip_tool_calls(text: str) -> str:
    """The text of a turn that made tool calls, without them: what an OpenAI answer carries as `content`. A
    turn that was one JSON call as a whole leaves nothing."""
    if not _TOOL_CALL.search(text):
        return ""
    return _TOOL_CALL.sub("", text).strip()


def _to_call(item: Any) -> tuple[ToolCall | None, str | None]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None, 'expected an object with a string "name" and an object "arguments"'
    arguments = item.get("arguments", {})
    if isinstance(arguments, str):  # the OpenAI format carries arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as exc:
            return None, f"arguments of {item['name']!r} are not valid JSON: {exc}"
    if not isinstance(arguments, dict):
        return None, f'"arguments" of {item["name"]!r} must be an object'
    return ToolCall(name=item["name"], arguments=arguments), None


def _regex_literal(text: str) -> str:
    # Escapes only the metacharacters: `re.escape` also escapes spaces and dashes, which some of the
    # regex engines behind structured outputs refuse.
    return re.sub(r"([\\.^$*+?()\[\]{}|])", r"\\\1", text)


def _tool_call_parts(tool: str, argument: str) -> tuple[str, str]:
    """The text of a hermes tool call of `tool` around its one string `argument`'s JSON-escaped value."""
    return f'<tool_call>{{"name": {json.dumps(tool)}, "arguments": {{{json.dumps(argument)}: "', '"}}</tool_call>'


def tool_call_regex(tool: str, argument: str, values: list[str]) -> str:
    """A structured-output regex for exactly one hermes tool call of `tool` whose string `argument` is one of
    `values`: it lets a model that knows nothing (the tiny test model) make real, well-formed tool calls."""
    choices = "|".join(_regex_literal(json.dumps(value)[1:-1]) for value in values)
    prefix, suffix = _tool_call_parts(tool, argument)
    return _regex_literal(prefix) + f"({choices})" + _regex_literal(suffix)


def tool_call_texts(tool: str, argument: str, values: list[str]) -> list[str]:
    """Every text `tool_call_regex(tool, argument, values)` matches: the action set of a constrained turn."""
    prefix, suffix = _tool_call_parts(tool, argument)
    return [prefix + json.dumps(value)[1:-1] + suffix for value in values]
