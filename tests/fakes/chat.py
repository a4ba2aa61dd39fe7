"""A stand-in for `ChatTokenizer` (NOT a model's tokenizer): one id per character, two special tokens, and a
ChatML-like template, so that unit tests need no model files. It has what the agent loop calls: `eos_id`,
`takes_tools`, `off_loop`, `prompt_ids` and `tool_turn_ids`, and `encode`/`decode` for the LLM stand-in and for
assertions."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

START, END = "<|im_start|>", "<|im_end|>"
SPECIAL = {START: 1, END: 2}
_SPECIAL_TEXT = {i: text for text, i in SPECIAL.items()}
_SPLIT = re.compile(f"({re.escape(START)}|{re.escape(END)})")
_OFFSET = 16  # character c is id ord(c) + _OFFSET, clear of the special ids


class CharChat:
    name = "char-chat"
    eos_id = SPECIAL[END]
    eos_text = END
    after_eos = "\n"  # what the template writes after the eos that closes an assistant turn
    takes_tools = True  # its template lays tools out in the system message, as Qwen2.5's does
    vocab_size = 0x110000 + _OFFSET  # every character

    async def off_loop(self, work: Callable[..., T], *args: Any, size: int | None = None) -> T:
        return work(*args)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPLIT.split(text):
            ids += [SPECIAL[part]] if part in SPECIAL else [ord(c) + _OFFSET for c in part]
        return ids

    def decode(self, ids: list[int]) -> str:
        return "".join(_SPECIAL_TEXT.get(i) or (chr(i - _OFFSET) if i >= _OFFSET else "\ufffd") for i in ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) for i in ids]

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        text = ""
        for message in messages:
            content = message["content"]
            if message["role"] == "system" and tools:
                content += "\n# Tools\n" + "\n".join(json.dumps(tool) for tool in tools)
            text += f"{START}{message['role']}\n{content}{END}\n"
        return text + (f"{START}assistant\n" if add_generation_prompt else "")

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def tool_turn_ids(self, tool_messages: list[dict[str, Any]], closed_by_eos: bool) -> list[int]:
        """What the template puts after an assistant turn: its closing, the tool messages, the next opening."""
        text = "\n" + self.render(tool_messages, tools=None, add_generation_prompt=True)
        return self.encode(text if closed_by_eos else END + text)
